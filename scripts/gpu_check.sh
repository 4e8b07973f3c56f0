#!/usr/bin/env bash
# One call on a CUDA machine: install the project (no registry needed), run the GPU tests, then
# `twophase bench` on a Llama-3-8B shape (random bf16 weights) with the torch backend and the HF
# reference, which prints the phase tables against the calibrated roofline.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install --no-deps --no-build-isolation -e . -q
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -m pytest -q -m gpu tests/test_gpu.py tests/test_onnxruntime.py tests/test_tensorrt.py \
    -p no:cacheprovider
python -m twophase calibrate --device cuda --dtype bfloat16
python -m twophase bench examples/bench_gpu.toml --out "${OUT:-gpu-bench}" --compare-chunked
