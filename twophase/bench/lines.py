"""The LLM a bench line measures a backend through, the same in the bench's process and in a
line's process of its own (``bench/isolated.py``)."""

from __future__ import annotations

import dataclasses

from twophase.config import Config, SchedulerConfig, SpeculativeConfig


def bench_llm(cfg: Config, backend: str):
    """An LLM for ``backend`` whose scheduler suits the sweeps (one prompt = one step) and whose
    pool fits the sweeps and the serving workload alike."""
    from twophase.llm import LLM

    b, sc, cc = cfg.bench, cfg.scheduler, cfg.cache
    bs = cc.block_size
    blocks = lambda tokens: -(-tokens // bs)  # noqa: E731
    s = b.serving
    # room for every decode sweep's contexts at once, so later rounds find them in the prefix cache
    longest_request = blocks(s.input_len[1] + s.output_len[1])
    need = max(sum(b.batch_sizes) * blocks(b.decode_context + b.decode_steps + 2),
               2 * blocks(b.cache_depth + max(b.prompt_lens) + 2),
               sc.max_num_seqs * longest_request,
               blocks(max(b.prompt_lens) + s.output_len[1]) + max(b.batch_sizes) * longest_request)
    sweep_sched = SchedulerConfig(policy="prefill-first",
                                  max_num_seqs=max(max(b.batch_sizes), sc.max_num_seqs),
                                  max_num_batched_tokens=max(max(b.prompt_lens), max(b.batch_sizes) + 1),
                                  chunked_prefill=True)
    device = cfg.phases()[0].device
    run_cfg = dataclasses.replace(
        cfg, backend=dataclasses.replace(cfg.backend, name=backend, device=device, prefill=None,
                                         decode=None,
                                         options=cfg.backend.options if backend == cfg.backend.name else {}),
        scheduler=sweep_sched, speculative=SpeculativeConfig())   # --speculative adds a line
    if not isinstance(cc.num_blocks, int):     # a block a group where the layers are in groups
        need *= _kv_groups(run_cfg).num_groups
    num_blocks = cc.num_blocks if isinstance(cc.num_blocks, int) else need + 8
    run_cfg = dataclasses.replace(run_cfg, cache=dataclasses.replace(cc, num_blocks=num_blocks, prefix_caching=True))
    return LLM(run_cfg)


def _kv_groups(cfg: Config):
    """The pool's layout the engine will choose for ``cfg`` (the planner's rule)."""
    from twophase.backends.registry import Registry
    from twophase.plan.budget import kv_groups
    from twophase.plan.model_source import planned_model

    return kv_groups(cfg, planned_model(cfg.model).arch, Registry())
