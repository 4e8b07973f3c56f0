"""Disaggregated prefill and decode against one engine, side by side in one run.

Colocated: one engine in this process on every core (``threads = 2`` on a 2-core machine),
chunked prefill on. Disaggregated: a prefill worker and a decode worker on Ray, one thread each,
the prompt's K/V pulled through the object store; or, with ``--prefill-threads 2 --prefill-nice
10``, the prefill worker on both cores at a lower OS priority, so a decode step preempts it.
Both take the same workload, with rounds interleaved: prompts of 1-2k tokens arriving as a
Poisson process, each decoding ``--max-tokens`` tokens, so long prompts keep arriving while
others decode. Reported per setup:
p99 inter-token latency, TTFT p50/p99, output tokens/s and goodput (requests meeting
TTFT <= 2 s and TPOT <= 100 ms, per second). Then the K/V transfer's cost: ms and MB per
1k-token prompt, against that prompt's prefill time.

    python benchmarks/disaggregated.py [--requests 8] [--rate 0.12] [--rounds 2] [--max-tokens 64]
                                       [--backend torch|onnxruntime|native] [--quantization q4]
                                       [--prefill-threads N]
                                       [--prefill-nice N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.cluster import launch
from twophase.cluster.frontend import ClusterLoop
from twophase.config import load_config
from twophase.measure.quality import shipped_text
from twophase.server.loop import EngineLoop, Finished

MODEL = {"name": "smollm2-135m-instruct"}
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.100


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 1,000-2,000 tokens cut from the shipped prose (distinct starts, so the
    prefix cache does not serve them)."""
    ids = tokenizer.encode(shipped_text())
    while len(ids) < 4000:
        ids = ids + ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1000, 2000)
        start = rng.randrange(0, len(ids) - length)
        out.append([rng.randrange(3, 1000)] + ids[start:start + length - 1])
    return out


async def one(loop, ids: list[int], params: SamplingParams, delay: float) -> tuple[float, list[float]]:
    """(arrival, token arrival times) of one request that arrives after ``delay``."""
    await asyncio.sleep(delay)
    arrival = time.perf_counter()
    ids = await loop.prepare(ids, params)
    handle = loop.submit(ids, params)
    times = []
    while not isinstance(item := await handle.next(), Finished):
        times += [time.perf_counter()] * len(item.token_ids)
    return arrival, times


async def run(loop, work: list[list[int]], gaps: list[float], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    delays = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    results = await asyncio.gather(*[one(loop, w, params, d) for w, d in zip(work, delays)])
    wall = time.perf_counter() - t0
    ttft = [ts[0] - a for a, ts in results]
    itl = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for _, ts in results]
    good = sum(1 for f, p in zip(ttft, tpot) if f <= TTFT_SLO_S and p <= TPOT_SLO_S)
    q = statistics.quantiles
    second = [ts[1] - ts[0] for _, ts in results]        # disaggregated: the handoff
    return {"itl_p99": q(itl, n=100)[98], "second_p50": statistics.median(second), "second_max": max(second),
            "ttft_p50": statistics.median(ttft),
            "ttft_p99": q(ttft, n=100)[98], "tok_s": sum(len(ts) for _, ts in results) / wall,
            "goodput": good / wall, "good": good / len(results)}


