#!/usr/bin/env bash
# Run here, where the package registry is reachable: fetch the wheels scripts/gpu_check.sh needs
# on a CUDA machine that has torch and nothing else (and no registry) into shared-wheels/
# (ignored by git; carry it to that machine). Binary wheels are for this Python unless
# GPU_PYTHONS names others ("3.10 3.12"). Transformers, tokenizers and gguf are left out (over
# 20 MB together): the tests that need them skip.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEELS:-shared-wheels}
# the project's imports, pytest's, hypothesis's and rich's, and setuptools for the editable install
PKGS=(numpy pluggy tqdm rich markdown-it-py mdurl pygments safetensors jinja2 markupsafe
      pytest iniconfig packaging hypothesis attrs sortedcontainers setuptools)
mkdir -p "$DEST"
pip download -q --only-binary=:all: --no-deps --dest "$DEST" "${PKGS[@]}"
for v in ${GPU_PYTHONS:-}; do
    pip download -q --only-binary=:all: --no-deps --dest "$DEST" --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        numpy safetensors markupsafe
done
du -sh "$DEST"
