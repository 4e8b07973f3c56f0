"""Compare backends phase by phase through the Python API (what `twophase bench` does, for
people who script rather than configure). IREE, unless it is the first backend, runs in a process
of its own, as in `twophase bench`: its runtime keeps what each new shape allocated (7 GB and
more for the default model in one process).

    python examples/compare_backends.py                       # tiny random model, CPU
    python examples/compare_backends.py --model smollm2-135m-instruct --backends torch,onnxruntime,iree
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.bench import serving, sweeps
from twophase.bench.isolated import ISOLATED, IsolatedLine
from twophase.config import SchedulerConfig, load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a named model, or a shape (random weights)")
    ap.add_argument("--backends", default="torch,onnxruntime")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = {"name": args.model} if args.model == "smollm2-135m-instruct" else \
        {"name": args.model, "weights": "random"}
    names = args.backends.split(",")
    cfgs = {n: {"model": model, "backend": {"name": n}, "cache": {"num_blocks": 1024},
                "scheduler": {"policy": "prefill-first", "max_num_batched_tokens": 512}} for n in names}
    llms = {n: IsolatedLine(load_config(cfgs[n]), n) if n in ISOLATED and i > 0
            else LLM.from_config(cfgs[n]) for i, n in enumerate(names)}

    def prefill(llm, n, k):
        return llm.prefill_round(n, 0, k) if isinstance(llm, IsolatedLine) else sweeps.prefill_round(llm, n, 0, k)

    def decode(llm, b, k):
        return llm.decode_round(b, 256, 6, k) if isinstance(llm, IsolatedLine) else \
            sweeps.decode_round(llm, b, 256, 6, k)

    # one round of every measurement on every backend, then the next round: drift hits all alike
    cases = {"prefill 512": lambda llm, k: 512 / prefill(llm, 512, k),
             "decode b1": lambda llm, k: 1 / decode(llm, 1, k),
             "decode b32": lambda llm, k: 32 / decode(llm, 32, k)}
    rates = {n: {c: [] for c in cases} for n in names}
    for k in range(args.rounds):
        for case, measure in cases.items():
            for n, llm in llms.items():
                rates[n][case].append(measure(llm, k))

    # a serving workload: 16 requests arriving at 8/s
    vocab = llms[names[0]].model.arch.vocab_size
    requests = serving.synthetic(16, 8.0, [32, 256], [16, 48], vocab, seed=0)
    served = {}
    for n, llm in llms.items():                                 # the default serving scheduler
        if isinstance(llm, IsolatedLine):
            served[n] = llm.serve(SchedulerConfig(), requests)
            llm.close()
        else:
            llm.reschedule(SchedulerConfig())
            served[n] = serving.run(llm.engine, requests)

    table = Table(title=f"{args.model}: tokens/s (median of {args.rounds} rounds; ratio to {names[0]})")
    for col in ["backend", *cases, "serving out tok/s", "TTFT p50 ms", "ITL p99 ms"]:
        table.add_column(col, justify="right")
    base = {c: statistics.median(rates[names[0]][c]) for c in cases}
    for n in names:
        cells = [f"{statistics.median(rates[n][c]):.1f} (x{statistics.median(rates[n][c]) / base[c]:.2f})"
                 for c in cases]
        s = served[n]
        cells += [f"{s['output_tokens_per_s']:.1f}", f"{s['ttft_s']['p50'] * 1e3:.1f}",
                  f"{s['itl_s']['p99'] * 1e3:.1f}"]
        table.add_row(n, *cells)
    Console().print(table)


if __name__ == "__main__":
    main()
