"""The native backend (``twophase/backends/native``): its C step against an independent torch
reference, its decode path against its own prefill, batching against requests run alone, and
the default model's quality."""

from __future__ import annotations

import pytest
import torch
from helpers.models import PREEMPTING, dequantised_reference, prefill_all_logits, random_prompts, tiny_llm
from helpers.native import PATHS, native_or_skip

from twophase import LLM, SamplingParams
from twophase.contract import BackendUnavailable
from twophase.core.batch import decode_batch, prefill_batch

Q4 = {"quantization": "q4"}


@pytest.fixture(autouse=True)
def _needs_native():
    native_or_skip()


@pytest.fixture(autouse=True)
def _two_threads():
    """The kernel's threads split every op and meet at barriers: the tests run two, also in a
    test worker that computes on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("outliers", [8, 13])          # 13: the kernel's scalar tail too
def test_native_logits_match_the_dequantised_model(outliers):
    """Several sequences' chunks in one step; int8 activations, as onnxruntime's level 4
    (measured: 8e-3 relative)."""

    native = tiny_llm(model={**Q4, "outlier_channels": outliers}, backend={"name": "native"})
    ref = dequantised_reference(native)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    got, want = prefill_all_logits(native, prompts), prefill_all_logits(ref, prompts)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 2e-2, f"logits differ by {rel:.2e} (relative)"


def test_decode_after_prefill_equals_one_prefill_of_all_the_tokens():
    """Each row's arithmetic is its own, so a decode over K/V paged in earlier steps must give
    exactly the logits of the same token inside one long chunk: the greedy tokens' log-probs
    of a generation equal those of one prefill of the prompt and the generated tokens."""
    cache = {"num_blocks": 64, "block_size": 4}
    prompt = list(range(7, 7 + 21))
    out = tiny_llm(model=Q4, backend={"name": "native"}, cache=cache).generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))[0]
    whole = prefill_all_logits(tiny_llm(model=Q4, backend={"name": "native"}, cache=cache),
                        [prompt + out.token_ids[:-1]])
    lp = torch.log_softmax(whole.float(), dim=-1)
    for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got == {token: float(lp[len(prompt) - 1 + i, token])}, f"token {i}"


def test_a_rows_logits_do_not_depend_on_the_batch_it_is_in():
    """Every batch size 1-70 (the kernel's tiles of 2 weight rows x 4 activation rows and their
    tails): one-token sequences prefilled together give, bit for bit, the logits each gets alone."""
    from twophase.core.request import Request

    llm = tiny_llm(model=Q4, backend={"name": "native"}, cache={"num_blocks": 256, "block_size": 4})
    kv = llm.engine.kv

    def logits(tokens):
        reqs = [Request(f"r{i}", [t], SamplingParams(max_tokens=1), 0.0) for i, t in enumerate(tokens)]
        for r in reqs:
            assert kv.allocate(r, 1)
        try:
            return llm.prefill_backend.prefill(prefill_batch([(r, 0, 1) for r in reqs], kv))
        finally:
            for r in reqs:
                kv.free(r)

    tokens = [(37 * i + 11) % 500 + 3 for i in range(70)]
    alone = torch.cat([logits([t]) for t in tokens])
    for rows in range(1, 71):
        assert torch.equal(logits(tokens[:rows]), alone[:rows]), f"batch of {rows}: rows differ from alone"


def test_a_steps_logits_stay_as_returned_while_held_and_a_released_buffer_is_reused(monkeypatch):
    """The logits come from buffers the backend keeps (a fresh 33 MB a step faulted its pages
    in): one still held, or only a view of it, is never written again; one released serves
    again; a batch that grew past every kept size gets a kept buffer; one past the size kept
    (a prompt's every logit) is not kept."""
    import twophase.backends.native as native
    from twophase.backends.native import LOGIT_BUFFERS
    from twophase.core.request import Request

    llm = tiny_llm(model=Q4, backend={"name": "native"}, cache={"num_blocks": 64, "block_size": 4})
    kv, backend = llm.engine.kv, llm.prefill_backend

    def logits(token, rows=1):
        reqs = [Request(f"r{i}", [token + i], SamplingParams(max_tokens=1), 0.0) for i in range(rows)]
        for r in reqs:
            assert kv.allocate(r, 1)
        try:
            return backend.prefill(prefill_batch([(r, 0, 1) for r in reqs], kv))
        finally:
            for r in reqs:
                kv.free(r)

    def kept():
        return {b.ctypes.data for b in backend.logit_buffers}

    held = logits(3)
    view = logits(4)[0, :5]                     # the tensor itself dropped, a view of it kept
    want_held, want_view = held.clone(), view.clone()
    for i in range(LOGIT_BUFFERS + 2):
        logits(5 + i)
    assert torch.equal(held, want_held) and torch.equal(view, want_view)
    assert logits(20).data_ptr() in kept()               # a released buffer serves again
    for rows in range(1, LOGIT_BUFFERS + 2):             # small batches fill the list ...
        logits(30, rows)
    assert logits(30, 8).data_ptr() in kept()            # ... and a larger one still gets a kept buffer
    assert len(backend.logit_buffers) == LOGIT_BUFFERS
    assert torch.equal(held, want_held) and torch.equal(view, want_view)
    monkeypatch.setattr(native, "LOGIT_BUFFER_BYTES", 0)
    before = kept()
    assert logits(40, 12).data_ptr() not in before and kept() == before


def test_batching_chunking_and_preemption_change_no_token():
    """Under a pool and budget that preempt and split prompts into chunks, every request's greedy
    tokens equal its tokens run alone."""
    prompts = random_prompts(8)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    together = tiny_llm(model=Q4, backend={"name": "native"}, **PREEMPTING).generate(prompts, p)
    alone = tiny_llm(model=Q4, backend={"name": "native"})
    assert [o.token_ids for o in together] == [alone.generate([q], p)[0].token_ids for q in prompts]


def test_prefill_on_onnxruntime_decode_on_native():
    """The routing the backend is for: native decodes over K/V onnxruntime wrote, and its logits
    agree with onnxruntime's own decode of the same batch (both round activations to int8)."""
    llm = tiny_llm(model=Q4, backend={"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}})
    eng, ort, native = llm.engine, llm.prefill_backend, llm.decode_backend
    assert type(native).__name__ == "NativeBackend"
    reqs = [eng.add_request(q, SamplingParams(max_tokens=8, ignore_eos=True)) for q in random_prompts(4, seed=1)]
    while any(r.num_output_tokens < 2 for r in reqs):
        eng.step()
    batch = decode_batch(eng.scheduler.schedule().decodes, eng.kv)
    pool = llm.kv_cache.pool
    before = pool.clone()
    want = ort.decode(batch)
    pool.copy_(before)
    got = native.decode(batch)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 2e-2, f"native decode differs from onnxruntime's by {rel:.2e}"


def test_native_refuses_float_weights_and_bad_options():
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="native backend does not run 'none'"):
        tiny_llm(backend={"name": "native"})
    with pytest.raises(ConfigError, match="threads"):
        tiny_llm(model=Q4, backend={"name": "native", "options": {"threads": 0}})


def test_the_isa_option_runs_that_path_and_refuses_an_unknown_one_by_name():
    """``isa = "avx2"`` builds the kernels a Zen 3 runs (on any CPU with AVX2): the same greedy
    tokens as the native build's; an instruction set it does not know is a config error."""
    from twophase.device import cpu_flags
    from twophase.errors import ConfigError

    for bad in ("avx512", ["avx2"]):
        with pytest.raises(ConfigError, match=r"backend.options.isa: .*'avx2'.*got " + repr(bad).replace("[", r"\[")):
            tiny_llm(model=Q4, backend={"name": "native", "options": {"isa": bad}})
    avx2 = tiny_llm(model=Q4, backend={"name": "native", "options": {"isa": "avx2"}})
    native = tiny_llm(model=Q4, backend={"name": "native"})
    flags = cpu_flags()
    assert avx2.prefill_backend.isa == "AVX2 (no VNNI)"
    assert native.prefill_backend.isa == ("AVX-512 VNNI" if "avx512_vnni" in flags and "avx512vl" in flags
                                  else "AVX-VNNI (256-bit)" if "avx_vnni" in flags else "AVX2 (no VNNI)")
    prompts, p = random_prompts(3, seed=4), SamplingParams(max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in avx2.generate(prompts, p)] == [o.token_ids for o in native.generate(prompts, p)]


@pytest.mark.exhaustive      # CI time: a second build of the kernels, for benchmarks/step_phases.py
def test_the_phase_clock_build_times_each_op_of_its_steps():
    """``-DSTEP_PHASES`` (benchmarks/step_phases.py): the same logits, the steps counted, and
    the ops' totals within the steps' wall time, the projections and the head among them."""
    import ctypes
    import time

    import numpy as np

    from twophase.backends.native import kernel

    prompts = random_prompts(2, seed=5)
    want = prefill_all_logits(tiny_llm(model=Q4, backend={"name": "native"}), prompts)
    llm = tiny_llm(model=Q4, backend={"name": "native"})
    lib = kernel.load(("-DSTEP_PHASES",))
    lib.step_phases.argtypes = [ctypes.c_void_p]
    lib.step_phases.restype = ctypes.c_long
    llm.decode_backend.lib = lib
    start = time.perf_counter()
    got = prefill_all_logits(llm, prompts)
    wall = time.perf_counter() - start
    spent = np.zeros(13)
    assert lib.step_phases(spent.ctypes.data) == 1
    assert torch.equal(got, want)
    assert 0 < spent.sum() <= wall
    assert (spent[[2, 6, 8, 10, 12]] > 0).all()            # q/k/v, o, gate/up, down, the head


def test_native_refuses_shapes_it_does_not_compute():
    from dataclasses import replace

    from twophase.arch import uniform_layers
    from twophase.backends.native import NativeBackend

    arch = tiny_llm(model=Q4, backend={"name": "native"}).prefill_backend.arch
    native = NativeBackend()
    assert native.supports(arch) is None
    wider = uniform_layers(arch.num_layers, arch.intermediate_size + 8, arch.rope_theta)
    first = arch.layers[0]
    mixed = (replace(first, mlp=replace(first.mlp, intermediate_size=arch.intermediate_size + 32)),) + arch.layers[1:]
    half = tuple(replace(s, mlp=replace(s.mlp, num_experts=4, top_k=2)) if i % 2 else s
                 for i, s in enumerate(arch.layers))
    wide_k = tuple(replace(s, mlp=replace(s.mlp, num_experts=4, top_k=5)) for s in arch.layers)
    for bad, why in ((replace(arch, layers=half), "native: layers that mix dense and expert MLPs"),
                     (replace(arch, layers=wide_k), "a top k outside 1 to the number of experts"),
                     (replace(arch, num_heads=3), "3 query heads over 2 KV heads"),
                     (replace(arch, head_dim=20), "heads x head_dim"),
                     (replace(arch, layers=mixed), "an MLP width that changes"),
                     (replace(arch, layers=wider), "multiples of 32")):
        assert why in (native.supports(bad) or ""), bad


@pytest.mark.slow
def test_default_model_quality_on_native():
    """The GGUF's blocks through the C step: perplexity within 1% of the float model's on the
    shipped text and mean KL under 0.005 (measured: +0.37%, 0.0038 on the vector paths; -0.58%,
    0.0033 with the chunks' attention on AMX tiles, Intel Xeon; llama.cpp: 0.0080)."""
    from twophase.measure.quality import compare, shipped_text

    text = shipped_text()
    cfg = {"cache": {"num_blocks": 128}}
    ref = LLM.from_config(cfg)
    native = LLM.from_config({**cfg, "model": Q4, "backend": {"name": "native"}})
    ppl, ref_ppl, kl = compare(native, ref, text)           # one pass of each over the text
    assert abs(ppl / ref_ppl - 1) < 0.01
    assert kl < 0.005


def test_speculation_verified_on_native_changes_no_token():
    """Drafts verified by native's prefill (k + 1 tokens after the cache, logits at each) keep
    every greedy token: each token is computed on its own, so a verify row equals a decode."""
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6] + random_prompts(3, seed=2)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    routed = {"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}
    want = tiny_llm(model=Q4, backend=routed).generate(prompts, p)
    spec = tiny_llm(model=Q4, backend=routed, speculative={"method": "ngram", "num_tokens": 4})
    got = spec.generate(prompts, p)
    assert spec.report(got)["speculative"]["accepted_tokens"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# -- the kernels' tiles against the scalar reference in step.c ------------------------------------

# (n, k, outliers): a short group alone (k = 32, 96, 256: 1, 3, 8 blocks of a group's 16), whole
# groups (512, 1024), both (288, 576, 1504: 9, 2, 15 blocks past them), and outlier counts below,
# at and past a vector of 8
SHAPES = [(5, 32, 0), (7, 96, 3), (9, 256, 8), (13, 288, 13), (4, 512, 5), (6, 576, 8), (5, 1024, 0),
          (3, 1504, 9)]

def test_a_path_switching_off_what_the_cpu_lacks_is_the_native_build(monkeypatch):
    from twophase.backends.native import kernel

    monkeypatch.setattr(kernel, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))       # Zen 3
    assert [kernel.effective_flags(f) for f in PATHS.values()] == [(), (), ()]
    monkeypatch.setattr(kernel, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert [kernel.effective_flags(f) for f in PATHS.values()] == [(), ("-mno-avx512f",), ("-mno-avx512f",)]
    monkeypatch.setattr(kernel, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx_vnni"}))
    assert kernel.effective_flags(PATHS["avx2"]) == PATHS["avx2"]
    assert kernel.effective_flags(("-O1",)) == ("-O1",)                 # other flags stay


def _q4_weight(rng, n, k, n_out):
    import numpy as np

    from twophase.backends.native.model_struct import Q4_1

    nb = k // 32
    blocks = np.empty((n, nb), Q4_1)
    blocks["d"] = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16)
    blocks["m"] = -blocks["d"].astype(np.float32) * rng.uniform(4, 11, (n, nb))
    blocks["qs"] = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    zeros = rng.integers(0, 16, (n, nb), dtype=np.uint8)
    idx = rng.choice(k, n_out, replace=False).astype(np.int32)
    cols = rng.normal(0, 0.05, (n, n_out)).astype(np.float32)
    codes = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=2).astype(np.float32)
    dense = (blocks["d"].astype(np.float32)[..., None] * codes
             + blocks["m"].astype(np.float32)[..., None]).reshape(n, k)
    dense[:, idx] = cols          # the outlier channels are multiplied by their float columns
    return blocks, zeros, idx, cols, dense


def _q8_weight(rng, n, k):
    import numpy as np

    from twophase.backends.native.model_struct import Q8_0

    blocks = np.empty((n, k // 32), Q8_0)
    blocks["d"] = rng.uniform(0.001, 0.02, blocks.shape).astype(np.float16)
    blocks["qs"] = rng.integers(-128, 128, (n, k // 32, 32), dtype=np.int8)
    dense = (blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)).reshape(n, k)
    return blocks, dense


def _run(lib, proj, head, x, n):
    """(tiles, reference) outputs of ``check_matmul`` for the rows of ``x``."""
    import ctypes

    import numpy as np

    rows, k = x.shape
    fast, ref = np.full((rows, n), np.nan, np.float32), np.full((rows, n), np.nan, np.float32)
    scratch = np.empty(lib.check_scratch_floats(rows, k), np.float32)
    lib.check_matmul(ctypes.addressof(proj), int(head), rows, x.ctypes.data, fast.ctypes.data,
                     ref.ctypes.data, scratch.ctypes.data, 2)
    return fast, ref


def _activations(rng, rows, k, outliers=()):
    """Rows with large channels: the outlier channels, and two that set their block's step."""
    import numpy as np

    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    x[:, list(outliers)] *= 30
    x[:, rng.choice(k, 2, replace=False)] *= 8
    return x


@pytest.mark.parametrize("flags", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k, _ in SHAPES])
def test_q4_tiles_equal_the_scalar_reference_in_every_batch(flags, shape):
    """Every tile shape (1-4 weight rows by 1-4 activation rows) and every batch size 1-70 gives,
    bit for bit, the scalar reference's result for each row, and the reference is the
    dequantised matmul up to the int8 rounding of the activations; on the AVX2 path too."""
    import numpy as np

    from twophase.backends.native import kernel
    from twophase.backends.native.model_struct import q4_rows

    lib = kernel.load(flags)
    n, k, n_out = shape
    rng = np.random.default_rng(n * k + n_out)
    blocks, zeros, idx, cols, dense = _q4_weight(rng, n, k, n_out)
    rows = q4_rows(blocks, zeros)
    assert rows.shape == (n, 21 * (k // 32))
    proj = kernel.ProjQ4(n, k, n_out, rows.ctypes.data, idx.ctypes.data, cols.ctypes.data)
    x = _activations(rng, 70, k, idx)
    _, want = _run(lib, proj, False, x, n)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    err = np.linalg.norm(want - exact) / np.linalg.norm(exact)
    assert err < 3e-2, f"reference differs from the dequantised matmul by {err:.2e}"
    for batch in range(1, 71):
        got, ref = _run(lib, proj, False, x[:batch], n)
        assert np.array_equal(ref, want[:batch])
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"batch {batch}"


@pytest.mark.parametrize("flags", PATHS.values(), ids=PATHS.keys())
def test_q8_head_tiles_equal_the_scalar_reference_in_every_batch(flags):
    import numpy as np

    from twophase.backends.native import kernel
    from twophase.backends.native.model_struct import q8_rows

    lib = kernel.load(flags)
    rng = np.random.default_rng(8)
    for n, k in [(5, 32), (7, 96), (6, 256), (4, 512), (11, 576), (3, 1504)]:
        blocks, dense = _q8_weight(rng, n, k)
        rows = q8_rows(blocks)
        assert rows.shape == (n, 34 * (k // 32))
        proj = kernel.ProjQ8(n, k, rows.ctypes.data)
        x = _activations(rng, 70, k)
        _, want = _run(lib, proj, True, x, n)
        exact = x.astype(np.float64) @ dense.T.astype(np.float64)
        err = np.linalg.norm(want - exact) / np.linalg.norm(exact)
        assert err < 3e-2, f"{n}x{k}: reference differs from the dequantised matmul by {err:.2e}"
        for batch in range(1, 71):
            got, ref = _run(lib, proj, True, x[:batch], n)
            assert np.array_equal(ref, want[:batch])
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{n}x{k}, batch {batch}"


def test_the_paths_agree_up_to_float_rounding():
    """The 512-bit tiles sum the blocks' terms in other lanes than the 256-bit ones, so the two
    differ by float rounding only (a block read or scaled wrongly on one path, in its tiles and
    its reference alike, would differ by far more)."""
    import numpy as np

    from twophase.backends.native import kernel
    from twophase.backends.native.model_struct import q4_rows, q8_rows

    libs = [kernel.load(flags) for flags in PATHS.values()]
    rng = np.random.default_rng(3)
    for n, k, n_out in SHAPES:
        blocks, zeros, idx, cols, _ = _q4_weight(rng, n, k, n_out)
        rows = q4_rows(blocks, zeros)
        proj = kernel.ProjQ4(n, k, n_out, rows.ctypes.data, idx.ctypes.data, cols.ctypes.data)
        x = _activations(rng, 9, k, idx)
        got = [_run(lib, proj, False, x, n)[0] for lib in libs]
        for g in got[1:]:
            assert np.abs(g - got[0]).max() <= 1e-5 * np.abs(got[0]).max(), f"q4 {n}x{k}"
        blocks8, _ = _q8_weight(rng, n, k)
        rows8 = q8_rows(blocks8)
        proj8 = kernel.ProjQ8(n, k, rows8.ctypes.data)
        got = [_run(lib, proj8, True, x, n)[0] for lib in libs]
        for g in got[1:]:
            assert np.abs(g - got[0]).max() <= 1e-5 * np.abs(got[0]).max(), f"q8 {n}x{k}"


def test_a_cc_that_names_no_program_is_a_clear_refusal(monkeypatch):
    from twophase.backends.native import kernel

    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(BackendUnavailable, match="found no compiler CC='/nonexistent/cc'"):
        kernel.check_machine()


def test_a_step_on_fewer_threads_gives_the_same_logits_bit_for_bit():
    """Beside a busy process the step runs on fewer threads (``share_cpu``); the scratch and the
    attention's split stay laid out for the configured count, so nothing a request sees changes:
    long contexts at batch 1 (the attention split into parts) and a batch, prefill and decode."""
    cache = {"num_blocks": 96, "block_size": 4}
    prompts = [list(range(7, 7 + 150)), list(range(300, 320)), list(range(40, 45))]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    runs = []
    for team in (2, 1):
        llm = tiny_llm(model=Q4, backend={"name": "native", "options": {"threads": 2}}, cache=cache)
        gov = llm.prefill_backend.governor
        assert gov is not None and gov.max_threads == 2
        asked: list[int] = []
        gov.threads = lambda team=team, asked=asked: asked.append(team) or team    # as under load
        runs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
                    + [(o.token_ids, o.logprobs) for o in llm.generate(prompts[:1], params)])
        assert len(asked) >= 6, "the steps did not ask the governor for their team"
    assert runs[0] == runs[1]


def test_share_cpu_is_a_boolean_and_off_keeps_the_threads():
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="share_cpu"):
        tiny_llm(model=Q4, backend={"name": "native", "options": {"share_cpu": "yes"}})
    llm = tiny_llm(model=Q4, backend={"name": "native", "options": {"threads": 2, "share_cpu": False}})
    assert llm.prefill_backend.governor is None


@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu_tanh"])
def test_the_glu_is_the_same_bits_on_every_path_and_the_float64_formula(act):
    """SwiGLU and Gemma's tanh-GELU over 83 values (sixteen lanes at a time on AVX-512, eight
    on the others, the last three one at a time): the same bits on every instruction-set path,
    and within float32's rounding of the formula in float64."""
    import ctypes

    import numpy as np

    from twophase.backends.native import kernel

    native_or_skip()
    rng = np.random.default_rng(act)
    g, u = (rng.normal(0, 3, 83).astype(np.float32) for _ in range(2))
    x = g.astype(np.float64)
    gate = x / (1 + np.exp(-x)) if act == 0 else 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    want = gate * u
    outs = []
    for flags in PATHS.values():
        y = np.full(83, np.nan, np.float32)
        model = kernel.Model(act=act)
        kernel.load(flags).check_glu(ctypes.byref(model), g.ctypes.data, u.ctypes.data, y.ctypes.data, 83)
        assert np.abs(y - want).max() < 2e-6 * np.abs(want).max()
        outs.append(y.view(np.uint32))
    assert all(np.array_equal(o, outs[0]) for o in outs)
