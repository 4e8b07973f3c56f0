#!/usr/bin/env bash
# The GPU check: one run on a CUDA machine that has torch (with CUDA) and no package registry,
# in stages, each under `timeout`, each writing its log and figures to the output folder.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--budget-s N] [--out DIR] [--dry-run]
#
#   --wheels DIR  install what is missing from DIR (pip --no-index --find-links DIR); make DIR
#                 where the registry is reachable with scripts/gpu_wheels.sh --python-version
#                 <that machine's Python> and carry it over (shared-wheels/ is ignored by git)
#   --budget-s N  seconds for the whole run (default 540): a stage that cannot fit in what is
#                 left is skipped with a line saying so; each runs under `timeout`
#   --out DIR     where the logs and figures go (default $OUT if set, else ./gpu-check-out)
#   --dry-run     the whole script on the CPU at small shapes (no CUDA needed): its own
#                 mistakes show before a GPU is lent; its figures mean nothing
#
# Stages, in order:
#   env     the Python imports the checks need (torch with CUDA, numpy, pluggy, rich, tqdm,
#           safetensors, tokenizers, transformers, pytest, hypothesis) and the project from this
#           tree; stops listing what is missing and how to provide it
#   greedy  llama3-1b's shape in bf16 on torch/CUDA, CUDA graphs on and off, against the CPU's
#           float32 reference, up to near-ties (scripts/gpu_bench.py greedy)
#   bench   llama3-8b's shape in bf16: prefill 512 / 2k, decode batch 1/8/32/64, graphs on and
#           off, buckets warmed before timing, medians, roofline fractions (gpu_bench.py bench)
#   memory  the memory plan against what the engine measured, a fixed pool and an automatic one
#   tests   the GPU-marked tests: CUDA graphs, CUDA against the CPU, every model family on CUDA,
#           the plan on a GPU; TensorRT's and onnxruntime-gpu's skip, saying why
# Exit status: 0 every stage passed, 1 one failed or ran out of time, 2 the environment lacks
# something, 3 none failed but one was skipped for the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEELS="" BUDGET=540 OUTDIR=${OUT:-} DRY=0
while [ $# -gt 0 ]; do
    case $1 in
        --wheels) WHEELS=$2; shift 2 ;;
        --budget-s) BUDGET=$2; shift 2 ;;
        --out) OUTDIR=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $BUDGET in ''|*[!0-9]*) echo "gpu_check: --budget-s takes whole seconds, not '$BUDGET'" >&2; exit 2 ;; esac
[ -n "$OUTDIR" ] || OUTDIR=$REPO/gpu-check-out
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || { echo "gpu_check: cannot write $OUTDIR" >&2; exit 2; }
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || { echo "gpu_check: --wheels $WHEELS is not a folder" >&2; exit 2; }
    WHEELS=$(cd "$WHEELS" && pwd)
fi
PY=${PYTHON:-$(command -v python || command -v python3)}
[ -n "$PY" ] || { echo "gpu_check: no python or python3 on PATH" >&2; exit 2; }
# what pip installs where the environment refuses it, and the project's metadata if it is not
# installed (its backends are entry points): on PYTHONPATH after the tree
SITE=${TMPDIR:-/tmp}/twophase-gpu-check-site-$$
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
MODE=$([ $DRY = 1 ] && echo "dry run on the CPU" || echo "GPU")
SUMMARY=()

say() { echo "gpu_check: $*" | tee -a "$OUTDIR/summary.txt"; }
: > "$OUTDIR/summary.txt"

finish() {                # the summary, as text and JSON, then the exit status
    local rc=$1 line name status code secs first=1
    {
        printf '{"mode": "%s", "budget_s": %s, "elapsed_s": %s, "exit": %s, "stages": [' "$MODE" "$BUDGET" "$SECONDS" "$rc"
        for line in "${SUMMARY[@]}"; do
            read -r name status code secs <<<"$line"
            [ $first = 1 ] || printf ', '
            first=0
            printf '{"stage": "%s", "status": "%s", "rc": %s, "seconds": %s}' "$name" "$status" "$code" "$secs"
        done
        printf ']}\n'
    } > "$OUTDIR/summary.json"
    say "done in ${SECONDS}s (exit $rc): $(printf '%s; ' "${SUMMARY[@]}")figures in $OUTDIR"
    rm -rf "$SITE"
    exit "$rc"
}

# -- env ----------------------------------------------------------------------------------------
# module -> what provides it (pip's name); torch is the machine's own
MODULES="numpy:numpy pluggy:pluggy rich:rich tqdm:tqdm safetensors:safetensors tokenizers:tokenizers
transformers:transformers jinja2:jinja2 filelock:filelock pytest:pytest hypothesis:hypothesis"
missing() {               # the pip names of the modules that do not import
    "$PY" - "$MODULES" <<'EOF'
import importlib, sys
out = []
for pair in sys.argv[1].split():
    module, package = pair.split(":")
    try:
        importlib.import_module(module)
    except Exception:
        out.append(package)
print(" ".join(out))
EOF
}

project_metadata() {      # the project's entry points (its backends), for a tree not pip-installed
    mkdir -p "$SITE" && "$PY" - "$REPO/pyproject.toml" "$SITE" <<'EOF'
import pathlib, re, sys
text = pathlib.Path(sys.argv[1]).read_text()
version = re.search(r'(?m)^version = "([^"]+)"', text).group(1)
sections = []
for section, group in (('project.entry-points."twophase.backends"', "twophase.backends"),
                       ("project.scripts", "console_scripts")):
    body = text.split(f"[{section}]", 1)[1].split("\n[", 1)[0]
    pairs = re.findall(r'(?m)^(\w+) = "([^"]+)"', body)
    sections.append(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in pairs))
