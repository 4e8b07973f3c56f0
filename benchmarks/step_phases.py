"""Where the native backend's step spends its time, op by op.

The kernels are built once more with ``-DSTEP_PHASES``: thread 0 reads the clock after each op
of ``step.c`` (after its barrier, so an op's time includes waiting for the slower thread) and
adds it to that op's total. The steps are the engine's own (``twophase.measure.phase_timing``): one
512-token prefill, decode at batch 1 and at batch 32 (context 128; a decode round also
recomputes each prompt's last token: that prefill step is left out). Means over the rounds'
steps. The K/V pool is backed at the start (``cache.prefault``): otherwise each round's new
blocks fault their pages in on the first write, which shows as "rope, K/V store". Beside the
ops: the C step in all, and the engine's step (what ``twophase bench`` times: scheduling, the
batch, the call, the logits). No hardware counters are needed (these machines' VMs have none),
and the ops' sum is the step's wall time, which a sampling profiler does not give for the barriers.

    python benchmarks/step_phases.py [--model gemma3-270m | --gguf FILE] [--quantization gguf|q4]
                                     [--isa native|avx-vnni|avx2] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.backends.native import kernel
from twophase.measure.phase_timing import decode_round, prefill_round

# step.c's PH_* in order
OPS = ("embed", "norm", "q/k/v", "rope, K/V store", "attention", "round", "o", "residual", "gate/up",
       "glu", "down", "experts", "head")
# each case: the kind of step it times, and one round of it
CASES = {"pp512": ("prefill", lambda llm, k: prefill_round(llm, 512, 0, k)),
         "tg batch 1": ("decode", lambda llm, k: decode_round(llm, 1, 128, 32, k)),
         "tg batch 32": ("decode", lambda llm, k: decode_round(llm, 32, 128, 8, k))}


class Phases:
    """The engine's native backend switched to the kernels built with the phase clock; each
    call's ops added to its kind's totals (a decode round's prefill steps apart from its decodes)."""

    def __init__(self, llm: LLM, isa: str):
        self.lib = kernel.load(kernel.ISA_FLAGS[isa] + ("-DSTEP_PHASES",))
        self.lib.step_phases.argtypes = [ctypes.c_void_p]
        self.lib.step_phases.restype = ctypes.c_long
        self.spent = {"prefill": np.zeros(len(OPS)), "decode": np.zeros(len(OPS))}
        self.calls = {"prefill": 0, "decode": 0}
        backend = llm.decode_backend
        if backend is not llm.prefill_backend or type(backend).__name__ != "NativeBackend":
            raise SystemExit("the phases are the native backend's, for both phases")
        backend.lib = self.lib
        for kind in self.spent:
            setattr(backend, kind, self._timed(kind, getattr(backend, kind)))

    def _totals(self) -> np.ndarray:
        out = np.zeros(len(OPS))
        self.lib.step_phases(out.ctypes.data)
        return out

    def _timed(self, kind: str, call):
        def run(batch):
            before = self._totals()
            logits = call(batch)
            self.spent[kind] += self._totals() - before
            self.calls[kind] += 1
            return logits
        return run

    def reset(self) -> None:
        for kind in self.spent:
            self.spent[kind][:] = 0
            self.calls[kind] = 0

    def per_call(self, kind: str) -> np.ndarray:
        return self.spent[kind] / max(self.calls[kind], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a model name (default: gemma3-270m)")
    ap.add_argument("--gguf", help="a GGUF file, in place of --model")
    ap.add_argument("--quantization", default="gguf", choices=("gguf", "q4"))
    ap.add_argument("--isa", default="native", choices=tuple(kernel.ISA_FLAGS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    model = {"path": args.gguf} if args.gguf else {"name": args.model}
    llm = LLM.from_config({"model": {**model, "quantization": args.quantization},
                           "backend": {"name": "native", "options": {"isa": args.isa, "threads": args.threads}},
                           "scheduler": {"policy": "prefill-first", "max_num_batched_tokens": 512,
                                         "max_num_seqs": 32},
                           "cache": {"num_blocks": "auto", "memory_gb": 1.5, "prefault": True}})
    phases = Phases(llm, args.isa)
    table = Table(title=f"{args.gguf or args.model} ({args.quantization}) on native, {args.isa} kernels "
                        f"({llm.decode_backend.isa}), {args.threads} threads: ms a step, share of the C step; "
                        f"{args.rounds} rounds")
    table.add_column("op")
    spent: dict[str, np.ndarray] = {}
    engine: dict[str, float] = {}
    for case, (kind, run) in CASES.items():
        run(llm, 99)                                   # warm: caches, the prefix cache, the pool
        phases.reset()
        durations = []
        for k in range(args.rounds):
            run(llm, k)
            durations += [s.duration for s in llm.engine.steps.records if s.mix == kind]
        spent[case] = phases.per_call(kind)
        engine[case] = statistics.mean(durations)
        table.add_column(case, justify="right")
    for i, op in enumerate(OPS):
        if any(spent[c][i] > 0 for c in CASES):
            table.add_row(op, *(f"{1e3 * spent[c][i]:.3f} ({100 * spent[c][i] / spent[c].sum():.0f}%)"
                                for c in CASES))
    table.add_row("C step", *(f"{1e3 * spent[c].sum():.3f}" for c in CASES), style="bold")
    table.add_row("engine step", *(f"{1e3 * engine[c]:.3f}" for c in CASES))
    Console().print(table)


if __name__ == "__main__":
    main()
