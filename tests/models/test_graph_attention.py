"""The exported graphs' function (static-dataflow paged attention) equals the eager model on
mixed batches: decodes, chunks after cached tokens and fresh prompts in one step."""

from __future__ import annotations

import torch
from helpers.models import tiny_llm

from twophase import SamplingParams
from twophase.core.batch import prefill_batch
from twophase.exporters.onnx import PagedStep, run_eager
from twophase.graph.inputs import step_inputs, write_new_kv


def _mixed_batch(llm):
    """Advance an engine until a step mixes decodes with chunks; return that step's batch."""
    eng = llm.engine
    for i, n in enumerate([40, 3, 75, 1, 20]):
        eng.add_request([3 + (7 * i + j) % 500 for j in range(n)],
                        SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    eng.add_request(list(range(10, 60)), SamplingParams(max_tokens=5))
    sched = eng.scheduler.schedule()
    assert sched.decodes and sched.prefills
    items = [(r, r.num_computed_tokens, 1) for r in sched.decodes] + \
            [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
    assert any(s > 0 and n > 1 for _, s, n in items), "want a chunk after cached tokens"
    return prefill_batch(items, eng.kv)


def test_graph_function_equals_eager_on_a_mixed_batch():
    llm = tiny_llm(scheduler={"max_num_batched_tokens": 40, "max_num_seqs": 8},
                   cache={"block_size": 4, "num_blocks": 128})
    batch = _mixed_batch(llm)
    pool = llm.kv_cache.pool
    before = pool.clone()
    for mode in ("last", "all"):
        batch.logits = mode
        pool.copy_(before)
        want = llm.prefill_backend.prefill(batch)
        after = pool.clone()
        logits, new_k, new_v = run_eager(PagedStep(llm.prefill_backend.model), before.clone(),
                                         step_inputs(batch, llm.kv_cache))
        assert logits.shape == want.shape
        assert float((logits - want).abs().max() / want.abs().max()) < 1e-5, mode
        mine = before.clone()
        write_new_kv(mine, new_k, new_v, batch.slot_mapping)
        assert torch.allclose(mine, after, atol=1e-6)


def test_graph_function_handles_decodes_only_and_chunks_only():
    llm = tiny_llm(cache={"block_size": 4, "num_blocks": 128})
    eng = llm.engine
    reqs = [eng.add_request(list(range(5, 5 + n)), SamplingParams(max_tokens=9, ignore_eos=True))
            for n in (9, 17)]
    sched = eng.scheduler.schedule()
    chunks = prefill_batch([(r, 0, n) for r, n in sched.prefills], eng.kv)
    before = llm.kv_cache.pool.clone()
    want = llm.prefill_backend.prefill(chunks)
    got, _, _ = run_eager(PagedStep(llm.prefill_backend.model), before, step_inputs(chunks, llm.kv_cache))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    for r, n in sched.prefills:
        r.num_computed_tokens += n
        r.token_ids.append(7)
    eng.scheduler.schedule()        # allocates the decode slots
    dec = prefill_batch([(r, r.num_computed_tokens, 1) for r in reqs], eng.kv)
    before = llm.kv_cache.pool.clone()
    want = llm.prefill_backend.prefill(dec)
    got, _, _ = run_eager(PagedStep(llm.prefill_backend.model), before, step_inputs(dec, llm.kv_cache))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_graph_function_equals_eager_with_windows_and_soft_caps(tmp_path):
    """Gemma 2's layers (a window of 24 on alternate layers, soft-capped scores and logits) over
    a pool in groups (the sliding layers' table loses the blocks its window passed): the
    static-dataflow attention equals the eager one on a mixed batch past the window, and its new
    K/V land where the eager step wrote them."""
    from helpers.hf_models import tiny_hf_model

    from twophase import LLM

    tiny_hf_model("gemma2", tmp_path)
    llm = LLM.from_config({"model": {"path": str(tmp_path)}, "cache": {"block_size": 4, "num_blocks": 128},
                           "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}})
    assert {"sliding_window", "attn_softcap"} <= llm.model.arch.features()
    assert llm.kv_cache.groups is not None and llm.kv_cache.groups.num_groups > 1
    batch = _mixed_batch(llm)
    assert batch.block_tables.dim() == 3
    before = llm.kv_cache.pool.clone()
    batch.logits = "all"
    want = llm.prefill_backend.prefill(batch)
    after = llm.kv_cache.pool.clone()
    logits, new_k, new_v = run_eager(PagedStep(llm.prefill_backend.model), before.clone(),
                                     step_inputs(batch, llm.kv_cache))
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-5
    mine = before.clone()
    write_new_kv(mine, new_k, new_v, batch.slot_mapping, llm.kv_cache.groups)
    assert torch.allclose(mine, after, atol=1e-6)