info = pathlib.Path(sys.argv[2]) / f"twophase-{version}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: twophase\nVersion: {version}\n")
(info / "entry_points.txt").write_text("\n".join(sections))
EOF
}

project_ok() {            # the tree's package imports, and its backends are discovered
    "$PY" - "$REPO" <<'EOF'
import os, sys
import twophase
from twophase.backends.registry import Registry
here = os.path.dirname(os.path.abspath(twophase.__file__))
if here != os.path.join(sys.argv[1], "twophase"):
    sys.exit(f"twophase imports from {here}, not from this tree")
names = sorted(Registry().backends)
if "torch" not in names:
    sys.exit(f"the backends' entry points are not found (backends: {names or 'none'})")
print(f"twophase from {here}; backends: {', '.join(names)}")
EOF
}

env_stage() {
    echo "== env: $MODE; $("$PY" -c 'import sys; print("Python", sys.version.split()[0])' 2>&1) at $PY"
    if [ $DRY = 0 ]; then
        if command -v nvidia-smi >/dev/null; then
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        else
            echo "nvidia-smi is not on PATH (torch's view of the GPU follows)"
        fi
    fi
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "torch does not import: install the machine's CUDA build of torch first (not from the wheels)"
        return 2
    fi
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())'
    if [ $DRY = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
        echo "torch sees no CUDA device (a CPU build of torch, or no driver): run --dry-run here, or on a CUDA machine"
        return 2
    fi
    local need
    need=$(missing)
    if [ -n "$need" ] && [ -n "$WHEELS" ]; then
        echo "installing from $WHEELS: $need"
        # where the environment takes them; else (no permission, an externally managed Python)
        # into a folder of their own on PYTHONPATH
        # shellcheck disable=SC2086
        if [ "${GPU_CHECK_PIP_TARGET:-0}" = 1 ] || ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" $need; then
            echo "installing into $SITE instead"
            # shellcheck disable=SC2086
            "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$SITE" $need
        fi
        need=$(missing)
    fi
    if ! project_ok >/dev/null 2>&1; then
        echo "the project is not installed: its metadata (the backends' entry points) goes in $SITE"
        project_metadata
    fi
    local project prc
    project=$(project_ok 2>&1)
    prc=$?
    if [ -n "$need" ] || [ $prc != 0 ]; then
        [ -z "$need" ] || echo "missing Python packages: $need"
        [ $prc = 0 ] || echo "the project: $(echo "$project" | tail -1)"
        if [ -n "$need" ]; then
            local v
            v=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
            echo "provide them: where the package registry is reachable, run"
            echo "    bash scripts/gpu_wheels.sh --python-version $v --dest shared-wheels"
            echo "carry shared-wheels/ here (it is ignored by git) and run"
            echo "    bash scripts/gpu_check.sh --wheels shared-wheels"
        fi
        return 2
    fi
    echo "$project"
    "$PY" -c 'import numpy, transformers, pytest; print("numpy", numpy.__version__, "transformers", transformers.__version__, "pytest", pytest.__version__)'
}

run_stage() {             # run_stage NAME ESTIMATE_S CAP_S COMMAND...: skipped unless the budget fits it
    local name=$1 est=$2 cap=$3
    shift 3
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt "$est" ]; then
        say "skip $name: it needs about ${est}s and ${left}s of the ${BUDGET}s budget are left"
        SUMMARY+=("$name skipped 0 0")
        return
    fi
    local limit=$((cap < left ? cap : left)) start=$SECONDS
    say "$name: up to ${limit}s (${left}s of the budget left)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]} status=passed
    case $rc in
        0) ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    say "$name: $status (exit $rc) in $((SECONDS - start))s"
    SUMMARY+=("$name $status $rc $((SECONDS - start))")
}

env_stage > >(tee "$OUTDIR/env.log") 2>&1     # in this shell: its PYTHONPATH holds for the stages
rc=$?
wait $! 2>/dev/null || true
SUMMARY+=("env $([ "$rc" = 0 ] && echo passed || echo failed) $rc $SECONDS")
if [ "$rc" != 0 ]; then
    say "env: the checks cannot run here (see above)"
    finish 2
fi

D=$([ $DRY = 1 ] && echo --dry-run)
if [ $DRY = 1 ]; then G=(30 150) B=(20 150) M=(20 120) T=(30 180); else G=(90 180) B=(150 300) M=(60 150) T=(120 240); fi
# shellcheck disable=SC2086
run_stage greedy "${G[@]}" "$PY" scripts/gpu_bench.py greedy --out "$OUTDIR" $D
# shellcheck disable=SC2086
run_stage bench "${B[@]}" "$PY" scripts/gpu_bench.py bench --out "$OUTDIR" $D
# shellcheck disable=SC2086
run_stage memory "${M[@]}" "$PY" scripts/gpu_bench.py memory --out "$OUTDIR" $D
run_stage tests "${T[@]}" "$PY" -m pytest -q -o addopts="" -p no:cacheprovider -rs -m gpu \
    tests/backends/test_gpu.py tests/test_plan.py tests/backends/test_tensorrt.py \
    tests/backends/test_onnxruntime.py --junitxml="$OUTDIR/tests.xml"

rc=0
for line in "${SUMMARY[@]}"; do
    case $line in
        *" failed "*|*" timeout "*) rc=1 ;;
        *" skipped "*) [ $rc = 0 ] && rc=3 ;;
    esac
done
finish $rc
