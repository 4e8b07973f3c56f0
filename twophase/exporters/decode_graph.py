"""A decode-only ONNX graph, built by hand with ONNX Runtime's fused operators: the graph the
onnxruntime backend runs for steps that are all decodes (one token per sequence) on the CPU.

Why a second graph: the step graph (``twophase.exporters.onnx``) is torch's trace of a whole
mixed step, chunks and decodes, every dimension dynamic: about 4,900 nodes after ORT's optimiser.
At small decode batches the step is latency-bound and those nodes, a few microseconds each, cost
more than the matmuls. This graph does one thing, with ``SkipSimplifiedLayerNormalization``
(residual add and RMSNorm in one), ``RotaryEmbedding`` over Q and K at once, the projections as
in the step graph (float Gemms, or ``twophase.exporters.q4.projection``), and attention over the
cached tokens (whole blocks gathered from the pool) plus the new token's own K/V: about 1,900
nodes for the default model. Measured with ``benchmarks/decode_graph.py`` (q4, both graphs with
threads spinning): a decode step 1.4x faster at batch 1, 1.1x at batches 8 and 32 with contexts
of about 64 tokens; 1.3x at batch 1 and level at batch 8 with about 1,024. Equal to the step
graph to float32 rounding.

Inputs: ``input_ids [B]``, ``positions [B, 1]``, ``kv_pool`` (the engine's pool), ``blocks [2L,
B, W]`` (each layer's K then V blocks of each sequence's cache, as indices of the pool's
``L * 2 * NB`` blocks; see ``graph.inputs.decode_graph_inputs``) and ``mask [B, 1, 1, W * BS + 1]`` (0, or -inf past a
sequence's own cache; the last column is the new token). Outputs as the step graph's:
``logits [B, vocab]``, ``new_k``/``new_v [L, B, KVH, hd]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twophase.exporters import q4
from twophase.graph.signature import DECODE_GRAPH, VERIFY_GRAPH
from twophase.models.quant import QWeight

MS = "com.microsoft"


def supported(arch) -> bool:
    """The graph computes the plain Llama block: models using any architecture feature (biases,
    QK-norm, ...) keep the exported step graph for decodes."""
    return not arch.features()


def build(torch_model, path: Path, qweights: dict[str, QWeight] | None = None,
          outliers: dict[str, np.ndarray] | None = None, accuracy_level: int = 4,
          verify: bool = False) -> int:
    """Write the decode graph of ``torch_model`` (float32) to ``path``, its projections on
    ``qweights`` where given (as in the q4 step graph) else float; returns its node count.

    ``verify``: the graph for short chunks instead (``VERIFY_GRAPH``): each of ``B`` sequences
    brings ``Q`` tokens (a decode and its drafts, padded to the longest), attending causally
    among themselves after the cache; the same nodes but for a few transposes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    a = torch_model.arch
    sd = {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}
    L, H, KVH, hd = a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim
    outliers = outliers or {}
    nodes, inits = [], []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.array(value, order="C"), name))   # keeps 0-d
        return name

    def op(kind: str, inputs: list[str], outputs: list[str], **attrs):
        nodes.append(helper.make_node(kind, inputs, outputs, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def linear(x: str, key: str, y: str) -> str:
        if qweights is not None:
            more_nodes, more_inits = q4.projection(x, y, key, qweights[key], outliers.get(key), accuracy_level)
            nodes.extend(more_nodes)
            inits.extend(more_inits)
            return y
        tied = key == "lm_head.weight" and a.tie_word_embeddings
        return op("Gemm", [x, "embed" if tied else const(key, sd[key])], [y], transB=1)

    freqs = np.arange(a.max_position_embeddings, dtype=np.float32)[:, None] * torch_model.inv_freq[0].numpy()[None]
    const("cos_cache", np.cos(freqs))
    const("sin_cache", np.sin(freqs))
    for name, value in _shapes(a, verify).items():
        const(name, np.array(value, np.int64))
    # the projections' rows reshaped to [B, Q, width] (Q = 1 in the decode graph)
    qkv_shape = op("Concat", [op("Shape", ["positions"], ["pos_shape"]), "qkv_width"], ["qkv_shape"],
                   axis=0) if verify else "qkv3"
    const("scale", np.array(hd ** -0.5, np.float32))
    res = op("Gather", [const("embed", sd["embed.weight"]), "input_ids"], ["x0"], axis=0)
    pool = op("Flatten", ["kv_pool"], ["pool_blocks"], axis=3)       # [L * 2 * NB, KVH * BS * hd]

    def attention(i: int, q: str, k: str, v: str) -> tuple[str, str, str]:
        """Attention of the new tokens ``q`` over each sequence's cached blocks of layer ``i``
        and their own ``k``/``v`` ([B, Q, KVH * hd]); returns the output ``[B * Q, H * hd]`` and
        the new K and V, ``[1, B, KVH, Q, hd]`` each."""
        p = f"l{i}."
        new, seen = [], []
        for j, (kind, x) in enumerate((("k", k), ("v", v))):
            ids = op("Gather", ["blocks", const(f"{p}{kind}_at", np.array([2 * i + j], np.int64))],
                     [f"{p}{kind}_ids"], axis=0)                               # [1, B, W]
            got = op("Reshape", [op("Gather", [pool, ids], [f"{p}{kind}_got"], axis=0), "kv_blocks"],
                     [f"{p}{kind}_got6d"])                                     # [1, B, W, KVH, BS, hd]
            past = op("Reshape", [op("Transpose", [got], [f"{p}{kind}_heads"], perm=[0, 1, 3, 2, 4, 5]),
                                  "kv_past"], [f"{p}{kind}_past"])            # [1, B, KVH, W * BS, hd]
            new.append(_new_kv(op, x, f"{p}{kind}", verify))
            seen.append(op("Concat", [past, new[-1]], [f"{p}{kind}_all"], axis=3))
        keys, values = seen
        keys_t = op("Transpose", [keys], [p + "keys_t"], perm=[0, 1, 2, 4, 3])
        scores = op("MatMul", [_queries(op, q, p, verify), keys_t], [p + "s"])
        scores = op("Add", [op("Mul", [scores, "scale"], [p + "s_scaled"]), "mask"], [p + "s_masked"])
        out = op("MatMul", [op("Softmax", [scores], [p + "probs"], axis=-1), values], [p + "attn"])
        return _rows(op, out, p, verify), new[0], new[1]

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
        qkv = op("Reshape", [linear(h, f"layers.{i}.attn.qkv.weight", p + "qkv"), qkv_shape], [p + "qkv3"])
        qk, v = op("Split", [qkv, "split_qkv"], [p + "qk", p + "v"], axis=2)
        qk = op("RotaryEmbedding", [qk, "positions", "cos_cache", "sin_cache"], [p + "qkr"],
                domain=MS, interleaved=0, num_heads=H + KVH)
        q, k = op("Split", [qk, "split_qk"], [p + "q", p + "k"], axis=2)
        out, k_new, v_new = attention(i, q, k, v)
        new_k.append(k_new)
        new_v.append(v_new)
        attn = linear(out, f"layers.{i}.attn.o.weight", p + "attn_o")
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
    for name, parts in (("new_k", new_k), ("new_v", new_v)):
        joined = op("Concat", parts, [name + "_layers"], axis=0)                  # [L, B, KVH, Q, hd]
        if verify:
            joined = op("Transpose", [joined], [name + "_rows"], perm=[0, 1, 3, 2, 4])
        op("Reshape", [joined, "new_kv"], [name])
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    model_dims = {"L": L, "P": 2, "KVH": KVH, "hd": hd, "2L": 2 * L}
    sig = VERIFY_GRAPH if verify else DECODE_GRAPH
    graph = helper.make_graph(
        nodes, "verify" if verify else "decode",
        [helper.make_tensor_value_info(name, f32 if name in ("kv_pool", "mask") else i64,
                                       sig.partial_shape(name, model_dims))
         for name in sig.names],
        [helper.make_tensor_value_info(n, f32, None) for n in sig.outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=Path(path).name + ".data",
              size_threshold=1024)
    return len(nodes)


def _shapes(a, verify: bool) -> dict[str, list[int]]:
    """The graph's constant shapes (0: the input's size there, -1: the rest)."""
    L, H, KVH, hd = a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim
    G = H // KVH
    shapes = {"split_qkv": [(H + KVH) * hd, KVH * hd], "split_qk": [H * hd, KVH * hd],
              "rows2d": [-1, H * hd], "kv_blocks": [1, 0, 0, KVH, -1, hd], "kv_past": [1, 0, 0, -1, hd],
              "split_gu": [a.intermediate_size] * 2, "new_kv": [L, -1, KVH, hd]}
    if verify:
        return shapes | {"kv4": [0, 0, KVH, hd], "q5": [0, 0, KVH, G, hd], "q4m": [0, 0, -1, hd],
                         "qg5": [0, 0, -1, G, hd], "axis0": [0], "qkv_width": [(H + 2 * KVH) * hd]}
    return shapes | {"qkv3": [0, 1, (H + 2 * KVH) * hd], "q4d": [-1, KVH, G, hd],
                     "kv_new": [1, -1, KVH, 1, hd]}


def _new_kv(op, x: str, p: str, verify: bool) -> str:
    """A layer's new K or V ``[B, Q, KVH * hd]`` as ``[1, B, KVH, Q, hd]``."""
    if not verify:
        return op("Reshape", [x, "kv_new"], [p + "_new"])
    heads = op("Transpose", [op("Reshape", [x, "kv4"], [p + "_4d"])], [p + "_heads_new"], perm=[0, 2, 1, 3])
    return op("Unsqueeze", [heads, "axis0"], [p + "_new"])


def _queries(op, q: str, p: str, verify: bool) -> str:
    """``q [B, Q, H * hd]`` as each KV head's query rows ``q * G + g``: ``[B, KVH, Q * G, hd]``."""
    if not verify:
        return op("Reshape", [q, "q4d"], [p + "q4"])
    q = op("Transpose", [op("Reshape", [q, "q5"], [p + "q5"])], [p + "q5t"], perm=[0, 2, 1, 3, 4])
    return op("Reshape", [q, "q4m"], [p + "q4"])


def _rows(op, out: str, p: str, verify: bool) -> str:
    """Attention's output ``[1, B, KVH, Q * G, hd]`` as one row a token: ``[B * Q, H * hd]``."""
    if verify:
        out = op("Reshape", [op("Squeeze", [out, "axis0"], [p + "attn4"]), "qg5"], [p + "attn5"])
        out = op("Transpose", [out], [p + "attn_t"], perm=[0, 2, 1, 3, 4])
    return op("Reshape", [out, "rows2d"], [p + "attn2d"])
