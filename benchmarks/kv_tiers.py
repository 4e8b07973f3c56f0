"""What the host and disk tiers buy: the first token of a request whose long prefix (4,096 tokens
by default) was (a) never seen, (b) is in the pool, (c) was evicted to host memory, (d) is on
disk and the process restarted. Each line in a process of its own (the disk line in a second
process, after the first wrote the prefix and exited), rounds interleaved; the first token's
time is the request's TTFT as the engine records it.

    python benchmarks/kv_tiers.py [--model smollm2-135m-instruct] [--backend torch]
                                  [--quantization none] [--prefix 4096] [--rounds 3]

On the CPU the first token of a 4k prompt is seconds of prefill; a tier hit is a copy of the
blocks (host: memcpy; disk: a read of files, from the page cache if they are still in it: the
disk line drops nothing from the page cache, say so when quoting it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

LINES = {"cold": "(a) computed cold", "pool": "(b) in the pool", "host": "(c) from host memory",
         "disk": "(d) from disk, after a restart"}


def _llm(args, disk: str | None, num_blocks: int = 64):
    """An engine with tiers on ``disk`` (none: no tiers, the probe that reads the layout)."""
    from twophase import LLM

    tiers = {"offload": {"host_gib": 2.0, "disk_dir": disk, "disk_gib": 4.0}} if disk else {}
    cfg = {"model": {"name": args.model, "quantization": args.quantization},
           "backend": {"name": args.backend}, "cache": {"num_blocks": num_blocks, **tiers}}
    if args.threads:
        cfg["backend"]["options"] = {"threads": args.threads}
    return LLM.from_config(cfg)


def _resized(llm, args, prompt_len: int):
    """``llm`` closed, and an engine whose pool holds one prompt of ``prompt_len`` and half
    another, whatever groups its layers' caches take blocks in (a sliding group's window, a full
    group's every token): a second long prompt evicts most of the first."""
    from twophase.cache.spec import sequence_blocks, step_blocks

    lay = llm.loaded.layout
    one = sequence_blocks(lay.specs, prompt_len, lay.chunk, lay.block_size)
    want = -(-3 * one // 2) + step_blocks(lay.specs, lay.chunk, lay.block_size)
    llm.close()
    return _llm(args, args.disk, want)


def _prompts(llm, prefix: int) -> tuple[list[int], list[int], list[int]]:
    """The long prefix with one question, with another, and an unrelated prompt as long."""
    from twophase.measure.quality import shipped_text

    words, ids = shipped_text().split(), []
    for times in range(1, 64):               # enough text for two prefixes, in any tokenizer
        ids = llm.tokenizer.encode(" ".join(words * times))
        if len(ids) >= 2 * prefix:
            break
    head, other = ids[:prefix], ids[prefix:2 * prefix]
    q = llm.tokenizer.encode(" Question: what is this text about? Answer:")
    q2 = llm.tokenizer.encode(" Question: who wrote this text? Answer:")
    return head + q, head + q2, other + q


def _ttft(llm, prompt: list[int]) -> float:
    from twophase import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    if "ttft_s" not in out.metrics:
        raise SystemExit(f"a {len(prompt)}-token prompt was not served ({out.finish_reason}): {out.error}")
    return out.metrics["ttft_s"]


def worker(args) -> dict:
    llm = _llm(args, None)                            # the probe: its tokenizer and layout
    first, second, other = _prompts(llm, args.prefix)
    llm = _resized(llm, args, max(map(len, (first, second, other))))
    _ttft(llm, list(range(1000, 1064)))               # warm: the first call's set-up is not the prefix's
    if args.worker == "disk":                         # a restarted process: the disk holds it
        out = {"ttft_s": _ttft(llm, second), "restored": llm.engine.kv.restored}
    elif args.worker == "write":                      # the first process: compute, then exit
        _ttft(llm, first)
        _ttft(llm, other)                             # evicts it to host memory
        llm.close()                                   # host memory goes to disk
        out = {}
    else:
        cold = _ttft(llm, first)
        pool = _ttft(llm, second)
        _ttft(llm, other)                             # the pool holds one prefix: evicted
        host = _ttft(llm, first)
        out = {"cold": cold, "pool": pool, "host": host, "restored": llm.engine.kv.restored}
    return out


def _run(args, line: str, disk: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", line, "--disk", disk, "--model", args.model,
           "--backend", args.backend, "--quantization", args.quantization, "--prefix", str(args.prefix)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{line} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from rich.console import Console
    from rich.table import Table

    times: dict[str, list[float]] = {k: [] for k in LINES}
    for r in range(args.rounds):
        disk = tempfile.mkdtemp(prefix="twophase-tiers-")
        one = _run(args, "same", disk)
        _run(args, "write", disk)
        restarted = _run(args, "disk", disk)
        assert restarted["restored"]["disk"] > 0, "the restarted process found nothing on disk"
        assert one["restored"]["host"] > 0, "the evicted prefix did not come back from host memory"
        for k in ("cold", "pool", "host"):
            times[k].append(one[k])
        times["disk"].append(restarted["ttft_s"])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    t = Table(title=f"first token after a {args.prefix}-token prefix: {args.model}, {args.backend}, "
                    f"quantization {args.quantization}, median of {args.rounds} rounds")
    for col in ("the prefix", "TTFT s", "x faster than cold"):
        t.add_column(col, justify="left" if col == "the prefix" else "right")
    for k, label in LINES.items():
        t.add_row(label, f"{med[k]:.3f}", f"{med['cold'] / med[k]:.1f}")
    Console().print(t)


if __name__ == "__main__":
    main()
