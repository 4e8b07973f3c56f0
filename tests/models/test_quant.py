"""4-bit weights: the GGUF's blocks repacked bit for bit, ONNX Runtime's MatMulNBits reading
them as intended on its pre-packed fast path, logits against the dequantised model, and
perplexity on the shipped text."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers.models import dequantised_reference, tiny_llm

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.models import quant

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    from twophase.models import hub

    return gguf.GGUFReader(str(hub.gguf_path("smollm2-135m-instruct")))


@pytest.mark.parametrize("name, kind", [("blk.0.attn_q.weight", "Q4_1"), ("blk.7.ffn_down.weight", "Q4_1"),
                                        ("token_embd.weight", "Q8_0")])
def test_gguf_blocks_are_taken_and_repacked_bit_for_bit(gguf_reader, name, kind):
    import gguf

    t = next(t for t in gguf_reader.tensors if t.name == name)
    assert t.tensor_type.name == kind
    k, n = (int(d) for d in t.shape)
    qw = (quant.from_q4_1 if kind == "Q4_1" else quant.from_q8_0)(t.data, n, k)
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k).astype(np.float32)
    assert np.array_equal(qw.dequantize(), want)           # the same numbers, exactly
    b, scales, zeros = quant.pack(qw)
    if kind == "Q4_1":
        # MatMulNBits: byte j of a block holds elements 2j (low nibble) and 2j+1 (high)
        unpacked = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, k)
        assert np.array_equal(unpacked, qw.codes) and not zeros.any()
        # ggml: byte j of a block held elements j and j+16
        raw = np.asarray(t.data, dtype=np.uint8).reshape(n, k // 32, 20)[:, :, 4:]
        codes = qw.codes.reshape(n, k // 32, 32)
        assert np.array_equal(raw & 0x0F, codes[..., :16]) and np.array_equal(raw >> 4, codes[..., 16:])
    else:
        assert np.array_equal(b.reshape(n, k), qw.codes) and (zeros == 128).all()
    assert np.array_equal(scales, qw.scale.reshape(-1))


def _one_gemm_graph(path, n: int, k: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.zeros((n, k), np.float32)
    node = helper.make_node("Gemm", ["x", "model.w"], ["y"], transB=1)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                          [numpy_helper.from_array(w, "model.w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def test_centred_zero_points_keep_the_weights():
    """Moving each block's zero point next to its minimum changes no weight, bit for bit, for
    Q4_1's fp16 scales and minimums (each term is exact in float32, and the sum rounds once
    either way), and leaves a rest of the minimum within half a step."""
    rng = np.random.default_rng(1)
    n, k = 32, 128
    d = (rng.random((n, k // 32)) * 0.05).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(0, 15, (n, k // 32))).astype(np.float16).astype(np.float32)
    qw = quant.QWeight(rng.integers(0, 16, (n, k), dtype=np.uint8), d, m, 4, 0)
    c = qw.centered()
    assert np.array_equal(c.dequantize(), qw.dequantize())
    assert c.zeros().max() <= 15 and np.all(np.abs(c.minimum) <= d / 2 + 1e-7)
    assert c.centered() is c                                   # once is enough
    stacked = quant.QWeight.stack([c, qw.centered()])
    assert np.array_equal(stacked.dequantize(), np.concatenate([c.dequantize()] * 2))


@pytest.mark.parametrize("kind", ["q4 with minimum", "q8 with zero 128", "q4 with outlier channels"])
def test_matmulnbits_reads_our_packing(tmp_path, kind):
    """x = identity: the rewritten graph's output is the weight ORT sees, which must be ours
    (with outlier channels, those columns come from the float32 term instead)."""
    import onnxruntime as ort

    from twophase.exporters.q4 import quantize_graph

    rng = np.random.default_rng(0)
    n, k = 48, 96
    if kind.startswith("q4"):
        qw = quant.quantize_q4(rng.standard_normal((n, k)).astype(np.float32))
    else:
        qw = quant.QWeight(rng.integers(0, 256, (n, k), dtype=np.uint8),
                           rng.random((n, k // 32), dtype=np.float32), None, 8, 128)
    _one_gemm_graph(tmp_path / "f.onnx", n, k)
    outliers = {"w": np.array([3, 40, 77])} if "outlier" in kind else None
    assert quantize_graph(tmp_path / "f.onnx", tmp_path / "q.onnx", {"w": qw}, accuracy_level=0,
                          outliers=outliers) == 1
    sess = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
    assert np.allclose(y.T, qw.dequantize(), atol=1e-5, rtol=1e-5)


def _prepacked_nodes(path) -> tuple[int, int]:
    """(MatMulNBits nodes, prepacked buffers big enough for one of them) when ORT loads
    ``path``. ORT's CPU kernel has no log line for its slow path, but pre-packing reserves
    a buffer for each weight at load, after the initializers are saved: counted here."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    need = sorted(_attr(nd, "N") * _attr(nd, "K") * _attr(nd, "bits") // 8 for nd in m.graph.node
                  if nd.op_type == "MatMulNBits")
    code = ("import onnxruntime as ort\nort.set_default_logger_severity(0)\n"
            "so = ort.SessionOptions(); so.log_severity_level = 0\n"
            f"ort.InferenceSession({str(path)!r}, so, providers=['CPUExecutionProvider'])\n")
    log = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    after = log.split("Done saving initialized tensors")[-1]
    reserved = sorted(int(s) for s in re.findall(r"Reserving memory in BFCArena for Cpu size: (\d+)", after))
    matched = 0
    for want in need:                    # each weight needs its own buffer of at least its size
        fit = next((i for i, r in enumerate(reserved) if r >= want), None)
        if fit is not None:
            reserved.pop(fit)
            matched += 1
    return len(need), matched


