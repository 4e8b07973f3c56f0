"""The GPU check's measurements: each a stage of ``scripts/gpu_check.sh``, each writing its
figures to ``--out`` as JSON (rewritten after every case, so a stage stopped by its time limit
leaves what it measured) and a table on stdout.

    python scripts/gpu_bench.py {greedy,bench,memory} --out DIR [--dry-run]

greedy  llama3-1b's shape (random weights, drawn on the CPU) in bf16 on torch/CUDA, CUDA graphs
        on and off, against the CPU's float32 reference: the tokens equal up to the first
        near-tie, and the log-probabilities within a bound, on the steps both computed from the
        same context. Exits 1 where either fails.
bench   llama3-8b's shape in bf16 on torch/CUDA, random weights: prefill of 512 and 2,048 tokens,
        decode at batch 1, 8, 32 and 64 (a 520-token context), CUDA graphs on and off. Every
        decode case first runs steps that capture its (batch, width) bucket, then times repeats
        of steps with no capture in them (checked), and reports their median; each case beside
        the roofline (``twophase.bench.roofline``): the bytes a step must read over the H200's
        4.8 TB/s, its FLOPs over ~990 TFLOP/s of dense bf16.
memory  llama3-1b in bf16: the memory plan against what the engine measured after load, for a
        fixed pool and for an automatic one, in one process (the second loaded after the first
        is closed, as a server reloading would). Exits 1 where an item parts from the plan by
        the check's own rule (10% and 256 MiB).

--dry-run runs each on the CPU at small shapes (the tiny model; bf16 on the CPU where the GPU
runs bf16), so the script's own mistakes show before a GPU is lent; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from twophase import LLM, SamplingParams
from twophase.bench.roofline import CostModel
from twophase.testing import logprob_gaps

H200_BYTES_S = 4.8e12            # HBM3e
H200_FLOPS = 989e12              # dense bf16 (the 1,979 TFLOP/s NVIDIA quotes is with sparsity)
# bf16 against float32, llama3-1b's shape at 16 layers, measured on the CPU: log-probabilities
# 0.06-0.08 apart on the steps both compute from one context, flips at top-2 gaps up to 0.035
BF16_LOGPROB_TOLERANCE = 0.15
BF16_TIE = 0.15


class Figures:
    """A stage's JSON, written after every case."""

    def __init__(self, out: Path, name: str, **head: Any):
        self.path = out / f"{name}.json"
        self.data: dict[str, Any] = {"stage": name, **head, "cases": []}
        self.save()

    def add(self, case: dict[str, Any]) -> None:
        self.data["cases"].append(case)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def environment(device: str) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release() -> None:
    """The memory of an engine closed and deleted handed back before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- greedy -----------------------------------------------------------------------------------
def greedy(args) -> int:
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    shape, layers = ("tiny", None) if dry else ("llama3-1b", None)
    model = {"name": shape, "weights": "random", "max_model_len": 1024, **({"num_layers": layers} if layers else {})}
    prompts = [[100 + 7 * i + j for j in range(17 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=5)
    fig = Figures(args.out, "greedy", env=environment(device), model=shape, tie=BF16_TIE,
                  logprob_tolerance=BF16_LOGPROB_TOLERANCE, dry_run=dry)
    t0 = time.perf_counter()
    ref = LLM.from_config({"model": {**model, "dtype": "float32"}, "cache": {"num_blocks": 128}})
    want = ref.generate(prompts, params)
    fig.data["reference_s"] = round(time.perf_counter() - t0, 1)
    print(f"CPU float32 reference: {len(prompts)} prompts x {params.max_tokens} tokens in "
          f"{fig.data['reference_s']} s")
    failed = 0
    print(f"{'graphs':>6} {'prompt':>6} {'agree':>6} {'gap at split':>12} {'max |dlogp|':>11}  verdict")
    for graphs in (True, False):
        llm = LLM.from_config({"model": {**model, "dtype": "bfloat16"}, "cache": {"num_blocks": 256},
                               "backend": {"name": "torch", "device": device,
                                           "options": {"cuda_graphs": graphs}}})
        llm.prefill_backend.model.load_state_dict(ref.prefill_backend.model.state_dict())    # the CPU's draw
        got = llm.generate(prompts, params)
        captured = sorted(llm.prefill_backend.graphs.captured) if llm.prefill_backend.graphs is not None else []
        for i, (o, r) in enumerate(zip(got, want)):
            case = compare_greedy(o, r)
            case.update(graphs=graphs, prompt=i, prompt_tokens=len(prompts[i]), captured=captured)
            failed += not case["passed"]
            fig.add(case)
            gap = "-" if case["gap_at_split"] is None else f"{case['gap_at_split']:.4f}"
            print(f"{'on' if graphs else 'off':>6} {i:>6} {case['agree']:>6} {gap:>12} "
                  f"{case['max_logprob_error']:>11.4f}  {case['verdict']}")
        if graphs and device.startswith("cuda") and not captured:
            print("greedy: CUDA graphs were on, yet none was captured")
            failed += 1
        llm.close()
        del llm
        release()
    fig.data["failed"] = failed
    fig.save()
    return 1 if failed else 0


def compare_greedy(ours, ref) -> dict[str, Any]:
    """Tokens up to the first split, the reference's top-2 gap there, and the largest
    log-probability difference on the steps both computed from one context."""
    gaps = logprob_gaps(ref)
    split = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)) if a != b), None)
    shared = len(ref.token_ids) if split is None else split + 1
    err = max((abs(lo[t] - lr[t]) for lo, lr in zip(ours.logprobs[:shared], ref.logprobs[:shared])
               for t in lr if t in lo), default=0.0)
    gap = None if split is None else gaps[split]
    near_tie = gap is not None and gap < BF16_TIE
    passed = (split is None or near_tie) and err <= BF16_LOGPROB_TOLERANCE
    verdict = ("equal" if split is None else "near-tie" if near_tie else "DIVERGED") + \
        ("" if err <= BF16_LOGPROB_TOLERANCE else ", LOGPROBS OFF")
    return {"agree": len(ref.token_ids) if split is None else split, "tokens": len(ref.token_ids),
            "gap_at_split": gap, "max_logprob_error": err, "passed": passed, "verdict": verdict}


# -- bench ------------------------------------------------------------------------------------
def bench(args) -> int:
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    shape = "tiny" if dry else "llama3-8b"
    dtype = "float32" if dry else "bfloat16"
    prefills = (64, 128) if dry else (512, 2048)
    batches = (1, 4) if dry else (1, 8, 32, 64)
    context = 40 if dry else 520      # 520 + the steps below stay in one bucket of 64 blocks
    warm, repeats, steps = (2, 3, 3) if dry else (3, 5, 16)
    fig = Figures(args.out, "bench", env=environment(device), model=shape, dtype=dtype, dry_run=dry,
                  peak_bytes_s=args.peak_bytes_s, peak_flops=args.peak_flops,
                  method=f"median of {repeats} repeats; decode: {steps} steps a repeat after {warm} "
                         f"that capture the bucket")
    print(f"{'graphs':>6} {'phase':>7} {'seqs':>5} {'tokens':>7} {'median ms':>10} {'tok/s':>11} "
          f"{'GB/s':>8} {'of BW':>6} {'TFLOP/s':>8} {'of peak':>7}")
    for graphs in (True, False):
        llm = LLM.from_config({
            "model": {"name": shape, "weights": "random", "dtype": dtype, "max_model_len": 4096},
            "backend": {"name": "torch", "device": device, "options": {"cuda_graphs": graphs}},
            "cache": {"num_blocks": 512 if dry else 4096, "prefix_caching": False},
            "scheduler": {"max_num_seqs": max(batches), "max_num_batched_tokens": 4096}})
        itemsize = torch.empty((), dtype=llm.spec.dtype).element_size()
        model = CostModel(llm.model.arch, itemsize, itemsize)      # the engine's own roofline
        for tokens in prefills:
            fig.add(report(time_prefill(llm, device, tokens, warm, repeats), model, graphs, args))
        for b in batches:
            fig.add(report(time_decode(llm, device, b, context, warm, repeats, steps), model, graphs, args))
        llm.close()
        del llm
        release()
    return 0


def prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(7919 * i + 31 * j) % (vocab - 10) + 5 for j in range(n)]


def time_prefill(llm: LLM, device: str, tokens: int, warm: int, repeats: int) -> dict[str, Any]:
    """One sequence's prompt of ``tokens`` in one step, timed from the step's start to its
    sampled token (``max_tokens = 1``)."""
    eng, vocab = llm.engine, llm.model.arch.vocab_size
    times = []
    for r in range(warm + repeats):
        req = eng.add_request(prompt(1000 + r, tokens, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
        sync(device)
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        sync(device)
        if steps != 1:
            raise RuntimeError(f"a {tokens}-token prefill took {steps} steps: raise max_num_batched_tokens")
        if r >= warm:
            times.append(time.perf_counter() - t0)
        del req
    return {"phase": "prefill", "seqs": 1, "tokens": tokens, "times_s": times}


def time_decode(llm: LLM, device: str, seqs: int, context: int, warm: int, repeats: int,
                steps: int) -> dict[str, Any]:
    """``seqs`` sequences decoding after ``context`` tokens: prefilled, then ``warm`` steps (the
    CUDA-graph bucket captured there), then ``repeats`` timed runs of ``steps`` steps, each a
    pure decode of every sequence with no capture in it."""
    eng, vocab = llm.engine, llm.model.arch.vocab_size
    total = warm + repeats * steps + 2
    reqs = [eng.add_request(prompt(i, context, vocab), SamplingParams(max_tokens=total, ignore_eos=True))
            for i in range(seqs)]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    for _ in range(warm):
        eng.step()
    graphs = llm.prefill_backend.graphs
    captured = len(graphs.captured) if graphs is not None else 0
    eng.steps.clear()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(device)
        times.append((time.perf_counter() - t0) / steps)
    recs = list(eng.steps.records)
    new = (len(graphs.captured) if graphs is not None else 0) - captured
    mixes = sorted({(r.mix, r.decode_seqs) for r in recs})
    problems = [f"{new} CUDA graph(s) captured inside the timed steps"] if new else []
    if len(recs) != repeats * steps or mixes != [("decode", seqs)]:
        problems.append(f"the timed steps were not all decodes of {seqs} sequences: {mixes}")
    for p in problems:
        print(f"gpu_bench: batch {seqs}: {p}: this case's figure is not valid", flush=True)
    for r in reqs:
        eng.abort(r.request_id)
    return {"phase": "decode", "seqs": seqs, "tokens": context + warm + repeats * steps // 2,
            "times_s": times, "buckets": sorted(graphs.captured) if graphs is not None else [],
            "valid": not problems, "problems": problems}


def report(case: dict[str, Any], model: CostModel, graphs: bool, args) -> dict[str, Any]:
    """The case's median beside the roofline: bytes a step must move over the peak bandwidth,
    its FLOPs over the peak (``twophase.bench.roofline``, as ``twophase bench`` counts them)."""
    t = statistics.median(case["times_s"])
    if case["phase"] == "prefill":
        cost = model.prefill(case["tokens"], 0, case["seqs"])
        tok_s = case["seqs"] * case["tokens"] / t
    else:
        cost = model.decode(case["seqs"], case["tokens"])
        tok_s = case["seqs"] / t
    moved, flops = cost.bytes, cost.flops
    case.update(graphs=graphs, median_s=t, tokens_s=tok_s, bytes=moved, flops=flops,
                bytes_s=moved / t, flops_s=flops / t, bw_fraction=moved / t / args.peak_bytes_s,
                flops_fraction=flops / t / args.peak_flops)
    print(f"{'on' if graphs else 'off':>6} {case['phase']:>7} {case['seqs']:>5} {case['tokens']:>7} "
          f"{t * 1e3:>10.2f} {tok_s:>11,.0f} {moved / t / 1e9:>8,.0f} {case['bw_fraction']:>6.1%} "
          f"{flops / t / 1e12:>8,.1f} {case['flops_fraction']:>7.1%}", flush=True)
    return case


# -- memory -----------------------------------------------------------------------------------
def memory(args) -> int:
    from twophase.plan.check import FLOOR, TOLERANCE

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    model = ({"name": "tiny", "weights": "random", "dtype": "float32"} if dry else
             {"name": "llama3-1b", "weights": "random", "dtype": "bfloat16", "max_model_len": 8192})
    fig = Figures(args.out, "memory", env=environment(device), model=model["name"], dry_run=dry,
                  rule=f"within {TOLERANCE:.0%} or {FLOOR >> 20} MiB")
    failed = 0
    print(f"{'pool':>6} {'blocks':>8} {'item':>9} {'predicted MiB':>14} {'measured MiB':>13}  verdict")
    for label, cache in (("fixed", {"num_blocks": 256 if dry else 4096}), ("auto", {})):
        llm = LLM.from_config({"model": model, "backend": {"name": "torch", "device": device},
                               "cache": cache})
        case: dict[str, Any] = {"pool": label, "num_blocks": llm.num_blocks, "check": llm.memory["check"],
                                "plan": [{"kind": i.kind, "name": i.name, "bytes": i.bytes, "how": i.how}
                                         for i in llm.plan.items],
                                "plan_num_blocks": llm.plan.num_blocks}
        if device == "cuda":
            free, total = torch.cuda.mem_get_info()
            case["device"] = {"used": total - free, "total": total,
                              "torch_allocated": torch.cuda.memory_allocated(),
                              "torch_reserved": torch.cuda.memory_reserved()}
            torch.cuda.reset_peak_memory_stats()
        llm.generate([[5] * 1000] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
        if device == "cuda":
            case["device"]["torch_peak_after_steps"] = torch.cuda.max_memory_allocated()
        for item, got in case["check"].items():
            within = abs(got["measured"] - got["predicted"]) <= max(TOLERANCE * got["predicted"], FLOOR)
            got["within"] = within
            failed += not within
            print(f"{label:>6} {llm.num_blocks:>8} {item:>9} {got['predicted'] / 2**20:>14,.1f} "
                  f"{got['measured'] / 2**20:>13,.1f}  {'ok' if within else 'OFF'}")
        fig.add(case)
        llm.close()
        del llm
        release()
    fig.data["failed"] = failed
    fig.save()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("greedy", "bench", "memory"))
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the stage's JSON")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at small shapes")
    ap.add_argument("--peak-bytes-s", type=float, default=H200_BYTES_S)
    ap.add_argument("--peak-flops", type=float, default=H200_FLOPS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_bench: torch {torch.__version__} sees no CUDA device (use --dry-run on the CPU)")
        return 2
    return {"greedy": greedy, "bench": bench, "memory": memory}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
