"""The Python API: ``LLM.from_config(...)``, ``llm.generate(prompts, params)``.

``LLM`` is a facade over what ``twophase.builder.load`` makes of a config (the backends, the pool,
the plan) and the ``Engine`` built over it. ``llm.engine`` is the incremental API
(``add_request`` / ``step`` / ``abort``) for servers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twophase.backends.registry import Registry
from twophase.builder import Loaded, draft, load
from twophase.builder.adapters import adapter_manager
from twophase.builder.backends import Backends
from twophase.builder.checks import check_draft
from twophase.builder.engine import make_engine
from twophase.cache.layout import with_step_limits
from twophase.config import Config, SchedulerConfig, SpeculativeConfig, load_config
from twophase.core.engine import Engine, check_priority
from twophase.core.metrics import phase_report
from twophase.core.outputs import RequestOutput
from twophase.core.pooling import PoolingConfig, PoolingParams
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected

log = logging.getLogger(__name__)


def _priorities(priority: list[int] | None, n: int) -> list[int]:
    """One priority a prompt (default all 0), each checked before any request is queued."""
    if priority is None:
        return [0] * n
    if len(priority) != n:
        raise ValueError(f"{n} prompts but {len(priority)} priorities")
    return [check_priority(p) for p in priority]


class LLM:
    def __init__(self, config: Config, registry: Registry | None = None):
        self.registry = registry or Registry()
        self.loaded: Loaded = load(config, self.registry, make_engine=LLM)
        self.draft: LLM | None = None             # loaded by the first engine that drafts with it
        d = self.loaded
        try:          # the adapters every engine over these backends serves (None: none can be)
            self.adapters = adapter_manager(d.config, d.backends, d.model.arch)
        except BaseException:
            for b in d.backends.distinct():
                b.close()
            raise
        t0 = time.perf_counter()
        self.engine = self.build_engine()
        engine_s = time.perf_counter() - t0           # a draft model loads here
        self.loaded.load_breakdown_s["engine"] = engine_s
        self.loaded.load_time_s += engine_s

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any]) -> "LLM":
        return cls(load_config(source))

    # -- what the load made ---------------------------------------------------------------------
    @property
    def config(self) -> Config:
        return self.loaded.config

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.model.tokenizer

    @property
    def spec(self):
        return self.loaded.spec

    @property
    def plan(self):
        return self.loaded.plan

    @property
    def routing(self):
        return self.loaded.routing

    @property
    def prefill_backend(self):
        return self.loaded.backends.prefill

    @property
    def decode_backend(self):
        return self.loaded.backends.decode

    @property
    def decode_routes(self):
        return self.loaded.backends.routes

    @property
    def kv_cache(self):
        return self.loaded.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.loaded.layout.num_blocks

    @property
    def max_model_len(self) -> int:
        """The longest request: the model's context, the config's, or what the pool holds."""
        return self.loaded.layout.max_model_len

    @property
    def memory(self) -> dict[str, Any]:
        return self.loaded.memory

    @property
    def load_time_s(self) -> float:
        return self.loaded.load_time_s

    @property
    def load_breakdown_s(self) -> dict[str, float]:
        return self.loaded.load_breakdown_s

    # -- the engine -------------------------------------------------------------------------------
    def build_engine(self, clock: Callable[[], float] = time.perf_counter,
                     sleep: Callable[[float], None] = time.sleep) -> Engine:
        """A fresh engine (scheduler, prefix cache, step records) over the same backends and pool."""
        d = self.loaded
        return make_engine(d.config, d.layout, d.kv_cache, d.backends, d.model.arch, self.tokenizer,
                           self._draft_backends, f"{id(self):x}", clock=clock, sleep=sleep,
                           adapters=self.adapters, spec=d.spec,
                           pooling=PoolingConfig.read(None if d.model.weights == "random" else d.model.weights))

    def _draft_backends(self) -> tuple[Backends, int]:
        """The draft model (``method = "draft"``), loaded once, with a pool as large as the
        target's unless its ``num_blocks`` says otherwise: its backends and its blocks."""
        if self.draft is None:
            cfg = self.loaded.draft_config
            assert cfg is not None
            self.draft = LLM(draft.with_pool(cfg, self.num_blocks), self.registry)
        return self.draft.loaded.backends, self.draft.num_blocks

    # -- generation -------------------------------------------------------------------------
    def apply_chat_template(self, prompt: str) -> str:
        if self.tokenizer is None:
            raise RequestRejected("this model has no tokenizer, so no chat template")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the prompts' order, a prompt with
        ``n`` choices as ``n`` outputs in a row (``output.index`` says which). A prompt that can
        never be served comes back with ``finish_reason = "rejected"`` and the reason (once a
        choice). ``priority``: one a prompt, as vLLM's (the lower value starts first; default
        all 0)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        priority = _priorities(priority, len(prompts))
        outputs: list[RequestOutput | None] = [None] * sum(p.n for p in params)
        pending = self._add_all(prompts, params, priority, outputs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(pending), desc="generating", unit="req")
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.output is not None and d.request_id in pending:
                    outputs[pending.pop(d.request_id)] = d.output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return outputs  # type: ignore[return-value]

    def _add_all(self, prompts: list, params: list[SamplingParams], priority: list[int],
                 outputs: list[RequestOutput | None]) -> dict[str, int]:
        """Queue every prompt; each request id's place in ``outputs`` (a prompt's choices in a
        row). A rejected prompt's outputs are filled here, once a choice."""
        first = [sum(p.n for p in params[:i]) for i in range(len(params))]
        pending: dict[str, int] = {}
        for i, (prompt, p, prio) in enumerate(zip(prompts, params, priority)):
            try:
                req = self.engine.add_request(prompt, p, priority=prio)
                for r in [req, *req.forks]:
                    pending[r.request_id] = first[i] + r.index
            except RequestRejected as exc:
                log.warning("prompt %d rejected: %s", i, exc)
                for j in range(p.n):
                    outputs[first[i] + j] = dataclasses.replace(
                        RequestOutput.rejected(f"rejected-{i}", prompt, str(exc)), index=j)
        return pending

    def embed(self, prompts: str | list[int] | list[str | list[int]],
              pooling: PoolingParams | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (``RequestOutput.embedding``, float32 values), in the prompts'
        order, computed as prefill-only work through the scheduler (``core/pooling.py``).
        ``pooling`` defaults to the model's config (``PoolingParams()``). A prompt that can never
        be served comes back with ``finish_reason = "rejected"`` and the reason."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooling = pooling or PoolingParams()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        pending: dict[str, int] = {}
        for i, prompt in enumerate(prompts):
            try:
                pending[self.engine.add_request(prompt, pooling=pooling).request_id] = i
            except RequestRejected as exc:
                log.warning("prompt %d rejected: %s", i, exc)
                outputs[i] = RequestOutput.rejected(f"rejected-{i}", prompt, str(exc))
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.output is not None and d.request_id in pending:
                    outputs[pending.pop(d.request_id)] = d.output
        return outputs  # type: ignore[return-value]

    def report(self, outputs: list[RequestOutput] = ()) -> dict[str, Any]:
        """The phase report over every step since the last ``reset_stats``, with latencies of
        ``outputs``."""
        served = [o for o in outputs if o.times is not None]
        rep = phase_report(self.engine.step_records(), [o.times for o in served],
                           sum(len(o.token_ids) for o in served))
        rep["prefix_cache_hit_rate"] = self.engine.stats().prefix_hit_rate
        tiers = self.engine.tier_stats()
        if tiers is not None:                     # hits by tier, bytes moved, restore time
            rep["kv_tiers"] = tiers
        rep["kv_blocks_total"] = self.num_blocks
        rep["memory"] = self.memory
        rep["load_time_s"] = self.load_time_s
        rep["load_breakdown_s"] = dict(self.load_breakdown_s)
        p, d = self.config.phases()
        rep["backend"] = {"prefill": p.name, "decode": d.name, "device": p.device}
        if self.draft is not None and self.config.speculative.method == "draft":
            dp, dd = self.draft.config.phases()
            rep["backend"]["draft"] = {"model": self.draft.model.model_id, "prefill": dp.name,
                                       "decode": dd.name, "quantization": self.draft.spec.quantization}
        return rep

    def reschedule(self, scheduler: SchedulerConfig, speculative: SpeculativeConfig | None = None) -> None:
        """New scheduler (and speculative decoding) settings over the same backends and pool
        (between runs: any request still in flight is dropped with the old engine)."""
        d = self.loaded
        d.config = dataclasses.replace(d.config, scheduler=scheduler, speculative=speculative or d.config.speculative)
        if speculative is not None:
            d.draft_config = check_draft(d.config, d.model)
        settings = dataclasses.replace(d.settings, max_num_seqs=scheduler.max_num_seqs,
                                       chunked_prefill=scheduler.chunked_prefill,
                                       max_num_batched_tokens=scheduler.max_num_batched_tokens)
        d.layout = with_step_limits(d.layout, settings, self.prefill_backend.capabilities(),
                                    [self.decode_backend.capabilities()])
        self.engine = self.build_engine()

    def close(self) -> None:
        """Release the backends' resources (device memory, runtime sessions)."""
        self.engine.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_stats(self) -> None:
        self.engine.reset_stats()
