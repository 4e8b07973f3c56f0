"""What a refactor must not change, at two revisions of the source tree, each in its own process.

Each revision is checked out once (``git worktree``) and asked, in fresh processes: the logits at
every position of a stretch of the shipped prose (their SHA-256, so bit-identity is the test) on
the default model through torch, onnxruntime and native (q4 and gguf) and on Gemma 3 270M (torch,
native gguf); ``twophase plan --json`` over named shapes, backends and K/V formats (byte for
byte); and the load time of the cached default model (median of ``--loads`` fresh processes,
rounds interleaved). Exit status 1 when any logits or plan differ.

    python benchmarks/same_behaviour.py BASE_REV [--against . | REV] [--loads 3] [--skip-logits]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from revisions import remove_trees, tree  # checkouts of a revision, as revisions.py makes them

LOGITS = """
import hashlib, json, sys
from twophase import LLM
try:
    from twophase.measure.quality import all_logits, shipped_text
except ImportError:                      # a revision from before quality.py moved into measure/
    from twophase.quality import all_logits, shipped_text
model, backend, quantization = sys.argv[1:4]
llm = LLM.from_config({"model": {"name": model, "quantization": quantization},
                       "backend": {"name": backend, "options": {"threads": 2}},
                       "cache": {"num_blocks": 64}, "scheduler": {"max_num_batched_tokens": 96}})
ids = llm.tokenizer.encode(shipped_text())[:160]
h = hashlib.sha256()
for _, logits in all_logits(llm, ids):
    h.update(logits.float().contiguous().numpy().tobytes())
print(json.dumps({"sha256": h.hexdigest()}))
"""

PLANS = """
import contextlib, hashlib, io, json, sys, tempfile
from pathlib import Path
from twophase.cli import main
shapes, backends, kvs = json.loads(sys.argv[1])
got = {}
tmp = Path(tempfile.mkdtemp())
for shape in shapes:
    for backend in backends:
        for kv in kvs:
            for device in ("h200", "cpu"):
                cfg, out = tmp / "plan.toml", tmp / "plan.json"
                cfg.write_text(f'[model]\\nname = "{shape}"\\nweights = "random"\\n'
                               f'[backend]\\nname = "{backend}"\\n[cache]\\ndtype = "{kv}"\\n')
                extra = ["--memory-gb", "64"] if device == "cpu" else []
                err = io.StringIO()
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    try:
                        rc = main(["plan", str(cfg), "--device", device, *extra, "--json", str(out), "--plot", ""])
                    except SystemExit as exc:
                        rc = exc.code
                body = out.read_bytes() if out.exists() else err.getvalue().encode()
                got[f"{shape} {backend} {kv} {device}"] = f"rc={rc} " + hashlib.sha256(body).hexdigest()[:16]
                out.unlink(missing_ok=True)
print(json.dumps(got))
"""

LOAD = """
import json, time
t0 = time.perf_counter()
from twophase import LLM
llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}})
print(json.dumps({"load_time_s": llm.load_time_s, "import_and_load_s": time.perf_counter() - t0}))
"""

LOGIT_CASES = [("smollm2-135m-instruct", "torch", "none"), ("smollm2-135m-instruct", "onnxruntime", "none"),
               ("smollm2-135m-instruct", "native", "q4"), ("smollm2-135m-instruct", "native", "gguf"),
               ("gemma3-270m", "torch", "none"), ("gemma3-270m", "native", "gguf")]
PLAN_SHAPES = ["tiny", "smollm2-135m", "llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "phi-3-mini",
               "gemma2-9b", "gemma3-27b"]
PLAN_BACKENDS = ["torch", "onnxruntime", "native"]
PLAN_KV = ["auto", "float16", "int8"]


def python(path: Path, code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=path)
    if out.returncode:
        raise SystemExit(f"{path} {args}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plans(path: Path) -> dict[str, str]:
    """The SHA-256 of each ``twophase plan --json`` over the grid (one process, the CLI called in it)."""
    return python(path, PLANS, json.dumps([PLAN_SHAPES, PLAN_BACKENDS, PLAN_KV]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the revision before the change (e.g. HEAD~5)")
    ap.add_argument("--against", default=".", help="the other side: '.' (the working tree) or a revision")
    ap.add_argument("--loads", type=int, default=3, help="fresh processes timing the cached load, each side")
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        sides = {args.base: tree(args.base, Path(tmp)), args.against: tree(args.against, Path(tmp))}
        try:
            if not args.skip_logits:
                for case in LOGIT_CASES:
                    got = [python(p, LOGITS, *case)["sha256"] for p in sides.values()]
                    same = got[0] == got[1]
                    differ |= not same
                    print(f"logits {' '.join(case):<45} {'identical' if same else 'DIFFER'} {got[0][:16]}",
                          flush=True)
            got_plans = [plans(p) for p in sides.values()]
            bad = [k for k in got_plans[0] if got_plans[0][k] != got_plans[1].get(k)]
            differ |= bool(bad)
            print(f"plan --json: {len(got_plans[0]) - len(bad)} of {len(got_plans[0])} byte-identical"
                  + "".join(f"\n  DIFFER {k}: {got_plans[0][k]} vs {got_plans[1].get(k)}" for k in bad),
                  flush=True)
            times: dict[str, list[float]] = {k: [] for k in sides}
            python(sides[args.base], LOAD)          # the cache warm for both
            for _ in range(args.loads):
                for name, p in sides.items():
                    times[name].append(python(p, LOAD)["load_time_s"])
            print("cached default-model load, s (median): "
                  + ", ".join(f"{k}: {statistics.median(v):.2f} {sorted(round(x, 2) for x in v)}"
                              for k, v in times.items()))
        finally:
            remove_trees(sides.values())
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
