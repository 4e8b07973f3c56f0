"""Where twophase keeps what it builds and fetches: ``$TWOPHASE_CACHE`` (default
``~/.cache/twophase``), one folder per kind (models, gguf, onnx, mlir, tensorrt, native,
calibration)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TWOPHASE_CACHE") or os.path.join(Path.home(), ".cache", "twophase")
    return Path(root)
