"""What paging costs an exported graph: decode through the paged step graph against an
Optimum-style graph that takes each sequence's past K/V as one contiguous tensor, both in ONNX
Runtime on the CPU, same weights, same batch. The paged graph gathers each sequence's blocks
from the pool; the contiguous one pays instead to keep (and, in a real server, re-copy) padded
per-sequence K/V. Reported: time per decode step and the paged/contiguous ratio.

    python benchmarks/graph_overhead.py                 # 4 layers, hidden 256 (the prototype's shape)
    python benchmarks/graph_overhead.py --batch 32 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from dataclasses import replace

import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

from twophase.contract import KVCache, PrefillBatch
from twophase.exporters.onnx import INPUTS, PagedStep, _example
from twophase.graph.inputs import step_inputs
from twophase.models.decoder import Decoder
from twophase.models.layers.rotary import apply_rope
from twophase.models.shapes import named_shape
from twophase.models.state_dict import build_model


class ContiguousDecode(nn.Module):
    """One decode token per sequence over contiguous past K/V ``[L, B, KVH, S, hd]`` (+ a mask
    of the valid past), the layout of Optimum's exported decoders."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, past_k, past_v, past_mask):
        m = self.model
        x = m.embed(input_ids)
        freqs = positions.float()[:, None] * m.inv_freq[0][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        B = input_ids.shape[0]
        mask = torch.cat([past_mask, torch.ones(B, 1, dtype=torch.bool)], dim=1)[:, None, None, :]
        for i, layer in enumerate(m.layers):
            a = layer.attn
            h = layer.attn_norm(x)
            q, k, v = a.qkv(h).split([a.h * a.hd, a.kvh * a.hd, a.kvh * a.hd], -1)
            q = apply_rope(q.view(B, a.h, a.hd), cos, sin)
            k = apply_rope(k.view(B, a.kvh, a.hd), cos, sin)
            keys = torch.cat([past_k[i], k.view(B, a.kvh, 1, a.hd)], dim=2)
            vals = torch.cat([past_v[i], v.view(B, a.kvh, 1, a.hd)], dim=2)
            g = a.h // a.kvh
            s = (q.view(B, a.kvh, g, a.hd) @ keys.transpose(-1, -2)) * a.scale
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
            o = (F.softmax(s, dim=-1) @ vals).reshape(B, a.h * a.hd)
            x = x + a.o(o)
            x = x + layer.mlp(layer.mlp_norm(x))
        return m.logits(m.norm(x))


def session(path: str, threads: int):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def timed(sess, feeds, repeats: int) -> float:
    sess.run(None, feeds)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, feeds)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256, help="0: keep the shape's width")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    arch = named_shape(args.shape, args.layers)
    if args.hidden:
        heads = args.hidden // arch.head_dim
        arch = replace(arch, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_heads=heads, num_kv_heads=max(1, heads // 3))
    model = build_model(arch, torch.float32, torch.device("cpu"))
    B, S, bs = args.batch, args.context, args.block_size
    nb = -(-(S + 1) // bs)
    L, kvh, hd = arch.num_layers, arch.num_kv_heads, arch.head_dim
    pool = torch.randn(L, 2, B * nb + 1, kvh, bs, hd) * 0.5
    tables = torch.arange(B * nb).view(B, nb)
    ctx = torch.full((B,), S + 1)
    batch = PrefillBatch(token_ids=torch.arange(B) % arch.vocab_size, positions=torch.full((B,), S),
                         slot_mapping=tables[:, S // bs] * bs + S % bs, block_tables=tables,
                         context_lens=ctx, query_lens=[1] * B, start_positions=[S] * B)
    inputs = step_inputs(batch, KVCache(pool, bs))
    # the same cached K/V, laid out contiguously per sequence
    blocks = pool[:, :, tables]                                   # [L, 2, B, nb, KVH, BS, hd]
    flat = blocks.permute(0, 1, 2, 4, 3, 5, 6).reshape(L, 2, B, kvh, nb * bs, hd)[..., :S, :]
    past_k, past_v = flat[:, 0].contiguous(), flat[:, 1].contiguous()
    past_mask = torch.ones(B, S, dtype=torch.bool)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = PagedStep(model).eval()
        ex_args, dyn = _example(arch, torch.float32)
        torch.onnx.export(step, ex_args, f"{tmp}/paged.onnx", dynamo=True, input_names=INPUTS,
                          output_names=["logits", "new_k", "new_v"], dynamic_shapes=dyn,
                          opset_version=18, optimize=False)
        cont = ContiguousDecode(model).eval()
        from torch.export import Dim
        b, s = Dim("B"), Dim("S")
        torch.onnx.export(cont, (batch.token_ids, batch.positions, past_k, past_v, past_mask),
                          f"{tmp}/contiguous.onnx", dynamo=True, opset_version=18, optimize=False,
                          input_names=["input_ids", "positions", "past_k", "past_v", "past_mask"],
                          dynamic_shapes={"input_ids": {0: b}, "positions": {0: b},
                                          "past_k": {1: b, 3: s}, "past_v": {1: b, 3: s},
                                          "past_mask": {0: b, 1: s}})
        paged = session(f"{tmp}/paged.onnx", args.threads)
        contiguous = session(f"{tmp}/contiguous.onnx", args.threads)
        feeds_p = {n: (pool if n == "kv_pool" else inputs[n]).numpy() for n in INPUTS}
        feeds_c = {"input_ids": batch.token_ids.numpy(), "positions": batch.positions.numpy(),
                   "past_k": past_k.numpy(), "past_v": past_v.numpy(), "past_mask": past_mask.numpy()}
        lp = paged.run(None, feeds_p)[0]
        lc = contiguous.run(None, feeds_c)[0]
        err = float(abs(lp - lc).max() / abs(lc).max())
        tp, tc = [], []
        for _ in range(3):                                   # interleaved rounds
            tp.append(timed(paged, feeds_p, args.repeats))
            tc.append(timed(contiguous, feeds_c, args.repeats))
    p, c = statistics.median(tp), statistics.median(tc)
    print(f"{L} layers, hidden {arch.hidden_size}, decode batch {B} at context {S}, block {bs}")
    print(f"contiguous past K/V: {c * 1e3:.2f} ms/step")
    print(f"paged pool:          {p * 1e3:.2f} ms/step  (x{p / c:.2f}; logits agree to {err:.1e})")


if __name__ == "__main__":
    main()
