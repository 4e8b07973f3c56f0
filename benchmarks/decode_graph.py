"""How much a lean decode-only graph would save at small decode batches, measured against the
exported step graph the onnxruntime backend runs today, on the default model.

The exported graph is torch's trace of the whole step (chunks and decodes, every dim dynamic):
about 4,900 nodes after ORT's optimiser at batch 1. This script builds, by hand, a graph for
decode alone with ORT's fused operators: ``SkipSimplifiedLayerNormalization`` (residual add and
RMSNorm in one), ``RotaryEmbedding`` over Q and K at once, the projections as in the q4 graph
(``twophase.exporters.q4.projection``) or as float Gemms, and attention over the cached tokens
gathered from the pool by precomputed rows, plus the new token's own K/V. About 1,800 nodes.

It checks the two graphs agree (logits and the new K/V; q4 at ``accuracy_level`` 1, where they
must be equal to float32 rounding) and times one decode step of each, interleaved, with ORT's
threads sleeping between ops (the backend's setting) and spinning.

    python benchmarks/decode_graph.py [--quantization q4|none] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import onnxruntime as ort
import torch
from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.backends.base import DecodeBatch, ModelSpec
from twophase.exporters import q4
from twophase.exporters.onnx import _cpu_model, calibration_ids, graph_inputs, source_gguf, write_new_kv

MS = "com.microsoft"


def build(llm: LLM, quantization: str, accuracy_level: int, path: str) -> int:
    """Write the decode graph for ``llm``'s model to ``path``; returns its node count."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    spec = ModelSpec(llm.model.arch.to_dict(), str(llm.model.weights), torch.float32, llm.model.model_id)
    torch_model = _cpu_model(spec)
    a = torch_model.arch
    sd = {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}
    L, H, KVH, hd, G = a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.num_heads // a.num_kv_heads
    if quantization == "q4":
        qweights = q4.model_qweights(torch_model, a, source_gguf(spec))
        outliers = q4.outlier_channels(torch_model, calibration_ids(spec), 8)
    nodes, inits = [], []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(kind: str, inputs: list[str], outputs: list[str], **attrs):
        nodes.append(helper.make_node(kind, inputs, outputs, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def linear(x: str, key: str, y: str) -> str:
        if quantization == "q4":
            more_nodes, more_inits = q4.projection(x, y, key, qweights[key], outliers.get(key), accuracy_level)
            nodes.extend(more_nodes)
            inits.extend(more_inits)
            return y
        return op("Gemm", [x, const(key, sd[key])], [y], transB=1)

    freqs = np.arange(a.max_position_embeddings, dtype=np.float32)[:, None] * torch_model.inv_freq.numpy()[None]
    const("cos_cache", np.cos(freqs))
    const("sin_cache", np.sin(freqs))
    for name, value in {"flat": [-1, hd], "qk3": [0, 1, (H + KVH) * hd], "rows2d": [0, -1], "q4d": [0, KVH, G, hd],
                        "kv4d": [0, KVH, 1, hd], "layer_row": [1, -1, KVH * hd], "zero": [0],
                        "split_qkv": [(H + KVH) * hd, KVH * hd], "split_qk": [H * hd, KVH * hd],
                        "split_gu": [a.intermediate_size] * 2, "new_kv": [L, -1, KVH, hd]}.items():
        const(name, np.array(value, np.int64))
    const("scale", np.array(hd ** -0.5, np.float32))
    res = op("Gather", [const("embed", sd["embed.weight"]), "input_ids"], ["x0"], axis=0)
    pool = op("Reshape", ["kv_pool", "flat"], ["pool_rows"])
    rows = op("Split", ["rows"], [f"rows{i}" for i in range(2 * L)], axis=0, num_outputs=2 * L)
    mlp_out, new_k, new_v = None, [], []
    eps = a.rms_norm_eps
    for i in range(L):
        p = f"l{i}."
        g1 = const(p + "g1", sd[f"layers.{i}.attn_norm.weight"])
        if mlp_out is None:
            h = op("SimplifiedLayerNormalization", [res, g1], [p + "h"], axis=-1, epsilon=eps)
        else:
            h, _, _, res = op("SkipSimplifiedLayerNormalization", [res, mlp_out, g1],
                              [p + "h", "", "", p + "res0"], domain=MS, epsilon=eps)
        qkv = linear(h, f"layers.{i}.attn.qkv.weight", p + "qkv")
        qk, v = op("Split", [qkv, "split_qkv"], [p + "qk", p + "v"], axis=1)
        qk = op("RotaryEmbedding", [op("Reshape", [qk, "qk3"], [p + "qk3"]), "positions", "cos_cache",
                                    "sin_cache"], [p + "qkr"], domain=MS, interleaved=0, num_heads=H + KVH)
        q, k = op("Split", [op("Reshape", [qk, "rows2d"], [p + "qk2"]), "split_qk"], [p + "q", p + "k"], axis=1)
        new_k.append(op("Reshape", [k, "layer_row"], [p + "k_row"]))
        new_v.append(op("Reshape", [v, "layer_row"], [p + "v_row"]))
        past_k, past_v = (op("Squeeze", [op("Gather", [pool, rows[2 * i + j]], [p + f"past{j}"], axis=0), "zero"],
                             [p + f"past{j}_4d"]) for j in (0, 1))
        keys = op("Concat", [past_k, op("Reshape", [k, "kv4d"], [p + "k4"])], [p + "keys"], axis=2)
        values = op("Concat", [past_v, op("Reshape", [v, "kv4d"], [p + "v4"])], [p + "values"], axis=2)
        scores = op("MatMul", [op("Reshape", [q, "q4d"], [p + "q4"]),
                               op("Transpose", [keys], [p + "keys_t"], perm=[0, 1, 3, 2])], [p + "s"])
        scores = op("Add", [op("Mul", [scores, "scale"], [p + "s_scaled"]), "mask"], [p + "s_masked"])
        out = op("MatMul", [op("Softmax", [scores], [p + "probs"], axis=-1), values], [p + "attn"])
        attn = linear(op("Reshape", [out, "rows2d"], [p + "attn2d"]), f"layers.{i}.attn.o.weight", p + "attn_o")
        h2, _, _, res = op("SkipSimplifiedLayerNormalization",
                           [res, attn, const(p + "g2", sd[f"layers.{i}.mlp_norm.weight"])],
                           [p + "h2", "", "", p + "res1"], domain=MS, epsilon=eps)
        gate, up = op("Split", [linear(h2, f"layers.{i}.mlp.gate_up.weight", p + "gu"), "split_gu"],
                      [p + "gate", p + "up"], axis=1)
        act = op("Mul", [op("Mul", [gate, op("Sigmoid", [gate], [p + "sig"])], [p + "silu"]), up], [p + "act"])
        mlp_out = linear(act, f"layers.{i}.mlp.down.weight", p + "mlp")
    final, _, _, _ = op("SkipSimplifiedLayerNormalization", [res, mlp_out, const("gf", sd["norm.weight"])],
                        ["final", "", "", "res_f"], domain=MS, epsilon=eps)
    linear(final, "lm_head.weight", "logits")
    op("Reshape", [op("Concat", new_k, ["new_k_rows"], axis=0), "new_kv"], ["new_k"])
    op("Reshape", [op("Concat", new_v, ["new_v_rows"], axis=0), "new_kv"], ["new_v"])
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph(
        nodes, "decode",
        [helper.make_tensor_value_info("input_ids", i64, ["B"]),
         helper.make_tensor_value_info("positions", i64, ["B", 1]),
         helper.make_tensor_value_info("kv_pool", f32, [L, 2, "NB", KVH, "BS", hd]),
         helper.make_tensor_value_info("rows", i64, [2 * L, "B", KVH, "P"]),
         helper.make_tensor_value_info("mask", f32, ["B", 1, 1, "P1"])],
        [helper.make_tensor_value_info(n, f32, None) for n in ("logits", "new_k", "new_v")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)])
    onnx.save(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data",
              size_threshold=1024)
    return len(nodes)


def decode_inputs(batch: DecodeBatch, pool: torch.Tensor) -> dict[str, np.ndarray]:
    """The decode graph's inputs: the pool rows of every sequence's cached tokens, per layer and
    K/V (``[2L, B, KVH, P]``), and a mask of the padding past each sequence's own cache."""
    L, _, NB, KVH, BS, _ = pool.shape
    B, cached = batch.token_ids.shape[0], batch.context_lens - 1
    P = max(1, int(cached.max()))
    pos = torch.arange(P)
    blocks = batch.block_tables[:, (pos // BS).clamp(max=batch.block_tables.shape[1] - 1)]
    layer_kv = torch.arange(2 * L).view(2 * L, 1, 1, 1)
    heads = torch.arange(KVH).view(1, 1, KVH, 1)
    rows = ((layer_kv * NB + blocks.view(1, B, 1, P)) * KVH + heads) * BS + (pos % BS).view(1, 1, 1, P)
    mask = torch.zeros(B, 1, 1, P + 1)
    mask[:, 0, 0, :P] = torch.where(pos.view(1, P) < cached.view(B, 1), 0.0, float("-inf"))
    return {"input_ids": batch.token_ids.numpy(), "positions": batch.positions.view(-1, 1).numpy(),
            "kv_pool": pool.numpy(), "rows": rows.numpy(), "mask": mask.numpy()}


def session(path: str, spinning: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = torch.get_num_threads(), 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def decode_batch(llm: LLM, size: int) -> DecodeBatch:
    eng = llm.engine
    reqs = [eng.add_request(list(range(100 + 7 * i, 160 + 9 * i)), SamplingParams(max_tokens=64, ignore_eos=True))
            for i in range(size)]
    while any(r.num_output_tokens < 2 for r in reqs):
        eng.step()
    return eng._decode_batch(eng.scheduler.schedule().decodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["q4", "none"], default="q4")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    console = Console()
    level = 1 if args.quantization == "q4" else 4      # exact q4 for the agreement check
    folder = tempfile.mkdtemp(prefix="twophase-decode-graph-")

    def engine(accuracy_level: int) -> LLM:
        return LLM.from_config({"model": {"name": "smollm2-135m-instruct", "quantization": args.quantization,
                                          "accuracy_level": accuracy_level},
                                "backend": {"name": "onnxruntime"}, "cache": {"num_blocks": 512}})

    exact = engine(level)
    n = build(exact, args.quantization, level, os.path.join(folder, "exact.onnx"))
    batch = decode_batch(exact, 3)
    pool = exact.kv_cache.pool
    logits, new_k, new_v = session(os.path.join(folder, "exact.onnx"), False).run(None, decode_inputs(batch, pool))
    written = pool.clone()
    write_new_kv(written, torch.from_numpy(new_k), torch.from_numpy(new_v), batch.slot_mapping)
    want = exact.backend.decode(batch)
    rel = float((torch.from_numpy(logits) - want).abs().max() / want.abs().max())
    console.print(f"decode graph: {n} nodes; against the exported graph (3 sequences"
                  f"{', q4 at accuracy level 1' if args.quantization == 'q4' else ''}): logits "
                  f"{rel:.1e} relative, new K/V {float((written - pool).abs().max()):.1e}")
    del exact
    fast = os.path.join(folder, "fast.onnx")
    build(engine(4), args.quantization, 4, fast)
    sessions = {"decode graph, threads sleeping": session(fast, False),
                "decode graph, threads spinning": session(fast, True)}
    table = Table(title=f"one decode step, default model ({args.quantization}), ms: median of {args.rounds}")
    for col in ("batch", "exported graph (backend)", *sessions):
        table.add_column(col, justify="right")
    for size in args.batch:
        llm = engine(4)                                 # a fresh engine for each batch
        batch = decode_batch(llm, size)
        times: dict[str, list[float]] = {"exported": [], **{k: [] for k in sessions}}
        for _ in range(args.rounds):
            t = time.perf_counter()
            llm.backend._run(graph_inputs(batch.as_prefill(), llm.kv_cache.block_size))
            times["exported"].append(time.perf_counter() - t)
            for name, sess in sessions.items():
                t = time.perf_counter()
                sess.run(None, decode_inputs(batch, llm.kv_cache.pool))
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["exported"])
        table.add_row(str(size), f"{1000 * base:.2f}",
                      *(f"{1000 * statistics.median(times[k]):.2f} (x{base / statistics.median(times[k]):.2f})"
                        for k in sessions))
    console.print(table)


if __name__ == "__main__":
    main()
