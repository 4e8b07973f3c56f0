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
    num_blocks = cc.num_blocks if isinstance(cc.num_blocks, int) else need + 8
    sweep_sched = SchedulerConfig(policy="prefill-first",
                                  max_num_seqs=max(max(b.batch_sizes), sc.max_num_seqs),
                                  max_num_batched_tokens=max(max(b.prompt_lens), max(b.batch_sizes) + 1),
                                  chunked_prefill=True)
    device = cfg.phases()[0].device
    run_cfg = dataclasses.replace(
        cfg, backend=dataclasses.replace(cfg.backend, name=backend, device=device, prefill=None,
                                         decode=None,
                                         options=cfg.backend.options if backend == cfg.backend.name else {}),
        scheduler=sweep_sched, cache=dataclasses.replace(cc, num_blocks=num_blocks, prefix_caching=True),
        speculative=SpeculativeConfig())       # the sweeps measure plain steps; --speculative adds a line
    return LLM(run_cfg)
