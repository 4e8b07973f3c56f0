"""Which model to load and how, as a plain value: what the loaders read (``models/loader.py``,
``plan/model_source.py``). The config's ``[model]`` section makes one (``ModelConfig.source``);
the model layer never reads the config itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelSource:
    name: str                                     # a named model, or a shape with weights = "random"
    path: str | None                              # a local HF folder or .gguf file (overrides name)
    weights: Literal["pretrained", "random"]
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    num_layers: int | None                        # a random shape's depth
    seed: int                                     # random weights
    quantization: Literal["none", "q4", "gguf"]
    accuracy_level: int                           # q4
    outlier_channels: int                         # q4
