"""``[backend] name = "auto"``: the choice a timing table implies, decode routed by batch size
through the engine with the reference's tokens, the calibration cached, and the command that
shows it."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from helpers.models import random_prompts

from twophase import LLM, SamplingParams
from twophase.backends.registry import Registry
from twophase.builder import routing
from twophase.config import load_config
from twophase.errors import ConfigError

TINY = {"name": "tiny", "weights": "random"}


def _table(prefill, decode):
    return {"prefill_tokens": 512, "context": 128, "prefill": prefill,
            "decode": {k: {str(b): x for b, x in v.items()} for k, v in decode.items()}}


def test_each_phase_goes_to_the_fastest_and_decode_splits_where_backends_cross():
    t = _table({"a": 900, "b": 1200},
               {"a": {1: 200, 2: 250, 4: 300, 8: 320, 16: 330},
                "b": {1: 100, 2: 180, 4: 310, 8: 500, 16: 700}})
    r = routing.choose(t)
    assert (r.prefill, r.routes, r.decode) == ("b", [(2, "a")], "b")
    assert r.describe() == "prefill on b; decode on batch <= 2: a, larger: b"


def test_a_second_backend_must_beat_the_prefills_by_the_margin():
    t = _table({"a": 900, "b": 1200}, {"a": {1: 104, 4: 300}, "b": {1: 100, 4: 310}})
    r = routing.choose(t)                           # a is 4% faster at batch 1: not worth its weights
    assert (r.prefill, r.routes, r.decode) == ("b", [], "b")


def test_a_phase_named_in_the_config_stays_there():
    t = _table({"a": 900, "b": 1200}, {"a": {1: 500}, "b": {1: 100}})
    assert routing.choose(t, prefill="a").prefill == "a"
    assert routing.choose(t, decode="b").decode == "b"
    assert routing.choose(t, decode="b").routes == []


def test_an_unknown_model_is_its_own_error_not_every_backends():
    with pytest.raises(ConfigError, match="^model.name: unknown model 'nosuch'"):
        routing.resolve(load_config({"model": {"name": "nosuch"}, "backend": {"name": "auto"}}), Registry(),
                        make_engine=LLM)


def test_candidates_say_why_a_backend_is_left_out():
    reg = Registry()
    cfg = load_config({"model": {**TINY, "quantization": "q4"}, "backend": {"name": "auto"}})
    names, left_out = routing.candidates(cfg, reg)
    assert "torch" not in names and left_out["torch"] == "does not run 'q4' weights"
    with pytest.raises(ConfigError, match="backend.options.candidates: no backend named 'numpyy'"):
        routing.candidates(load_config({"model": TINY, "backend": {"name": "auto", "options": {
            "candidates": ["torch", "numpyy"]}}}), reg)
    with pytest.raises(ConfigError, match="backend.options.pool: auto takes only candidates, threads"):
        routing.candidates(load_config({"model": TINY, "backend": {"name": "auto", "options": {"pool": 1}}}), reg)


def test_decode_routed_by_batch_size_keeps_the_tokens_and_uses_each_backend(monkeypatch):
    pytest.importorskip("onnxruntime")
    fixed = routing.Routing("torch", "onnxruntime", [(2, "torch")])
    monkeypatch.setattr(routing, "resolve", lambda config, registry, **kw: fixed)
    cache = {"num_blocks": 64, "block_size": 4}
    llm = LLM.from_config({"model": TINY, "backend": {"name": "auto"}, "cache": cache})
    assert llm.decode_routes and llm.decode_routes[0][1] is llm.prefill_backend
    assert llm.decode_backend.name == "onnxruntime"
    seen = []
    for b in (llm.prefill_backend, llm.decode_backend):
        decode = b.decode
        b.decode = lambda batch, _d=decode, _n=b.name: seen.append((_n, batch.num_seqs)) or _d(batch)
    prompts = random_prompts(6, seed=1, longest=30)
    p = [SamplingParams(max_tokens=3 + 3 * i, ignore_eos=True) for i in range(6)]    # the batch shrinks
    got = [o.token_ids for o in llm.generate(prompts, p)]
    ref = LLM.from_config({"model": TINY, "cache": cache})
    assert got == [o.token_ids for o in ref.generate(prompts, p)]
    assert {n for n, seqs in seen if seqs <= 2} == {"torch"}
    assert {n for n, seqs in seen if seqs > 2} == {"onnxruntime"}


def test_a_candidate_computing_in_bf16_prefills_in_it_beside_a_float32_decode(monkeypatch):
    """``torch:bfloat16`` (torch's ``compute_dtype``) is a candidate only where named: routed to
    prefill, its weights are bf16 and it writes the float32 pool that torch in float32 decodes
    from, a route of its own at small batches; a dtype on another backend is refused by name."""
    import torch

    reg = Registry()
    auto = {"name": "auto", "options": {"candidates": ["torch", "torch:bfloat16"]}}
    names, _ = routing.candidates(load_config({"model": TINY, "backend": auto}), reg)
    assert names == ["torch", "torch:bfloat16"]
    assert "torch:bfloat16" not in routing.candidates(load_config({"model": TINY, "backend": {"name": "auto"}}), reg)[0]
    for bad in ("native:bfloat16", "torch:int8"):
        with pytest.raises(ConfigError, match=f"candidates: '{bad}': a candidate's compute dtype is torch's"):
            routing.candidates(load_config({"model": TINY, "backend": {"name": "auto", "options": {
                "candidates": ["torch", bad]}}}), reg)
    t = _table({"torch": 900, "torch:bfloat16": 2400},
               {"torch": {1: 300, 2: 320, 4: 330}, "torch:bfloat16": {1: 100, 2: 180, 4: 340}})
    chosen = routing.choose(t)
    assert (chosen.prefill, chosen.routes, chosen.decode) == ("torch:bfloat16", [(2, "torch")], "torch:bfloat16")
    monkeypatch.setattr(routing, "resolve", lambda config, registry, **kw: chosen)
    cache = {"num_blocks": 64, "block_size": 4}
    llm = LLM.from_config({"model": TINY, "backend": auto, "cache": cache})
    assert llm.prefill_backend.compute_dtype("prefill") == torch.bfloat16
    assert llm.prefill_backend.model.embed.weight.dtype == torch.bfloat16
    small = llm.decode_routes[0][1]
    assert small is not llm.prefill_backend and small.compute_dtype("decode") is None
    assert llm.kv_cache.pool.dtype == torch.float32
    prompts = random_prompts(4, seed=2, longest=30)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    with pytest.raises(ConfigError, match="backend.options.compute_dtype: must be one of float32, bfloat16"):
        LLM.from_config({"model": TINY, "backend": {"name": "torch", "options": {"compute_dtype": "int4"}}})


def test_calibration_is_measured_once_and_cached(monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(routing.machine, "busy_reasons", lambda m: [])     # as on a quiet machine
    cfg = load_config({"model": TINY, "backend": {"name": "auto"},
                       "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}})
    reg = Registry()
    first = routing.resolve(cfg, reg, make_engine=LLM, recalibrate=True)
    assert set(first.table["prefill"]) == {"torch", "onnxruntime"}
    assert set(first.table["decode"]["torch"]) == {"1", "2", "4"}
    monkeypatch.setattr(routing, "calibrate", lambda *a: pytest.fail("measured again"))
    again = routing.resolve(cfg, reg, make_engine=LLM)
    assert again.table == first.table and again.describe() == first.describe()


def test_backends_command_shows_the_table_it_chose_from(tmp_path):
    pytest.importorskip("onnxruntime")
    r = subprocess.run([sys.executable, "-m", "twophase", "backends", "--model", "tiny"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "tokens/s here" in r.stdout and "left out: native: does not run 'none' weights" in r.stdout
    assert "auto: prefill on " in r.stdout
    # how each graph backend computes experts, below the table
    assert "onnxruntime: mixture-of-experts MLPs: ONNX Runtime's fused MoE operator" in " ".join(r.stdout.split())


SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 64}


def test_auto_times_a_model_with_a_context_of_its_own():
    pytest.importorskip("onnxruntime")
    cfg = load_config({"model": {**TINY, "max_model_len": 1500}, "backend": {"name": "auto"}, "scheduler": SMALL})
    r = routing.resolve(cfg, Registry(), make_engine=LLM, recalibrate=True)
    assert set(r.table["prefill"]) == {"torch", "onnxruntime"}
    assert LLM.from_config({"model": {**TINY, "max_model_len": 1500}, "backend": {"name": "auto"},
                            "scheduler": SMALL}).max_model_len == 1500


def test_a_candidate_that_refuses_the_model_is_left_out_with_its_reason(monkeypatch):
    pytest.importorskip("onnxruntime")
    from twophase.backends.onnxruntime import OnnxRuntimeBackend

    def refuse(self, model, cfg):
        raise ConfigError("model.dtype", "not this one")

    monkeypatch.setattr(OnnxRuntimeBackend, "load", refuse)
    cfg = load_config({"model": {**TINY, "seed": 7}, "backend": {"name": "auto"}, "scheduler": SMALL})
    r = routing.resolve(cfg, Registry(), make_engine=LLM, recalibrate=True)
    assert (r.prefill, r.decode) == ("torch", "torch")
    assert r.table["left_out"]["onnxruntime"] == "model.dtype: not this one"
    monkeypatch.undo()                         # it loads again: the next start times it again
    assert set(routing.resolve(cfg, Registry(), make_engine=LLM).table["prefill"]) == {"torch", "onnxruntime"}


def test_a_torn_cache_file_is_measured_again(monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(routing.machine, "busy_reasons", lambda m: [])     # as on a quiet machine
    cfg = load_config({"model": TINY, "backend": {"name": "auto"}, "scheduler": SMALL})
    reg = Registry()
    first = routing.resolve(cfg, reg, make_engine=LLM)
    names, _ = routing.candidates(cfg, reg)
    from twophase.paths import cache_dir

    (cache_dir() / "routing" / f"{routing._key(cfg, names)}.json").write_text('{"prefill": {"tor')
    measured = []
    calibrate = routing.calibrate
    monkeypatch.setattr(routing, "calibrate", lambda *a: measured.append(1) or calibrate(*a))
    again = routing.resolve(cfg, reg, make_engine=LLM)
    assert measured and set(again.table["prefill"]) == set(first.table["prefill"])


def test_a_first_run_routes_by_the_stored_table_and_says_so_without_timing(monkeypatch, caplog):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(routing, "calibrate", lambda *a: pytest.fail("a first run timed the backends"))
    cfg = {"model": TINY, "backend": {"name": "auto"}, "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 40}}
    with caplog.at_level(logging.INFO, "twophase"):
        llm = LLM.from_config(cfg)
    assert (llm.routing.prefill, llm.routing.decode) == ("torch", "torch")
    assert "not measured here yet" in caplog.text and "twophase backends CONFIG" in caplog.text
    q4 = routing.stored(load_config({**cfg, "model": {**TINY, "quantization": "q4"}}), ["onnxruntime", "native"], {})
    assert (q4.prefill, q4.decode) == ("native", "native")


def test_a_timing_taken_on_a_busy_machine_routes_the_run_but_is_not_cached(monkeypatch, caplog):
    """Figures measured under load say so, and the next start times the backends again rather than
    trusting them as if the machine had been quiet."""
    pytest.importorskip("onnxruntime")
    cfg = load_config({"model": TINY, "backend": {"name": "auto"}, "scheduler": SMALL})
    reg = Registry()
    from twophase.paths import cache_dir

    path = cache_dir() / "routing" / f"{routing._key(cfg, routing.candidates(cfg, reg)[0])}.json"
    path.unlink(missing_ok=True)              # another test's quiet table for this config
    monkeypatch.setattr(routing.machine, "busy_reasons", lambda m: ["1-minute load 9.00 on 2 cores"])
    with caplog.at_level(logging.WARNING):
        busy = routing.resolve(cfg, reg, make_engine=LLM, recalibrate=True)
    assert busy.table["busy"] == ["1-minute load 9.00 on 2 cores"] and "machine" in busy.table
    assert "timed while the machine was busy" in caplog.text and not path.exists()
    measured = []
    calibrate = routing.calibrate
    monkeypatch.setattr(routing, "calibrate", lambda *a: measured.append(1) or calibrate(*a))
    routing.resolve(cfg, reg, make_engine=LLM)
    assert measured, "a busy machine's table was cached and reused"
