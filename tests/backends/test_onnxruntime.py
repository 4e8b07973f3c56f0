"""The onnxruntime backend: the exported graph equals the torch model, alone and with the
phases routed to different backends; stale or corrupt exports are rebuilt."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.models import (
    GREEDY_TOKENS,
    assert_prefix_hits_give_torch_tokens,
    assert_same_tokens_with_preemption,
    random_prompts,
    tiny_llm,
)

from twophase import LLM, SamplingParams
from twophase.contract import BackendUnavailable
from twophase.core.batch import decode_batch, prefill_batch
from twophase.exporters import onnx as exporter
from twophase.exporters.cache import is_fresh
from twophase.testing import assert_greedy_match, logprob_gaps

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("backend", [
    {"name": "onnxruntime"},
    {"prefill": {"name": "onnxruntime"}, "decode": {"name": "torch"}},
    {"prefill": {"name": "torch"}, "decode": {"name": "onnxruntime"}},
])
def test_greedy_tokens_equal_torch_with_chunking_and_preemption(backend, preempting_torch_tokens):
    assert_same_tokens_with_preemption(backend, preempting_torch_tokens)


def test_prefix_cache_hits_through_onnxruntime():
    assert_prefix_hits_give_torch_tokens("onnxruntime")


@pytest.mark.parametrize("case", ["fresh prompts", "chunk after cached tokens",
                                  "decodes of unequal lengths", "all positions"])
def test_logits_match_torch_on_the_same_pool(case):
    """Both backends run the same batch on copies of one pool: logits within 1e-4 relative."""
    llm = tiny_llm(cache={"num_blocks": 128, "block_size": 4})
    ort = llm.registry.get("onnxruntime")()
    from twophase.contract import BackendConfig, KVCache

    ort.load(llm.spec, BackendConfig("onnxruntime"))
    eng = llm.engine
    reqs = [eng.add_request(list(range(3 + i, 3 + i + n)), SamplingParams(max_tokens=8, ignore_eos=True))
            for i, n in enumerate((9, 30, 21))]
    if case != "fresh prompts":
        while any(r.num_output_tokens < 2 for r in reqs):
            eng.step()
    if case == "chunk after cached tokens":
        reqs = [eng.add_request(list(range(3, 3 + 9)) + list(range(200, 230)), SamplingParams(max_tokens=3))]
    sched = eng.scheduler.schedule()
    items = [(r, r.num_computed_tokens, 1) for r in sched.decodes] + \
            [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
    if case == "chunk after cached tokens":
        assert any(s > 0 and n > 1 for _, s, n in items)
    if case == "decodes of unequal lengths":
        assert len({s for _, s, _ in items}) > 1 and all(n == 1 for _, _, n in items)
    batch = prefill_batch(items, eng.kv)
    batch.logits = "all" if case == "all positions" else "last"
    before = llm.kv_cache.pool.clone()
    want = llm.prefill_backend.prefill(batch)
    torch_pool = llm.kv_cache.pool.clone()
    ort.bind_kv_cache(KVCache(before, 4))
    got = ort.prefill(batch)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.allclose(before, torch_pool, atol=1e-5)       # the same K/V written


def test_stale_and_corrupt_exports_are_rebuilt(tmp_path, caplog):
    import shutil

    from twophase.contract import BackendConfig

    llm = tiny_llm()
    spec = llm.spec
    cached = exporter.export(spec)                      # shared with the other tests
    assert exporter.export(spec) == cached               # reused, not exported again
    manifest = json.loads((cached.parent / "manifest.json").read_text())
    assert manifest["weights_sha256"] == "random:0" and manifest["opset"] == exporter.OPSET
    other = dataclasses.replace(llm.spec, seed=1)
    assert not is_fresh(cached.parent, exporter.manifest_for(other))   # stale weights
    folder = tmp_path / "export"
    shutil.copytree(cached.parent, folder)
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])            # truncated: caught by the manifest
    assert not is_fresh(folder, exporter.manifest_for(spec))
    shutil.rmtree(folder)
    shutil.copytree(cached.parent, folder)
    graph = folder / "model.onnx"
    graph.write_bytes(b"\0" * graph.stat().st_size)     # same size, garbage: caught by ORT
    ort = llm.registry.get("onnxruntime")()
    ort.load(spec, BackendConfig("onnxruntime", options={"export_dir": str(folder)}))
    assert "exporting again" in caplog.text
    assert is_fresh(folder, exporter.manifest_for(spec))
    assert graph.read_bytes()[:1] != b"\0"


def test_cuda_without_the_cuda_provider_is_a_clear_error():
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(BackendUnavailable, match="onnxruntime-gpu"):
        tiny_llm(backend={"name": "onnxruntime", "device": "cuda"})


def test_a_pool_past_the_cuda_gather_limit_is_refused_without_64_bit_offsets(monkeypatch):
    """llama3-8b's pool in what an H200 holds is 6.3e10 elements; the graphs gather from all of
    it, which an onnxruntime whose CUDA Gather offsets are 32-bit reads out of bounds."""
    import onnxruntime

    from twophase.backends.onnxruntime import OnnxRuntimeBackend
    from twophase.contract import KVCache
    from twophase.errors import ConfigError

    backend = OnnxRuntimeBackend()
    backend.dtype, backend.device = torch.float32, torch.device("cuda")
    pool = torch.empty(32, 2, 60_000, 8, 16, 128, device="meta")
    monkeypatch.setattr(onnxruntime, "__version__", "1.24.4")
    with pytest.raises(ConfigError, match=r"cache.num_blocks: a pool of 60000 blocks holds 62,914,560,000 "
                                          r"elements.*at most 2047 blocks, or onnxruntime-gpu >= 1.26"):
        backend.bind_kv_cache(KVCache(pool, 16))
    backend.bind_kv_cache(KVCache(pool[:, :, :2047], 16))
    monkeypatch.setattr(onnxruntime, "__version__", "1.26.0")
    backend.bind_kv_cache(KVCache(pool, 16))


def test_dtypes_and_weight_formats_each_device_runs_are_named():
    """q4 on CUDA is refused by name (its int8-activation kernels are the CPU's); bfloat16 runs
    on CUDA where onnxruntime binds it (1.20: by its ONNX element type) and is refused with the
    reason elsewhere."""
    import dataclasses

    from twophase.backends.onnxruntime import check_dtype, cuda_dtypes
    from twophase.errors import ConfigError

    spec = tiny_llm().spec
    bf16, q4 = dataclasses.replace(spec, dtype=torch.bfloat16), dataclasses.replace(spec, quantization="q4")
    with pytest.raises(ConfigError, match=r"model.quantization: q4 runs on the onnxruntime backend on the CPU only"):
        check_dtype(q4, "cuda", "1.26.0")
    check_dtype(q4, "cpu", "1.26.0")
    check_dtype(bf16, "cuda", "1.20.0")
    assert torch.bfloat16 in cuda_dtypes("1.20.0")
    with pytest.raises(ConfigError, match=r"bfloat16 on the onnxruntime backend on cuda: onnxruntime "
                                          r"1.19.2 binds no bfloat16 tensor .* use float16 or float32"):
        check_dtype(bf16, "cuda", "1.19.2")
    with pytest.raises(ConfigError, match=r"model.dtype: bfloat16 is not supported .* on cpu \(its CPU "
                                          r"provider has no bfloat16 kernels"):
        check_dtype(bf16, "cpu", "1.26.0")


def test_an_op_without_a_kernel_in_the_dtype_is_refused_by_name():
    """onnxruntime's own refusal (here its CPU provider, which has no bfloat16 ReduceMax) turned
    into a config error naming the op; other load failures pass through."""
    import onnx
    import onnx.helper as h
    import onnxruntime

    from twophase.backends.onnxruntime import refuse_missing_kernel
    from twophase.errors import ConfigError

    x = h.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, [2, 3])
    y = h.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [2, 1])
    graph = h.make_graph([h.make_node("ReduceMax", ["x"], ["y"], name="scores_max")], "g", [x], [y])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    with pytest.raises(Exception) as got:
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ConfigError, match=r"model.dtype: onnxruntime 1.2\S* has no bfloat16 kernel for "
                                          r"ReduceMax \(node 'scores_max'\) on this device"):
        refuse_missing_kernel(got.value, torch.bfloat16, "1.2x")
    refuse_missing_kernel(got.value, torch.float32, "1.2x")            # not a dtype's fault: raised as it is
    refuse_missing_kernel(RuntimeError("protobuf parsing failed"), torch.bfloat16, "1.2x")


def test_cuda_steps_never_make_the_host_wait(monkeypatch):
    """The CUDA path's ordering, run on the CPU with a stand-in for the streams: the session's
    stream waits for torch's before the run and torch's for it after; no IOBinding sync, and
    the run does not synchronise the device at its end. Its logits are the host path's."""
    import onnxruntime

    llm = tiny_llm(backend={"name": "onnxruntime"})
    backend = llm.prefill_backend
    eng = llm.engine
    req = eng.add_request(list(range(3, 20)), SamplingParams(max_tokens=1))
    batch = prefill_batch([(req, 0, 17)], eng.kv) if eng.kv.allocate(req, 17) else None
    want = backend.prefill(batch)
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    class Binding:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            if name.startswith("synchronize"):
                events.append(name)
            return getattr(self.real, name)

    real_binding = type(backend.session).io_binding
    real_run = type(backend.session).run_with_iobinding
    monkeypatch.setattr(type(backend.session), "io_binding", lambda self: Binding(real_binding(self)))
    monkeypatch.setattr(type(backend.session), "run_with_iobinding", lambda self, io, options=None: (
        events.append(f"run, end sync {options.get_run_config_entry('disable_synchronize_execution_providers')}"),
        real_run(self, io.real, None)))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    from twophase.backends.onnxruntime import run_options

    backend.stream, backend.decode_session, backend.verify_session = Stream("session"), None, None
    backend.run_options = run_options(onnxruntime, cuda=True)      # what load sets on CUDA
    monkeypatch.setattr(backend, "_torch_stream", lambda: Stream("torch"))
    monkeypatch.setattr(backend, "_to_device", lambda t: t.contiguous())
    got = backend.prefill(batch)
    assert events == ["session waits for torch", "run, end sync 1", "torch waits for session"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    eng.abort(req.request_id)


def test_split_phases_must_share_a_device_and_pool():
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="not both"):
        tiny_llm(backend={"name": "torch", "prefill": {"name": "onnxruntime"},
                          "decode": {"name": "torch"}})
    with pytest.raises(ConfigError, match="give both"):
        tiny_llm(backend={"prefill": {"name": "onnxruntime"}})


@pytest.mark.slow
@pytest.mark.exhaustive        # the tiny model's tests check the same graph to 1e-4; this exports 30 layers
def test_default_model_greedy_equals_torch(default_llm, default_prompts):
    """Chunked mixed batches under a pool small enough to preempt, then again with prefix hits."""
    ort = LLM.from_config({"backend": {"name": "onnxruntime"}, "cache": {"num_blocks": 8},
                           "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}})
    p = SamplingParams(max_tokens=GREEDY_TOKENS, logprobs=2)
    ref = default_llm.generate(default_prompts, p)
    first = ort.generate(default_prompts, p)
    assert ort.report(first)["preemptions"] > 0
    again = [ort.generate([q], p)[0] for q in default_prompts]    # chat prompts share a prefix
    assert any(o.metrics["num_cached_tokens"] for o in again)
    for i, r in enumerate(ref):
        gaps = [sorted(lp.values(), reverse=True) for lp in r.logprobs]
        gaps = [a - b for a, b, *_ in gaps]
        assert_greedy_match(first[i].token_ids, r.token_ids, gaps, f"prompt {i}")
        assert_greedy_match(again[i].token_ids, r.token_ids, gaps, f"prompt {i}, prefix hits")


@pytest.mark.gpu
def test_cuda_execution_provider_equals_torch_on_cuda():
    """Against the torch reference on the CPU (the weights the export reads: random ones drawn
    on CUDA would be other numbers), float32 on both, up to near-ties."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu")
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 64}}
    a = LLM.from_config(cfg)
    b = LLM.from_config({**cfg, "backend": {"name": "onnxruntime", "device": "cuda"}})
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = random_prompts(6)
    for i, (x, y) in enumerate(zip(b.generate(prompts, p), a.generate(prompts, p))):
        assert_greedy_match(x.token_ids, y.token_ids, logprob_gaps(y), f"prompt {i}", tie=1e-3)


@pytest.mark.parametrize("model", [{}, {"quantization": "q4", "accuracy_level": 0}],
                         ids=["float", "q4"])
def test_decode_graph_equals_the_step_graph(model):
    """All-decode steps run the decode-only graph: the same logits and K/V as the step graph on
    the same batch (decodes of unequal lengths, over copies of one pool)."""
    llm, reqs = _decoding(model)
    ort, eng = llm.prefill_backend, llm.engine
    assert ort.decode_session is not None
    sched = eng.scheduler.schedule()
    assert not sched.prefills and len({r.num_computed_tokens for r in sched.decodes}) > 1
    batch = decode_batch(sched.decodes, eng.kv)
    pool = llm.kv_cache.pool
    before = pool.clone()
    got = ort.decode(batch)
    decoded = pool.clone()
    pool.copy_(before)
    want = _on_step_graph(ort, batch.as_prefill())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.allclose(decoded, pool, atol=1e-6)


def _decoding(model: dict):
    """The tiny model on onnxruntime, with four sequences of unequal lengths in decode."""
    llm = tiny_llm(model=model, backend={"name": "onnxruntime"}, cache={"num_blocks": 128, "block_size": 4})
    eng = llm.engine
    reqs = [eng.add_request(list(range(3 + i, 3 + i + n)), SamplingParams(max_tokens=8, ignore_eos=True))
            for i, n in enumerate((9, 30, 2, 21))]
    while any(r.num_output_tokens < 2 for r in reqs):
        eng.step()
    return llm, reqs


def _on_step_graph(ort, batch):
    verify, ort.verify_session = ort.verify_session, None
    try:
        return ort.prefill(batch)
    finally:
        ort.verify_session = verify


@pytest.mark.parametrize("model", [{}, {"quantization": "q4", "accuracy_level": 0}],
                         ids=["float", "q4"])
@pytest.mark.parametrize("logits", ["all", "last"])
def test_verify_graph_equals_the_step_graph(model, logits):
    """Short chunks (a decode and its drafts) run the verify graph: the same logits and K/V as
    the step graph, for chunks of unequal lengths (padded) after caches of unequal lengths."""
    llm, reqs = _decoding(model)
    ort, kv = llm.prefill_backend, llm.engine.kv
    assert ort.verify_session is not None
    drafts = {r.request_id: [7 + i] * i for i, r in enumerate(reqs)}      # 0 to 3 drafts
    items = [(r, r.num_computed_tokens, 1 + i) for i, r in enumerate(reqs)]
    for r, _, n in items:
        assert kv.allocate(r, n)
    batch = prefill_batch(items, kv, drafts)
    batch.logits = logits
    assert ort._short_chunks(batch)
    pool = llm.kv_cache.pool
    before = pool.clone()
    got = ort.prefill(batch)
    verified = pool.clone()
    pool.copy_(before)
    want = _on_step_graph(ort, batch)
    assert got.shape == want.shape == (batch.num_tokens if logits == "all" else 4, llm.model.arch.vocab_size)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.allclose(verified, pool, atol=1e-6) and not torch.equal(pool, before)


def test_decode_graph_can_be_turned_off():
    from twophase.errors import ConfigError

    llm = tiny_llm(backend={"name": "onnxruntime", "options": {"decode_graph": False}})
    assert llm.prefill_backend.decode_session is None
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    with pytest.raises(ConfigError, match="decode_graph"):
        tiny_llm(backend={"name": "onnxruntime", "options": {"decode_graph": "yes"}})


def test_torch_glue_runs_on_one_thread_beside_onnxruntime_and_is_restored_after():
    """ORT computes on its own threads; torch's OpenMP team, woken for the sampler's argmax,
    would spin into ORT's next run. The engine runs the step's torch work on one thread."""
    from twophase.errors import ConfigError

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}
        for name in ("onnxruntime", "torch"):
            llm = tiny_llm(backend={"name": name})
            decode = llm.prefill_backend.decode

            def recording(batch, decode=decode, name=name):
                seen[name] = torch.get_num_threads()
                return decode(batch)

            llm.prefill_backend.decode = recording
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
            assert torch.get_num_threads() == 2
        assert seen == {"onnxruntime": 1, "torch": 2}
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="spinning"):
        tiny_llm(backend={"name": "onnxruntime", "options": {"spinning": "yes"}})


def test_prompt_logprobs_equal_torchs_chunked():
    """Prompt log-probabilities come from the prefill backend's logits at every position:
    onnxruntime's, in chunks, equal torch's (which equal HF's, tests/models/test_families.py)."""
    prompt = list(range(7, 7 + 45))
    p = SamplingParams(max_tokens=2, prompt_logprobs=2)
    small = {"scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
             "cache": {"num_blocks": 64, "block_size": 4}}
    want = tiny_llm(**small).generate([prompt], p)[0].prompt_logprobs
    got = tiny_llm(**small, backend={"name": "onnxruntime"}).generate([prompt], p)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want) == 45
    for g, w, t in zip(got[1:], want[1:], prompt[1:]):
        assert abs(g[t] - w[t]) < 1e-4 and set(g) == set(w)
