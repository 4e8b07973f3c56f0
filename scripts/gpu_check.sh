#!/usr/bin/env bash
# One call on a CUDA machine with torch and nothing else, and no package registry: install what
# the GPU tests need from shared-wheels/ (made beforehand by scripts/gpu_wheels.sh; a wheel that
# is absent or does not fit this Python is skipped, and the tests needing it skip), the project
# itself without build isolation, run the GPU-marked tests, then a short bf16 llama3-8b bench
# (random weights, torch backend) that prints one table of prefill and decode figures.
# --install-only: the install step alone, then the imports checked (works without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
INSTALL_ONLY=$([ "${1:-}" = "--install-only" ] && echo 1 || echo 0)
if [ "$INSTALL_ONLY" = 0 ] && { ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; }; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or fails): run it on a CUDA machine" >&2
    exit 2
fi
if [ "$INSTALL_ONLY" = 0 ] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: torch is missing or sees no CUDA device" >&2
    exit 2
fi
WHEELS=${WHEELS:-shared-wheels}
PKGS=(setuptools numpy pluggy tqdm pygments mdurl markdown-it-py rich safetensors markupsafe jinja2
      packaging iniconfig pytest attrs sortedcontainers hypothesis)
for p in "${PKGS[@]}"; do     # by name: one already installed (torch's numpy) is kept as it is
    pip install -q --no-index --find-links "$WHEELS" --no-deps "$p" 2>/dev/null || echo "gpu_check: $p not installed"
done
if ! pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null; then
    echo "gpu_check: could not install the project (no setuptools?): its backends' entry points are missing" >&2
    exit 2
fi
if [ "$INSTALL_ONLY" = 1 ]; then
    exec python -c "import twophase.llm, pluggy, rich, numpy, pytest, hypothesis; print('gpu_check: installed')"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q -m gpu tests/backends tests/test_plan.py -p no:cacheprovider
status=$?
python scripts/gpu_bench.py || status=1
exit $status
