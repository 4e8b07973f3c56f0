"""The adapters an engine serves: a ``LoraManager`` over the loaded backends, with the
``[[lora]]`` adapters of the config known (and each read and checked at start, so a bad one
fails the start, not its first request)."""

from __future__ import annotations

from pathlib import Path

from twophase.arch import ModelArch
from twophase.builder.backends import Backends
from twophase.config import Config
from twophase.errors import ConfigError
from twophase.lora.manager import LoraManager
from twophase.lora.peft_adapter import AdapterError, LoraAdapter, load_peft_adapter
from twophase.models.families import FAMILIES


def adapter_manager(config: Config, backends: Backends, arch: ModelArch) -> LoraManager | None:
    """None where a loaded backend does not apply adapters (and the config names none)."""
    every = backends.distinct()
    refusing = [b.name for b in every if not b.capabilities().adapters]
    if refusing:
        if config.lora:
            raise ConfigError("lora", f"the {refusing[0]} backend does not apply LoRA adapters; "
                                      "serve them with backend torch in both phases")
        return None
    model = backends.prefill.model                   # what adapters are checked against
    names = FAMILIES[arch.family].layer_names

    def loader(name: str, path: Path) -> LoraAdapter:
        return load_peft_adapter(name, path, model, names)

    def placer(slot: int, adapter: LoraAdapter | None) -> None:
        for b in every:
            b.place_adapter(slot, adapter)

    manager = LoraManager(loader, placer, config.model.max_loras)
    for i, a in enumerate(config.lora):
        try:
            manager.register(a.name, config.resolve(a.path), load_now=i < config.model.max_loras)
        except AdapterError as exc:
            raise ConfigError(f"lora[{i}]", str(exc)) from None
    return manager
