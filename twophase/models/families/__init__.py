"""The model families that load, by HF ``model_type`` and GGUF ``general.architecture``.

A new family is one file beside these (its config reading and weight names) and one line here.
"""

from __future__ import annotations

import json
from pathlib import Path

from twophase.arch import ModelArch
from twophase.errors import ModelError
from twophase.models.families import (
    deepseek,
    gemma,
    gpt_oss,
    granite,
    lfm2,
    llama,
    mistral,
    moe,
    phi3,
    qwen2,
    qwen3,
    qwen3_next,
)
from twophase.models.families.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, phi3.FAMILY, gemma.GEMMA2, gemma.GEMMA3,
    moe.MIXTRAL, moe.QWEN3_MOE, qwen3_next.QWEN3_NEXT, qwen3_next.QWEN3_5, lfm2.FAMILY, granite.FAMILY,
    gpt_oss.FAMILY, deepseek.DEEPSEEK_V2, deepseek.DEEPSEEK_V3)}


def _known() -> str:
    return ", ".join(sorted({t for f in FAMILIES.values() for t in (*f.hf_model_types, f.hf_multimodal_type) if t}))


def by_model_type(model_type: str | None, where: str) -> Family:
    """The family of an HF ``config.json``'s ``model_type`` (a missing one reads as Llama)."""
    for f in FAMILIES.values():
        if (model_type or "llama") in f.hf_model_types or (model_type and model_type == f.hf_multimodal_type):
            return f
    raise ModelError(f"{where}: model_type {model_type!r} is not supported; the families that "
                     f"load: {_known()}")


def by_gguf_architecture(name: str | None, where: str, experts: bool = False) -> Family:
    """The family of a GGUF's ``general.architecture``; where two share it (Llama and Mixtral
    both write ``llama``), ``experts`` (the header states ``{arch}.expert_count``) picks."""
    found = [f for f in FAMILIES.values() if name in f.gguf_architectures]
    if found:
        return next((f for f in found if f.gguf_experts == experts), found[0])
    known = ", ".join(sorted({a for f in FAMILIES.values() for a in f.gguf_architectures}))
    raise ModelError(f"{where}: GGUF architecture {name!r} is not supported; the architectures "
                     f"that load: {known}")


def read_config(path: Path) -> ModelArch:
    """The architecture an HF ``config.json`` describes; a file that is not one, or that lacks
    what its family reads, is a ``ModelError`` naming the file and the key."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: not a config.json (a JSON object)")
    return arch_from_config(config, str(path))


def arch_from_config(config: dict, where: str) -> ModelArch:
    fam = by_model_type(config.get("model_type"), where)
    try:
        if config.get("model_type") == fam.hf_multimodal_type:
            # the text model's keys; the head tied as the multimodal model ties it (its own key)
            config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
        return fam.arch_from_hf(config)
    except KeyError as exc:
        raise ModelError(f"{where}: a {fam.name} config needs {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{where}: a {fam.name} config with a value of the wrong kind ({exc})") from None


def family(name: str) -> Family:
    """The family that made an arch (``ModelArch.family``)."""
    return FAMILIES[name]
