"""Structured outputs' cost: decode tokens/s with a JSON schema against without, at batch 1 and
32 on the same engine (rounds interleaved, the median step of decode-only steps at full batch),
each schema's compile time (a cold compiler: llguidance's tokenizer view aside, built once),
and the masks' time a step (all rows of a batch, in the mask thread).

    python benchmarks/structured.py                     # torch, the default model
    python benchmarks/structured.py --backend onnxruntime --rounds 5 --json structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.structured import StructuredOutputs
from twophase.structured.constraint import Grammars
from twophase.structured.masks import _compute

# long enough that no row's grammar ends inside the timed steps (64 tokens)
LOG = {"type": "array", "minItems": 12, "items": {"type": "object", "properties": {
    "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
    "level": {"enum": ["debug", "info", "warning", "error"]},
    "message": {"type": "string", "maxLength": 60}, "code": {"type": "integer", "minimum": 0}},
    "required": ["time", "level", "message", "code"], "additionalProperties": False}}
SCHEMAS = {
    "log lines (array of objects, pattern, enum)": LOG,
    "person (nested, ranges)": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]}}, "required": ["name", "age", "address"]},
    "any JSON object": None,
}


def decode_step_s(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    llm.engine.steps.clear()
    llm.generate(prompts, params)
    steps = [r.duration for r in llm.engine.steps.records
             if r.decode_seqs == len(prompts) and r.prefill_tokens == 0]
    return statistics.median(steps)


def compile_ms(llm: LLM) -> dict[str, float]:
    out = {}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputs(json_object=True) if schema is None else StructuredOutputs(json=schema)
        fresh = Grammars(llm.tokenizer, llm.model.arch.vocab_size, llm.engine.scheduler.eos_token_ids)
        fresh.constraint(StructuredOutputs(regex="a"))                # the tokenizer view, once
        t0 = time.perf_counter()
        fresh.constraint(spec)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


def mask_ms(llm: LLM, prompt: str, params: SamplingParams, batches: list[int]) -> dict[int, float]:
    """The masks of a step: ``b`` constrained rows, each 20 tokens into the LOG answer."""
    answer = llm.generate([prompt], params)[0].token_ids
    out = {}
    for b in batches:
        reqs = [llm.engine.add_request(prompt, params) for _ in range(b)]
        for r in reqs:
            r.constraint.accept_all(answer[:20])
        t0 = time.perf_counter()
        for _ in range(20):
            _compute([(r, ()) for r in reqs])
        out[b] = (time.perf_counter() - t0) / 20 * 1e3
        for r in reqs:
            llm.engine.abort(r.request_id)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "backend": {"name": args.backend},
                           "cache": {"num_blocks": 1024}, "scheduler": {"max_num_seqs": max(args.batch)}})
    console = Console()
    prompt = llm.apply_chat_template("Write the server's log for this morning as JSON.")
    free = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    tied = SamplingParams(max_tokens=args.max_tokens, structured=StructuredOutputs(json=LOG))
    rows, figures = [], {"backend": args.backend, "decode": {}, "compile_ms": {}, "mask_ms_a_step": {}}
    for b in args.batch:
        prompts = [prompt] * b
        decode_step_s(llm, prompts, free)                           # warm both
        decode_step_s(llm, prompts, tied)
        times: dict[str, list[float]] = {"free": [], "json": []}
        for _ in range(args.rounds):
            times["free"].append(decode_step_s(llm, prompts, free))
            times["json"].append(decode_step_s(llm, prompts, tied))
        f, j = (b / statistics.median(times[k]) for k in ("free", "json"))
        figures["decode"][b] = {"free_tok_s": f, "json_tok_s": j, "ratio": j / f}
        rows.append((f"decode batch {b}, tok/s", f"{f:.1f}", f"{j:.1f}", f"x{j / f:.3f}"))
    figures["compile_ms"] = compile_ms(llm)
    figures["mask_ms_a_step"] = mask_ms(llm, prompt, tied, args.batch)
    table = Table(title=f"structured outputs on {args.backend}, the default model (medians of {args.rounds})")
    for col in ("", "free", "JSON schema", "ratio"):
        table.add_column(col)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    for name, ms in figures["compile_ms"].items():
        console.print(f"compile {name}: {ms:.1f} ms")
    for b, ms in figures["mask_ms_a_step"].items():
        console.print(f"masks a step at batch {b}: {ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
