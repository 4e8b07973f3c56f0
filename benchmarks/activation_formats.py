"""Each prefill's activation format against its speed: pp512 tokens/s and the distance from the
float32 model of torch in float32 (the reference), torch in bfloat16 (weights and activations:
where the CPU has AMX, oneDNN runs its matmuls on the bf16 tiles), and the native backend on the
default model's GGUF as stored with bf16 activations on AMX tiles and with int8 activations (a
run of 32 rounded to 8 bits), and on its own q4 blocks (int8 activations).

    python benchmarks/activation_formats.py [--rounds 3] [--tokens 600] [--lines torch-bf16,...]

Speed: each line in a process of its own, rounds interleaved, best of 3 steps a round, median of
rounds. Quality: logits at every position of the shipped prose's first --tokens tokens, in 512-
token chunks, each line against the float32 reference in one process (speed is not timed
there): the mean KL(reference || line) in nats, the share of positions whose top token agrees,
and the perplexity's change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODEL = "smollm2-135m-instruct"
LINES = {
    "torch-fp32": ({"name": "torch"}, {"quantization": "none", "dtype": "float32"}),
    "torch-bf16": ({"name": "torch"}, {"quantization": "none", "dtype": "bfloat16"}),
    "native-gguf-amx": ({"name": "native"}, {"quantization": "gguf"}),
    "native-gguf-int8": ({"name": "native", "options": {"amx": False}}, {"quantization": "gguf"}),
    "native-q4": ({"name": "native"}, {"quantization": "q4"}),
}


def _llm(line: str):
    from twophase import LLM

    backend, model = LINES[line]
    return LLM.from_config({"model": {"name": MODEL, **model}, "backend": backend,
                            "scheduler": {"max_num_batched_tokens": 512}})


def speed(line: str) -> float:
    from twophase.measure.phase_timing import prefill_round

    llm = _llm(line)
    prefill_round(llm, 512, 0, 99)                          # warm
    return 512 / min(prefill_round(llm, 512, 0, k) for k in range(3))


def quality(lines: list[str], tokens: int) -> dict:
    import torch

    from twophase.measure.quality import all_logits, shipped_text

    ref = _llm("torch-fp32")
    ids = ref.tokenizer.encode(shipped_text())[:tokens]
    want = [lg.float() for _, lg in all_logits(ref, ids, 512)]
    out = {}
    for line in lines:
        llm = _llm(line)
        got = [lg.float() for _, lg in all_logits(llm, ids, 512)]
        lw = torch.cat(want).log_softmax(-1)[:-1]
        lg = torch.cat(got).log_softmax(-1)[:-1]
        kl = float((lw.exp() * (lw - lg)).sum(-1).mean())
        top1 = float((lw.argmax(-1) == lg.argmax(-1)).float().mean())
        nxt = torch.tensor(ids[1:])
        nll_w, nll_g = -lw.gather(1, nxt[:, None]).mean(), -lg.gather(1, nxt[:, None]).mean()
        out[line] = {"kl": kl, "top1": top1, "ppl_change": float((nll_g - nll_w).exp() - 1)}
        llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--lines", default=",".join(LINES))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lines = args.lines.split(",")
    if args.worker == "quality":
        print(json.dumps(quality([n for n in lines if n != "torch-fp32"], args.tokens)))
        return
    if args.worker:
        print(json.dumps(speed(args.worker)))
        return
    from rich.console import Console
    from rich.table import Table

    def run(*extra: str) -> object:
        done = subprocess.run([sys.executable, __file__, "--lines", args.lines, "--tokens", str(args.tokens), *extra],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{extra} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    rates: dict[str, list[float]] = {n: [] for n in lines}
    for r in range(args.rounds):
        for n in lines if r % 2 == 0 else lines[::-1]:
            rates[n].append(float(run("--worker", n)))              # type: ignore[arg-type]
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
    q = run("--worker", "quality")
    assert isinstance(q, dict)
    t = Table(title=f"{MODEL}: pp512 tokens/s (median of {args.rounds} rounds) and distance from torch "
                    f"float32 over {args.tokens} tokens of the shipped prose")
    for col in ("line", "pp512 tokens/s", "KL (nats)", "top-1 agrees", "perplexity change"):
        t.add_column(col, justify="left" if col == "line" else "right")
    for n in lines:
        m = q.get(n, {"kl": 0.0, "top1": 1.0, "ppl_change": 0.0})
        t.add_row(n, f"{statistics.median(rates[n]):.1f}", f"{m['kl']:.5f}", f"{m['top1']:.3f}",
                  f"{100 * m['ppl_change']:+.2f}%")
    Console().print(t)


if __name__ == "__main__":
    main()
