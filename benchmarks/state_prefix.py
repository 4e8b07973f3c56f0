"""A hybrid model's prefix hit against a cold prompt, and how many 32k-token sequences a fixed
pool holds for it and for the same model with every layer attending.

The model is ``state_decode.py``'s 16-layer shape with random weights on the torch backend. TTFT:
a prompt of a ``--prefix``-token shared prefix and 64 tokens of its own, one output token; cold
with prefix caching off (after an unrelated prompt as long), warm after another request with the
same prefix left its K/V blocks and its state snapshot at the prefix's end. Each (mode, round) in its own process, modes
interleaved. The pool: ``cache.memory_gb`` GiB, ``model.max_model_len`` 32768, as the engine lays
it out.

    python benchmarks/state_prefix.py --prefix 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from state_decode import SHAPE  # noqa: E402


def model(kind: str) -> dict:
    """The ``[model]`` section of a named shape registered in this process."""
    from twophase.models.families import arch_from_config
    from twophase.models.shapes import SHAPES

    n = SHAPE["num_hidden_layers"]
    types = ["full_attention" if kind == "full" or (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    SHAPES[f"bench-{kind}"] = arch_from_config({**SHAPE, "layer_types": types}, kind)
    return {"name": f"bench-{kind}", "weights": "random"}


def ttft(mode: str, prefix: int) -> float:
    from twophase import LLM, SamplingParams

    rng = random.Random(0)
    shared = [rng.randrange(3, 32000) for _ in range(prefix)]
    mine, other = ([rng.randrange(3, 32000) for _ in range(64)] for _ in range(2))
    cache = {"num_blocks": 2 * (prefix + 128) // 16 + 8, "prefix_caching": mode == "warm"}
    llm = LLM.from_config({"model": model("hybrid"), "cache": cache,
                           "scheduler": {"max_num_batched_tokens": 512}})
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    # both modes first run a prompt as long (so the first-call costs of every kernel are paid
    # before the clock starts); warm's shares the prefix and leaves its blocks and snapshot
    first = shared + other if mode == "warm" else [rng.randrange(3, 32000) for _ in range(prefix + 64)]
    llm.generate([first], params)
    t0 = time.perf_counter()
    out = llm.generate([shared + mine], params)[0]
    took = time.perf_counter() - t0
    assert (out.metrics["num_cached_tokens"] > 0) == (mode == "warm"), out.metrics
    return took


def fit(kind: str, memory_gb: float) -> dict:
    from twophase import LLM

    llm = LLM.from_config({"model": {**model(kind), "max_model_len": 32768},
                           "cache": {"memory_gb": memory_gb}, "scheduler": {"max_num_seqs": 64}})
    lay = llm.loaded.layout
    return {"concurrency": lay.concurrency(32768), "blocks": lay.num_blocks, "state_bytes": lay.state_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-gb", type=float, default=4.0)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        what, arg = args.one
        print(json.dumps(ttft(what, args.prefix) if what in ("cold", "warm") else fit(what, float(arg))))
        return

    def run(*a: str) -> object:
        out = subprocess.run([sys.executable, __file__, "--prefix", str(args.prefix), "--one", *a],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    got: dict[str, list[float]] = {"cold": [], "warm": []}
    for r in range(args.rounds):
        for mode in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
            got[mode].append(float(run(mode, "0")))   # type: ignore[arg-type]
    cold, warm = statistics.median(got["cold"]), statistics.median(got["warm"])
    print(f"TTFT, {args.prefix:,}-token shared prefix + 64 tokens, medians of {args.rounds} rounds: "
          f"cold {cold:.2f} s, prefix hit {warm:.2f} s (x{cold / warm:.1f})")
    for kind in ("hybrid", "full"):
        f = run(kind, str(args.memory_gb))
        print(f"{kind}: {args.memory_gb:g} GiB hold {f['concurrency']} sequences of 32,768 tokens "   # type: ignore[index]
              f"({f['blocks']:,} blocks, state {f['state_bytes'] / 2**20:.0f} MiB)")   # type: ignore[index]


if __name__ == "__main__":
    main()
