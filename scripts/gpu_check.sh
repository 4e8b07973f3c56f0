#!/usr/bin/env bash
# One call on a CUDA machine: install the project (no registry needed), run the GPU tests, and
# time prefill/decode of a large random-weight shape with the torch backend. Prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install --no-deps --no-build-isolation -e . -q
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
python benchmarks/phase_sweep.py --shape "${SHAPE:-llama3-8b}" --device cuda --dtype bfloat16 \
    --prompt-lens 128,512,2048 --batch-sizes 1,8,32,64 --context 512 --kv-gb 16