def _attr(node, name: str) -> int:
    return next(int(a.i) for a in node.attribute if a.name == name)


def test_every_quantised_matmul_takes_the_prepacked_path(tmp_path):
    import onnx

    llm = tiny_llm(model={"quantization": "q4"}, backend={"name": "onnxruntime"})
    path = llm.prefill_backend.session._model_path
    nodes, packed = _prepacked_nodes(path)
    assert nodes == 4 * llm.model.arch.num_layers + 1 and packed == nodes
    # the check can fail: float zero points make ORT dequantise B on every call instead
    m = onnx.load(path)
    for init in m.graph.initializer:
        if init.name.endswith(".zero_points"):
            n = np.frombuffer(init.raw_data, np.uint8).size
            init.CopyFrom(onnx.numpy_helper.from_array(np.zeros(n * 2, np.float32), init.name))
    onnx.save(m, str(tmp_path / "float_zp.onnx"))
    assert _prepacked_nodes(tmp_path / "float_zp.onnx")[1] < nodes      # caught


@pytest.mark.parametrize("level, tol", [(0, 1e-4), (4, 5e-2)])
def test_q4_logits_match_the_dequantised_model(level, tol):
    """Level 0 computes in fp32 (the weights are the only difference, and they are the same);
    level 4 rounds activations to int8 per block of 32: a stated tolerance."""
    q4 = tiny_llm(model={"quantization": "q4", "accuracy_level": level}, backend={"name": "onnxruntime"},
                  cache={"num_blocks": 64})
    ref = dequantised_reference(q4)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    for llm in (q4, ref):
        for p in prompts:
            llm.engine.add_request(p, SamplingParams(max_tokens=2))
    rows = []
    for llm in (q4, ref):
        sched = llm.engine.scheduler.schedule()
        batch = prefill_batch([(r, 0, n) for r, n in sched.prefills], llm.engine.kv)
        batch.logits = "all"
        rows.append(llm.prefill_backend.prefill(batch))
    got, want = rows
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < tol, f"accuracy level {level}: logits differ by {rel:.2e} (relative)"


def test_backends_without_q4_refuse_it_by_name():
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="the torch backend does not run 'q4'.*onnxruntime"):
        tiny_llm(model={"quantization": "q4"})


@pytest.mark.slow
@pytest.mark.exhaustive        # two exports of 30 layers; the default lane checks q4 quality on native
def test_perplexity_of_the_gguf_weights_in_q4(tmp_path):
    """The GGUF's own blocks: at accuracy level 1 (fp32 activations) perplexity equals the
    dequantised model's (the centred zero points and float32 outlier channels are exact); at
    level 4 (int8 activations, the fast path) it stays within 0.5%, and the mean KL divergence
    from the float model, measured at 0.0034, stays under 0.005 (llama.cpp's on the same file:
    0.0080). A float folder requantised to 4 bits stays within 5%."""
    from twophase.measure.quality import (
        greedy_agreement,
        kl_divergence,
        perplexity,
        shipped_text,
    )
    from twophase.paths import cache_dir

    text = shipped_text()
    cfg = {"cache": {"num_blocks": 128}}
    ref = LLM.from_config(cfg)
    base = perplexity(ref, text)
    exact = LLM.from_config({**cfg, "model": {"quantization": "q4", "accuracy_level": 1},
                             "backend": {"name": "onnxruntime"}})
    assert perplexity(exact, text) == pytest.approx(base, rel=1e-4)
    fast = LLM.from_config({**cfg, "model": {"quantization": "q4"}, "backend": {"name": "onnxruntime"}})
    assert abs(perplexity(fast, text) / base - 1) < 0.005
    assert kl_divergence(fast, ref, text) < 0.005
    assert greedy_agreement(fast, ref, ["The quick brown fox", "def fibonacci(n):"], 24) > 0.9
    # the same weights as a plain float folder (no GGUF beside it): requantised by the exporter
    folder = tmp_path / "hf"
    folder.mkdir()
    src = cache_dir() / "models" / "smollm2-135m-instruct"
    for f in src.iterdir():
        if f.name != "source.json":
            (folder / f.name).symlink_to(f)
    requant = LLM.from_config({**cfg, "model": {"path": str(folder), "quantization": "q4"},
                               "backend": {"name": "onnxruntime"}})
    assert perplexity(requant, text) / base - 1 < 0.05


def test_the_export_command_keeps_the_configs_quantization(tmp_path):
    """``twophase export`` builds its ModelSpec where LLM does: a q4 config exports the q4 graph."""
    import subprocess
    import sys

    cfg = tmp_path / "q4.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\nquantization = "q4"\n')
    run = subprocess.run([sys.executable, "-m", "twophase", "export", str(cfg), "--format", "onnx",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["quantization"] == "q4" and manifest["quant_format"] is not None
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
