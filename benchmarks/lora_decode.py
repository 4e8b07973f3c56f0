"""The cost of serving adapters unmerged: decode at batch 32 on the default model (torch) with
four distinct rank-16 adapters spread over the batch, against the base model alone and against
one adapter merged into the weights (what a server of one fine-tune would run), and one adapter
unmerged. Each line runs in a process of its own, rounds interleaved (in alternating order), the
pool's pages touched at start (``cache.prefault``: a first touch inside a step costs a page fault,
and which line's steps paid more of them swung single runs by 20%); the adapters are random
(PEFT's format, ``twophase.lora.random_adapter``), which costs what trained ones cost.

Also: an adapter's load time (read, checked, placed in its slot) and the first request's
latency after a load against the same request's once it is resident.

    python benchmarks/lora_decode.py [--rounds 3] [--batch 32] [--rank 16] [--max-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINES = {"base": "base model", "merged": "1 adapter merged", "one": "1 adapter unmerged",
         "four": "4 adapters mixed unmerged"}


def _llm(folders: list[Path], threads: int | None):
    from twophase import LLM

    cfg = {"model": {"max_loras": 4}, "backend": {"name": "torch"}, "cache": {"num_blocks": 1024, "prefault": True},
           "scheduler": {"max_num_seqs": 64},
           "lora": [{"name": f"a{i}", "path": str(f)} for i, f in enumerate(folders)]}
    if threads:
        cfg["backend"]["options"] = {"threads": threads}
    return LLM.from_config(cfg)


def _merge(llm, folder: Path) -> None:
    """Add the adapter's deltas into the base weights (requests then run without one)."""
    import torch

    from twophase.lora.peft_adapter import load_peft_adapter
    from twophase.models.families import FAMILIES

    model = llm.prefill_backend.model
    adapter = load_peft_adapter("merged", folder, model, FAMILIES[llm.model.arch.family].layer_names)
    with torch.no_grad():
        for d in adapter.deltas:
            lin = model.layers[d.layer].get_submodule(d.module)
            w = lin.weight
            w[d.rows[0]:d.rows[1]] += (d.scale * d.b @ d.a).to(w.dtype)


def worker(line: str, folders: list[Path], batch: int, max_tokens: int, threads: int | None) -> dict:
    from twophase import SamplingParams

    llm = _llm(folders if line in ("one", "four") else [], threads)   # base, merged: no adapters
    if line == "merged":
        _merge(llm, folders[0])
    names = {"base": [None], "merged": [None], "one": ["a0"], "four": ["a0", "a1", "a2", "a3"]}[line]
    prompts = [f"Write a short story about a {w} in three sentences." for w in
               ("cat", "dog", "fox", "owl", "bee", "cow", "elk", "yak")]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora=names[i % len(names)])
              for i in range(batch)]
    llm.generate([llm.apply_chat_template(prompts[i % 8]) for i in range(4)], params[:4])   # warm
    outs = llm.generate([llm.apply_chat_template(prompts[i % 8]) for i in range(batch)], params)
    return {"decode_tokens_per_s": llm.report(outs)["decode_tokens_per_s"]}


def load_latency(folders: list[Path], threads: int | None) -> dict:
    """Load an adapter at run time; the first request with it, then the same again."""
    from twophase import SamplingParams

    llm = _llm(folders[:1], threads)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = llm.apply_chat_template("Name a colour.")
    llm.generate([prompt], p)                                     # warm
    start = time.perf_counter()
    llm.adapters.register("late", folders[1], load_now=True)
    load_s = time.perf_counter() - start
    first = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, lora="late"))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, lora="late"))[0]
    base = llm.generate([prompt], p)[0]
    return {"load_s": load_s, "first_e2e_s": first.metrics["e2e_s"], "again_e2e_s": again.metrics["e2e_s"],
            "base_e2e_s": base.metrics["e2e_s"]}


def _run(args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", *extra, "--folders", *map(str, args.folders),
           "--batch", str(args.batch), "--max-tokens", str(args.max_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--worker", nargs="?", const="", help=argparse.SUPPRESS)
    ap.add_argument("--folders", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        result = (load_latency(args.folders, args.threads) if args.worker == "load" else
                  worker(args.worker, args.folders, args.batch, args.max_tokens, args.threads))
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    from twophase import LLM
    from twophase.lora.random_adapter import write_random_adapter
    from twophase.models.families import FAMILIES

    root = Path(tempfile.mkdtemp(prefix="twophase-lora-"))
    base = LLM.from_config({"backend": {"name": "torch"}, "cache": {"num_blocks": 16}})
    names = FAMILIES[base.model.arch.family].layer_names
    args.folders = [write_random_adapter(base.prefill_backend.model, names, root / f"a{i}", rank=args.rank,
                                         alpha=2.0 * args.rank, seed=i) for i in range(4)]
    del base
    rates: dict[str, list[float]] = {k: [] for k in LINES}
    for r in range(args.rounds):
        for line in (list(LINES) if r % 2 == 0 else list(LINES)[::-1]):
            rates[line].append(_run(args, line)["decode_tokens_per_s"])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    t = Table(title=f"decode tokens/s at batch {args.batch}, rank-{args.rank} adapters on every "
                    f"projection, torch, median of {args.rounds} interleaved rounds")
    t.add_column("line")
    t.add_column("tokens/s", justify="right")
    t.add_column("x base", justify="right")
    for k, label in LINES.items():
        t.add_row(label, f"{med[k]:.1f}", f"{med[k] / med['base']:.3f}")
    Console().print(t)
    lat = _run(args, "load")
    print(f"adapter load (read, check, place): {lat['load_s'] * 1000:.0f} ms; an 8-token request's "
          f"latency: first after the load {lat['first_e2e_s'] * 1000:.0f} ms, again "
          f"{lat['again_e2e_s'] * 1000:.0f} ms, base model {lat['base_e2e_s'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
