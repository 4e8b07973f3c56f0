"""Rewrite an exported step graph to run its projections and head on 4-bit (and 8-bit) weights
with ONNX Runtime's ``MatMulNBits`` contrib operator (MLAS kernels).

Each ``Gemm(x, W, transB=1)`` whose weight has a quantised form becomes
``MatMulNBits(x, codes, scales, zero_points)``, with *uint8* zero points: with float zero points
ORT's CPU kernel skips pre-packing and dequantises all of B on every call (see ``PrePack`` in
``contrib_ops/cpu/quantization/matmul_nbits.cc``: ``has_unquantized_zero_point_``). Q4_1's
per-block minimum ``m`` is not a zero point but an additive term, so it is added exactly:
``x @ (d*q + m)ᵀ = MatMulNBits(x) + blocksum(x) @ mᵀ``, where ``blocksum`` sums ``x`` over each
block of 32 inputs: a matmul 32x smaller than the weight's.

At ``accuracy_level`` 4 ONNX Runtime rounds the activations to int8 per block of 32 (as
llama.cpp rounds them to Q8_1) before they meet the codes. Two exact rewrites keep that rounding
small; on the default model they cut the mean KL divergence from the float model 14x (0.047 →
0.0034, llama.cpp's own on the same file: 0.0080). Both are exact for the GGUF's fp16 scales and
minimums, and exact to float32 rounding for weights quantised here:

- Centred zero points (``QWeight.centered``): each block's zero point moves to the code nearest
  its minimum, so the codes MLAS multiplies by the rounded activations are near the true
  weights, and only a small rest of ``m`` is left for the exact term.
- Outlier channels, as in LLM.int8(): a few input channels of each projection carry activations
  tens of times larger than the rest, and a block's int8 step is set by its largest element.
  Those channels (found once on ``twophase/data/calibration.txt``; they are a property of the
  model, not of the text) are zeroed before ``MatMulNBits`` and multiplied in float32 by their
  columns of the weight instead, in the same small matmul as the ``m`` term:
  ``y = MatMulNBits(x * keep) + [blocksum(x), x[:, idx]] @ [mᵀ; W[:, idx]ᵀ]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twophase.models.quant import BLOCK, QWeight, pack

MS_DOMAIN = "com.microsoft"


def quantize_graph(src: Path, dst: Path, weights: dict[str, QWeight], accuracy_level: int,
                   outliers: dict[str, np.ndarray] | None = None) -> int:
    """Read ``src`` (with its external data), write the rewritten graph to ``dst`` (weights as
    external data beside it); returns how many matmuls now run quantised. ``outliers`` names, per
    weight, the input channels computed in float32 instead (see the module's docstring)."""
    outliers = outliers or {}
    import onnx
    from onnx import helper

    model = onnx.load(str(src))
    g = model.graph
    added: list = []
    nodes = []
    done = 0
    for node in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        name = node.input[1] if len(node.input) > 1 else None
        key = name.removeprefix("model.") if name else None
        if node.op_type != "Gemm" or key not in weights or attrs.get("transB") != 1 \
                or attrs.get("transA", 0) or (len(node.input) > 2 and node.input[2]):
            nodes.append(node)
            continue
        more_nodes, more_inits = projection(node.input[0], node.output[0], key, weights[key],
                                            outliers.get(key), accuracy_level)
        nodes += more_nodes
        added += more_inits
        done += 1
    del g.node[:]
    g.node.extend(nodes)
    used = {i for nd in g.node for i in nd.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept + added)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)
    return done


def projection(x: str, y: str, key: str, qw: QWeight, outliers: np.ndarray | None,
               accuracy_level: int) -> tuple[list, list]:
    """Nodes and initializers computing ``y = x @ Wᵀ`` (``x`` 2-D) from the block-quantised
    ``qw``: MatMulNBits on centred codes, plus the exact float32 term for the minimum's rest and
    the ``outliers`` input channels (see the module's docstring)."""
    from onnx import helper, numpy_helper

    qw = qw.centered()
    n, k = qw.shape
    b, scales, zeros = pack(qw)
    stem = f"{key}.q{qw.bits}"
    inits = [numpy_helper.from_array(b, stem + ".codes"),
             numpy_helper.from_array(scales, stem + ".scales"),
             numpy_helper.from_array(zeros, stem + ".zero_points")]
    nodes = []
    idx = np.zeros(0, np.int64) if outliers is None else outliers
    extra = []                                 # (input [M, j], weight rows [j, N]) of the term
    if qw.minimum is not None:
        inits += [numpy_helper.from_array(np.array([-1, k // BLOCK, BLOCK], np.int64), stem + ".blocks"),
                  numpy_helper.from_array(np.array([2], np.int64), stem + ".axis")]
        nodes += [helper.make_node("Reshape", [x, stem + ".blocks"], [stem + ".xb"]),
                  helper.make_node("ReduceSum", [stem + ".xb", stem + ".axis"], [stem + ".xsum"],
                                   keepdims=0)]
        extra.append((stem + ".xsum", qw.minimum.T))
    quantised_input = x
    if len(idx):
        keep = np.ones(k, np.float32)
        keep[idx] = 0
        inits += [numpy_helper.from_array(keep, stem + ".keep"),
                  numpy_helper.from_array(idx.astype(np.int64), stem + ".outliers")]
        nodes += [helper.make_node("Mul", [x, stem + ".keep"], [stem + ".xkeep"]),
                  helper.make_node("Gather", [x, stem + ".outliers"], [stem + ".xout"], axis=1)]
        quantised_input = stem + ".xkeep"
        extra.append((stem + ".xout", quantised_columns(qw, idx).T))
    out = y if not extra else stem + ".dq"
    nodes.append(helper.make_node(
        "MatMulNBits", [quantised_input, stem + ".codes", stem + ".scales", stem + ".zero_points"],
        [out], name=stem + ".matmul", domain=MS_DOMAIN, K=k, N=n, bits=qw.bits,
        block_size=BLOCK, accuracy_level=accuracy_level))
    if extra:
        term_in = extra[0][0]
        if len(extra) > 1:
            term_in = stem + ".term_in"
            nodes.append(helper.make_node("Concat", [e[0] for e in extra], [term_in], axis=1))
        rows = np.concatenate([e[1] for e in extra]).astype(np.float32)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(rows), stem + ".term_w"))
        nodes += [helper.make_node("MatMul", [term_in, stem + ".term_w"], [stem + ".term"]),
                  helper.make_node("Add", [out, stem + ".term"], [y])]
    return nodes, inits


def quantised_columns(qw: QWeight, idx: np.ndarray) -> np.ndarray:
    """``d * (q - zero)`` at input channels ``idx``, float32 ``[N, len(idx)]``: what
    ``MatMulNBits`` would have multiplied those channels by (the minimum's term is separate)."""
    blocks = idx // BLOCK
    q = qw.codes[:, idx].astype(np.float32) - qw.zeros()[:, blocks].astype(np.float32)
    return qw.scale[:, blocks] * q
