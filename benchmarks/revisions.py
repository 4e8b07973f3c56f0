"""The native backend's phases at two revisions of the source tree, rounds interleaved.

A kernel change is measured against the code before it on the same machine in one run: each
revision is checked out once (``git worktree``, under a temporary folder), and every round runs
each in a fresh process (its own compiled kernel, keyed by its source), alternating, so drift on a
busy machine hits both alike. Figures: tokens/s of a 512-token prefill and of decode steps at
batch 1 and 32 (context 128) on the default model (its q4 blocks, or float32 with
``--quantization none``); medians over rounds.

    python benchmarks/revisions.py HEAD~1 [--against WORKTREE_OR_REV] [--rounds 3] [--backend native]
                                          [--quantization q4|none] [--threads N]
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

ROOT = Path(__file__).resolve().parents[1]
ROUND = """
import json, sys
from twophase import LLM
from twophase.measure.phase_timing import decode_round, prefill_round
backend = {"name": sys.argv[1]}
if len(sys.argv) > 3:
    backend["options"] = {"threads": int(sys.argv[3])}
llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct", "quantization": sys.argv[2]},
                       "backend": backend,
                       "scheduler": {"policy": "prefill-first", "max_num_batched_tokens": 512,
                                     "max_num_seqs": 32}, "cache": {"num_blocks": 1024}})
prefill_round(llm, 512, 0, 99)                       # warm: the kernel, the pages
print(json.dumps({"pp512": 512 / prefill_round(llm, 512, 0, 0),
                  "tg b1": 1 / decode_round(llm, 1, 128, 16, 0),
                  "tg b32": 32 / decode_round(llm, 32, 128, 8, 0)}))
"""


# each round checks that it ran the revision's own package
PROVENANCE = """
import twophase
print(json.dumps({"package": twophase.__file__}), file=sys.stderr)
"""


def tree(rev: str, tmp: Path) -> Path:
    """A checkout of ``rev`` (the working tree itself for ``.``)."""
    if rev == ".":
        return ROOT
    path = tmp / rev.replace("/", "_").replace("~", "-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)
    return path


def remove_trees(paths) -> None:
    """The checkouts ``tree`` made (never the working tree itself)."""
    for path in paths:
        if path != ROOT:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)


def one_round(path: Path, backend: str, quantization: str, threads: int | None = None) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    # run in the checkout: ``python -c`` puts the working directory first on sys.path, so run
    # from the repository root both sides had imported the working tree's package
    args = [backend, quantization] + ([str(threads)] if threads else [])
    out = subprocess.run([sys.executable, "-c", ROUND + PROVENANCE, *args], env=env, capture_output=True,
                         text=True, cwd=path)
    if out.returncode:
        raise SystemExit(f"{path}: {out.stderr[-2000:]}")
    line = next(x for x in reversed(out.stderr.splitlines()) if x.startswith('{"package"'))
    package = Path(json.loads(line)["package"]).resolve()
    if not package.is_relative_to(path.resolve()):
        raise SystemExit(f"{path}: the round imported twophase from {package}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the revision to compare against (e.g. HEAD~1)")
    ap.add_argument("--against", default=".", help="the other side: '.' (the working tree) or a revision")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="native")
    ap.add_argument("--quantization", default="q4", choices=("q4", "none"))
    ap.add_argument("--threads", type=int, help="the backend's threads option (default: its own)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {args.base: tree(args.base, Path(tmp)), args.against: tree(args.against, Path(tmp))}
        try:
            got: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
            for r in range(args.rounds):
                for name, path in sides.items():
                    got[name].append(one_round(path, args.backend, args.quantization, args.threads))
                    print(f"round {r + 1}: {name}: {got[name][-1]}", file=sys.stderr)
        finally:
            remove_trees(sides.values())
    cases = list(next(iter(got.values()))[0])
    print(f"{'tok/s (median)':<16}" + "".join(f"{k:>16}" for k in sides) + f"{'ratio':>8}")
    for case in cases:
        med = [statistics.median(x[case] for x in got[k]) for k in sides]
        print(f"{case:<16}" + "".join(f"{m:>16,.1f}" for m in med) + f"{med[1] / med[0]:>8.2f}")


if __name__ == "__main__":
    main()
