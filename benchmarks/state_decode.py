"""Decode step time against context: a hybrid model (Gated DeltaNet three layers in four, as
Qwen3.5) and the same model with every layer attending, random weights, the torch backend.

Each (model, context) is timed in its own process, the two models' rounds interleaved; a
step decodes ``--batch`` sequences whose K/V already hold ``context`` tokens (the pool's blocks
are what a decode reads; their values do not change its time).

    python benchmarks/state_decode.py --contexts 1024,8192,32768 --rounds 3
    python benchmarks/state_decode.py --decode-backend onnxruntime    # the split: torch prefill
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SHAPE = dict(model_type="qwen3_5_text", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
             num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, max_position_embeddings=65536, eos_token_id=2)


def graph_step(kind: str, context: int, batch: int, steps: int, backend: str) -> float:
    """``one`` on the engine's own decode backend (``backend``: prefill on torch, decode there,
    over one pool), the model a named shape with random weights."""
    import torch

    from twophase import LLM
    from twophase.contract import DecodeBatch
    from twophase.models.families import arch_from_config
    from twophase.models.shapes import SHAPES

    n = SHAPE["num_hidden_layers"]
    types = ["full_attention" if kind == "full" or (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    SHAPES[f"bench-{kind}"] = arch_from_config({**SHAPE, "layer_types": types}, kind)
    bs = 16
    blocks = -(-(context + 1) // bs)
    llm = LLM.from_config({"model": {"name": f"bench-{kind}", "weights": "random"},
                           "backend": {"prefill": {"name": "torch"}, "decode": {"name": backend}},
                           "cache": {"num_blocks": batch * blocks, "block_size": bs, "prefix_caching": False},
                           "scheduler": {"max_num_seqs": max(batch, 2)}})
    tables = torch.arange(batch * blocks).view(batch, blocks)
    pos = torch.full((batch,), context)
    d = DecodeBatch(torch.full((batch,), 5), pos, tables[:, context // bs] * bs + context % bs, tables, pos + 1,
                    torch.arange(batch) if llm.kv_cache.states else None)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        llm.decode_backend.decode(d)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def one(kind: str, context: int, batch: int, steps: int) -> float:
    """Median seconds of a decode step of ``batch`` sequences at ``context`` tokens."""
    import torch

    from twophase.builder.pool import zeros
    from twophase.cache.layout import state_spec
    from twophase.contract import DecodeBatch, KVCache, KVGroups
    from twophase.models.families import arch_from_config
    from twophase.models.state_dict import build_model

    n = SHAPE["num_hidden_layers"]
    types = ["full_attention" if kind == "full" or (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    arch = arch_from_config({**SHAPE, "layer_types": types}, kind)
    model = build_model(arch, torch.float32, torch.device("cpu"))
    bs, attending = 16, len(arch.attention_layers)
    blocks = -(-(context + 1) // bs)
    pool = zeros((attending, 2, batch * blocks, arch.num_kv_heads, bs, arch.head_dim), torch.float32,
                 torch.device("cpu"))
    st = state_spec(arch)
    states = tuple(tuple(torch.zeros(batch, *s) for s in st.shapes) for _ in range(st.num_layers)) if st else ()
    kv = KVCache(pool, bs, KVGroups.plain(attending), states)
    from twophase.backends.torch_eager import TorchBackend

    b = TorchBackend()
    b.model, b.arch, b.device, b.dtype, b.use_graphs, b.kv = model, arch, torch.device("cpu"), torch.float32, False, kv
    tables = torch.arange(batch * blocks).view(batch, blocks)
    pos = torch.full((batch,), context)
    slots = tables[:, context // bs] * bs + context % bs
    d = DecodeBatch(torch.full((batch,), 5), pos, slots, tables, pos + 1,
                    torch.arange(batch) if st else None)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        b.decode(d)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--decode-backend", default="torch",
                    help="decode on this backend (onnxruntime, iree) after a torch prefill, over one pool")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, ctx = args.one[0], int(args.one[1])
        print(json.dumps(one(kind, ctx, args.batch, args.steps) if args.decode_backend == "torch" else
                         graph_step(kind, ctx, args.batch, args.steps, args.decode_backend)))
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    got: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for c in contexts:
            for kind in ("hybrid", "full") if r % 2 == 0 else ("full", "hybrid"):
                out = subprocess.run([sys.executable, __file__, "--one", kind, str(c), "--batch", str(args.batch),
                                      "--steps", str(args.steps), "--decode-backend", args.decode_backend],
                                     capture_output=True, text=True, check=True)
                got.setdefault((kind, c), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"decode step on {args.decode_backend}, batch {args.batch}, medians of {args.rounds} rounds (ms)")
    print("| context | hybrid (12 DeltaNet + 4 attention) | full (16 attention) | full / hybrid |")
    print("|---|---|---|---|")
    base = {k: statistics.median(v) for k, v in got.items()}
    for c in contexts:
        h, f = base[("hybrid", c)], base[("full", c)]
        print(f"| {c:,} | {h * 1e3:.1f} | {f * 1e3:.1f} | x{f / h:.2f} |")
    h0, f0 = base[("hybrid", contexts[0])], base[("full", contexts[0])]
    h1, f1 = base[("hybrid", contexts[-1])], base[("full", contexts[-1])]
    print(f"growth {contexts[0]:,} -> {contexts[-1]:,}: hybrid x{h1 / h0:.2f}, full x{f1 / f0:.2f}")


if __name__ == "__main__":
    main()