def transfer_cost(cluster, loop, tokenizer) -> tuple[float, float, float]:
    """(ms, MB, prefill ms) for a 1,000-token prompt through the disaggregated path, alone."""
    import ray

    ttfts = []
    for ids in prompts(tokenizer, 3, seed=99):            # distinct: no prefix-cache hits
        arrival, times = asyncio.run(one(loop, ids[:1000], SamplingParams(max_tokens=2, ignore_eos=True), 0))
        ttfts.append(times[0] - arrival)
    [decode] = cluster.workers["decode"]
    pulls = [p for p in ray.get(decode.kv_transfers.remote()) if p[0] >= 992][-3:]
    ms = statistics.median(p[2] for p in pulls) * 1e3
    return ms, pulls[-1][1] / 1e6, statistics.median(ttfts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0.12, help="arrivals per second (Poisson)")
    ap.add_argument("--backend", default="torch", help="every engine's [backend] name")
    ap.add_argument("--quantization", default="none", choices=["none", "q4"],
                    help="q4: the GGUF's 4-bit blocks (the native backend runs only these)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="cores: the colocated engine's threads")
    ap.add_argument("--prefill-threads", type=int, help="the prefill worker's (default: half of --threads)")
    ap.add_argument("--prefill-nice", type=int, default=0, help="the prefill worker's nice value")
    args = ap.parse_args()
    console = Console()

    # pools prefaulted, as a server's are: the first write to a page otherwise costs ~2 s/GiB here,
    # which a short run would measure instead of steady state
    base = {"model": {**MODEL, "quantization": args.quantization}, "cache": {"num_blocks": 2048, "prefault": True},
            "backend": {"name": args.backend}}
    colocated = LLM.from_config({**base, "backend": {"name": args.backend,
                                                     "options": {"threads": args.threads}}})
    local = EngineLoop(colocated, max_queue=256)
    half = max(1, args.threads // 2)
    cfg = load_config({**base, "cluster": {"prefill_workers": 1, "decode_workers": 1, "threads": half,
                                           "prefill_threads": args.prefill_threads or half,
                                           "prefill_nice": args.prefill_nice}})
    cluster = launch.start(cfg)
    remote = ClusterLoop(cluster, cluster.tokenizer(), cluster.info["max_model_len"], 256)
    setups = {"colocated": local, "disaggregated": remote}
    try:
        results: dict[str, list[dict[str, float]]] = {k: [] for k in setups}
        for r in range(args.rounds):
            rng = random.Random(r)
            work = prompts(colocated.tokenizer, args.requests, seed=r)
            gaps = [rng.expovariate(args.rate) for _ in work]
            for name, loop in setups.items():
                console.print(f"round {r + 1}/{args.rounds}: {name}")
                results[name].append(asyncio.run(run(loop, work, gaps, args.max_tokens)))
        c = cfg.cluster
        table = Table(title=f"{args.requests} requests a round, 1-2k-token prompts at {args.rate}/s, "
                            f"{args.max_tokens} output tokens each; medians over {args.rounds} rounds; "
                            f"colocated {args.threads} threads, prefill worker {c.prefill_threads} "
                            f"(nice {c.prefill_nice}), decode worker {c.threads}")
        table.add_column("setup")
        for col in ("ITL p99 ms", "2nd token p50 / max ms", "TTFT p50 s", "TTFT p99 s", "output tok/s",
                    "goodput req/s", "meeting SLO"):
            table.add_column(col, justify="right")
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
        for name, m in med.items():
            table.add_row(name, f"{m['itl_p99'] * 1e3:.0f}",
                          f"{m['second_p50'] * 1e3:.0f} / {m['second_max'] * 1e3:.0f}",
                          f"{m['ttft_p50']:.2f}", f"{m['ttft_p99']:.2f}",
                          f"{m['tok_s']:.1f}", f"{m['goodput']:.3f}", f"{m['good']:.0%}")
        console.print(table)
        c, d = med["colocated"], med["disaggregated"]
        console.print(f"disaggregated / colocated: ITL p99 x{d['itl_p99'] / c['itl_p99']:.2f}, "
                      f"goodput x{d['goodput'] / max(c['goodput'], 1e-9):.2f}, "
                      f"tok/s x{d['tok_s'] / c['tok_s']:.2f}")
        ms, mb, prefill_ms = transfer_cost(cluster, remote, colocated.tokenizer)
        console.print(f"K/V transfer of a 1,000-token prompt: {ms:.1f} ms, {mb:.1f} MB; its prefill "
                      f"{prefill_ms:.0f} ms (TTFT alone): {ms / prefill_ms:.1%} of it")
    finally:
        local.close()
        colocated.close()
        cluster.shutdown()


if __name__ == "__main__":
    main()
