"""Command-line overrides of a config: the flags that let a first run go without a TOML file
(``twophase run --model tiny --prompt "Hello"``), and override one key of a TOML that exists."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from twophase.config import Config, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def add(parser: argparse.ArgumentParser, prompts: bool = True) -> None:
    """The config argument (optional) and the override flags."""
    parser.add_argument("config", nargs="?", help="TOML file (optional: every key has a default)")
    g = parser.add_argument_group("overrides (over the config's keys)")
    g.add_argument("--model", help="a named model, a shape with random weights (e.g. tiny), or "
                                   "a .gguf file / HF folder")
    g.add_argument("--backend", help="one backend for both phases (torch, onnxruntime, ...)")
    g.add_argument("--quantization", choices=["none", "q4", "gguf"], help="model.quantization")
    g.add_argument("--threads", type=int, help="the backend's threads (backend.options.threads)")
    g.add_argument("--max-tokens", type=int, help="sampling.max_tokens")
    g.add_argument("--lora", action="append", type=_adapter, metavar="NAME=PATH",
                   help="a PEFT adapter to serve beside the model (repeat for several); joins [[lora]]")
    if prompts:
        g.add_argument("--prompt", action="append", metavar="TEXT",
                       help="a prompt (repeat for several); replaces the workload")
        g.add_argument("--raw", action="store_true",
                       help="send prompts as written, without the model's chat template "
                            "(completion style: \"The capital of France is\"); workload.chat = false")


def _adapter(text: str) -> tuple[str, str]:
    """``--lora NAME=PATH``."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a name, then a PEFT adapter folder), got {text!r}")
    return name.strip(), path.strip()


def load(args: argparse.Namespace) -> Config:
    """The config file (or the defaults) with the flags over it."""
    data: dict[str, Any] = {}
    if args.config and Path(args.config).is_file():
        try:
            data = tomllib.loads(Path(args.config).read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError):
            data = {}                        # load_config reports it, naming the file
    o = overrides(args, data)
    return load_config(args.config, o) if args.config else load_config(None, o)


def overrides(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """The flags given, as a dict of the config's shape."""
    o: dict[str, Any] = {}
    if args.model:
        o["model"] = model_keys(args.model)
    if args.quantization:
        o.setdefault("model", {})["quantization"] = args.quantization
    if args.backend:
        o["backend"] = {"name": args.backend, "prefill": None, "decode": None}
    if args.threads is not None:
        backend = o.get("backend") or data.get("backend") or {}
        phases = [k for k in ("prefill", "decode") if k in backend and not o.get("backend")]
        threads = {"options": {"threads": args.threads}}
        o["backend"] = {**o.get("backend", {}), **({k: threads for k in phases} or threads)}
    if args.max_tokens is not None:
        o["sampling"] = {"max_tokens": args.max_tokens}
    if getattr(args, "lora", None):
        o["lora"] = list(data.get("lora") or []) + [{"name": n, "path": p} for n, p in args.lora]
    for flag in ("replicas", "prefill_workers", "decode_workers"):
        if getattr(args, flag, None) is not None:
            o.setdefault("cluster", {})[flag] = getattr(args, flag)
    if getattr(args, "prompt", None):
        o["workload"] = {"prompts": args.prompt, "jsonl": None, "synthetic": None}
    if getattr(args, "raw", False):
        o.setdefault("workload", {})["chat"] = False
    return o


def model_keys(model: str) -> dict[str, Any]:
    """``--model``: a path if one exists there or it reads as one (``/``, ``./``, ``~``, a
    ``.gguf``: then a missing one is reported as the API reports ``model.path``), a shape with
    random weights if it names only a shape, else a named model."""
    from twophase.models.hf_repo import is_repo_name
    from twophase.models.hub import PYPI_MODELS
    from twophase.models.shapes import SHAPES

    reads_as_path = model.startswith(("/", ".", "~")) or model.endswith(".gguf") or (
        "/" in model and not is_repo_name(model))
    if Path(model).expanduser().exists() or reads_as_path:
        return {"path": model, "name": None, "weights": None, "num_layers": None}
    random = model in SHAPES and model not in PYPI_MODELS
    return {"name": model, "path": None, "weights": "random" if random else None}


def on_device(cfg: Config, device: str) -> Config:
    """The config with every backend section on ``device``."""
    import dataclasses

    b = cfg.backend
    phases = {k: dataclasses.replace(getattr(b, k), device=device) for k in ("prefill", "decode")
              if getattr(b, k) is not None}
    return dataclasses.replace(cfg, backend=dataclasses.replace(b, device=device, **phases))
