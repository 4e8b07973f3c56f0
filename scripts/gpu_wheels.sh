#!/usr/bin/env bash
# Run where the package registry is reachable: download the wheels scripts/gpu_check.sh needs
# on a CUDA machine that has torch and no registry, for that machine's Python (not this one's:
# compiled wheels are per Python version), with everything they depend on.
#
#   scripts/gpu_wheels.sh [--python-version 3.12] [--dest shared-wheels]
#
# Then carry the folder to that machine (shared-wheels/ is ignored by git, so copy it there, or
# name it in what travels with the tree) and run
#   bash scripts/gpu_check.sh --wheels shared-wheels
# The list: what the engine imports (numpy, pluggy, rich, tqdm, safetensors, tokenizers,
# filelock), what the tests import (pytest, hypothesis) and transformers, the families' reference
# (with huggingface_hub, regex, pyyaml, requests, ...). torch is the machine's own; onnxruntime,
# onnx and TensorRT are left out (their tests skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
DEST=shared-wheels
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) PYV=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "gpu_wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
PKGS=(numpy pluggy rich tqdm safetensors tokenizers filelock jinja2 pytest hypothesis transformers
      huggingface_hub)
mkdir -p "$DEST"
# --only-binary: nothing to build there; the platforms: x86-64 Linux wheels as PyPI tags them
pip download -q --only-binary=:all: --dest "$DEST" --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 "${PKGS[@]}"
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels for Python $PYV in $DEST ($(du -sh "$DEST" | cut -f1))"
