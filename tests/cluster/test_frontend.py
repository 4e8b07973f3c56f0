"""The frontend's bookkeeping, without a cluster behind it."""

from __future__ import annotations

import asyncio

from twophase.cluster.frontend import ClusterLoop
from twophase.core.sampling_params import SamplingParams


class NoCluster:
    disaggregated = False
    handle = None


def test_a_request_aborted_before_its_task_ran_gives_its_slot_back():
    loop = ClusterLoop(NoCluster(), None, 1024, max_queue=2)   # type: ignore[arg-type]

    async def go():
        for _ in range(5):                      # more than max_queue: slots must come back
            loop.submit([1, 2, 3], SamplingParams(max_tokens=4)).abort()   # before any await
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        for _ in range(3):                      # n = 2: a request a choice, each a slot
            for h in loop.submit_choices([1, 2, 3], SamplingParams(max_tokens=4, n=2)):
                h.abort()
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert loop.in_flight == 0
