"""A decode step of multi-head latent attention with and without absorption, at several contexts:
one DeepSeek-V2-Lite-shaped attention layer (16 heads; latent 512 + rotary key 64; keys 128 + 64,
values 128), float32, its cached latents in a paged pool, rounds of the two forms interleaved.

    python benchmarks/mla_decode.py [--contexts 1024,8192,32768] [--batch 1] [--rounds 5]

*absorbed* (what the engine runs for decodes) attends over the latents as they lie, ``kv_b``
folded into the query and the output; *expanded* (its prefill form) makes every head's keys and
values from the context's latents through ``kv_b`` at each step. Both read the same cache; the
expanded form's extra cost is the ``kv_b`` matmul over the whole context (and the per-head K/V it
writes), which a decode pays again at every token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from twophase.arch import AttentionSpec, LayerSpec, MLASpec, MLPSpec, ModelArch
from twophase.models.layers.mla import LatentAttention, write_latent

MLA = MLASpec(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
ARCH = ModelArch("deepseek_v2", vocab_size=16, hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=192,
                 layers=(LayerSpec(AttentionSpec(), MLPSpec(16)),), mla=MLA, rotary_dim=64)
BLOCK = 16


def setup(context: int, batch: int):
    torch.manual_seed(0)
    layer = LatentAttention(ARCH).eval().requires_grad_(False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    nb = -(-context // BLOCK)
    pool = torch.zeros(1, batch * nb, 1, BLOCK, MLA.latent_dim)
    for b in range(batch):              # each sequence's context, written as the engine writes it
        slots = torch.arange(context) + b * nb * BLOCK
        write_latent(pool, torch.randn(context, MLA.latent_dim), slots)
    tables = torch.arange(batch * nb).view(batch, nb)
    lens = torch.full((batch,), context)
    q_nope, q_pe = torch.randn(batch, 16, 128), torch.randn(batch, 16, 64)
    return layer, pool, tables, lens, q_nope, q_pe


def absorbed(layer, pool, tables, lens, q_nope, q_pe):
    return layer.absorbed(q_nope, q_pe, pool, tables, lens)


def expanded(layer, pool, tables, lens, q_nope, q_pe):
    from twophase.models.layers.mla import gather_latents

    ctx = gather_latents(pool, tables, q_nope.dtype)
    n = int(lens[0])
    return torch.stack([layer.expanded(q_nope[b:b + 1], q_pe[b:b + 1], ctx[b, :n], n - 1)[0]
                        for b in range(q_nope.shape[0])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"MLA decode step, one layer (16 heads, latent {MLA.latent_dim}), batch {args.batch}, float32, "
          f"{torch.get_num_threads()} threads; median ms of {args.rounds} interleaved rounds")
    print(f"{'context':>8} {'absorbed ms':>12} {'expanded ms':>12} {'x':>7} {'cache B/token':>14} "
          f"{'per-head K/V B/token':>21}")
    with torch.inference_mode():
        for c in args.contexts:
            state = setup(c, args.batch)
            a, e = absorbed(*state), expanded(*state)          # warm, and the same numbers
            err = float((a - e).abs().max() / e.abs().max())
            assert err < 1e-4, f"absorbed and expanded differ by {err:.2e} at {c}"
            times: dict[str, list[float]] = {"a": [], "e": []}
            for _ in range(args.rounds):
                for key, fn in (("a", absorbed), ("e", expanded)):
                    t = time.perf_counter()
                    fn(*state)
                    times[key].append(time.perf_counter() - t)
            ta, te = (1e3 * statistics.median(times[k]) for k in "ae")
            print(f"{c:>8} {ta:>12.2f} {te:>12.2f} {te / ta:>6.1f}x {MLA.latent_dim * 4:>14,} "
                  f"{16 * (192 + 128) * 4:>21,}")


if __name__ == "__main__":
    main()
