"""What the engine's public methods hand out and take back, as values: modules outside ``core``
(the server, the simulator, benchmarks) read these instead of the engine's scheduler, KV manager
or step log, so those can change without them."""

from __future__ import annotations

from dataclasses import dataclass

from twophase.core.metrics import StepRecord
from twophase.core.outputs import Delta
from twophase.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt tokenised and checked against every limit for ``params`` (``Engine.prepare``):
    ``Engine.add_request`` queues it without checking it again."""

    token_ids: tuple[int, ...]
    params: SamplingParams
    text: str | None = None             # the prompt as given, where it was text


@dataclass(frozen=True)
class StepResult:
    """One step's deltas and the record of what it computed."""

    deltas: list[Delta]
    record: StepRecord | None           # None: nothing ran (no work yet, or K/V still on the way)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load and prefix cache at one moment (a copy: safe to read on any thread)."""

    total_blocks: int
    free_blocks: int
    used_blocks: int
    prefix_queries: int     # prompt tokens looked up in the prefix cache since the last reset
    prefix_hits: int        # of which it held
    running: int            # requests holding blocks and computing
    waiting: int            # requests queued for their first (or, after preemption, next) step
    num_steps: int          # step records kept since the last reset (the newest 200,000)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
