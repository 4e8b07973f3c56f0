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


class Recording:
    """A replica handle that takes jobs and streams nothing back."""

    disaggregated = False

    def __init__(self) -> None:
        self.jobs: list = []
        self.handle = self

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, job):
        self.jobs.append(job)

        async def nothing():
            return
            yield

        return nothing()


def test_the_priority_travels_with_the_job():
    cluster = Recording()
    loop = ClusterLoop(cluster, None, 1024, max_queue=2)   # type: ignore[arg-type]

    async def go():
        loop.submit([1, 2, 3], SamplingParams(max_tokens=4), priority=-2)
        loop.submit([1, 2, 3], SamplingParams(max_tokens=4))
        await asyncio.sleep(0.01)

    asyncio.run(go())
    assert [j.priority for j in cluster.jobs] == [-2, 0]
