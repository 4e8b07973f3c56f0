"""What a load refuses before any weights load or export (an export can take minutes): devices
the phases cannot share, features a backend does not compute, weights the device cannot hold, a
fixed pool too small for the request the config asks for."""

from __future__ import annotations

import torch

from twophase.backends.registry import Registry
from twophase.builder import draft
from twophase.cache.layout import PoolSettings, fixed_pool_tokens
from twophase.config import Config
from twophase.contract import ModelArch
from twophase.device import available_memory, same_device
from twophase.errors import BackendUnavailable, ConfigError, ModelError
from twophase.models import loader
from twophase.models.loader import ResolvedModel
from twophase.plan import Plan

GiB = 1 << 30


def check_devices(config: Config, registry: Registry) -> str:
    """The device both phases run on, once each backend says it can run there: the phases
    read and write one KV pool, so they must share it."""
    pcfg, dcfg = config.phases()
    split = config.backend.prefill is not None
    for key, sec in ((("backend.prefill", pcfg), ("backend.decode", dcfg)) if split else (("backend", pcfg),)):
        registry.get(sec.name, f"{key}.name").check_available(sec.device)
    if not same_device(pcfg.device, dcfg.device):
        raise ConfigError("backend.decode.device",
                          f"prefill runs on {pcfg.device!r} and decode on {dcfg.device!r}: both "
                          f"phases read and write one KV pool, so they must share a device")
    return pcfg.device


def check_features(config: Config, registry: Registry, arch: ModelArch) -> None:
    """Each phase's backend computes this architecture in that phase, or the run stops here with
    what it lacks, by name ("native: QK-norm is not implemented")."""
    q = config.model.quantization
    for phase, sec in zip(("prefill", "decode"), config.phases()):
        why = registry.get(sec.name)().supports_phase(arch, q, phase)
        if why:
            raise BackendUnavailable(f"{why}; backends that compute every feature of this "
                                     f"{arch.family} model in {phase}: "
                                     f"{', '.join(computing(registry, arch, q, phase))}")


def computing(registry: Registry, arch: ModelArch, quantization: str, phase: str = "prefill") -> list[str]:
    """The installed backends that compute every feature of ``arch`` on these weights in
    ``phase``."""
    out = []
    for name, info in sorted(registry.backends.items()):
        try:
            if info.cls is not None and info.cls().supports_phase(arch, quantization, phase) is None:
                out.append(name)
        except Exception:          # a plugin whose capabilities need a load: not listed
            continue
    return out or ["none installed"]


def check_fits(model_id: str, plan: Plan, device: str) -> None:
    """Refuse weights the device cannot hold."""
    need = plan.total("weights")
    have = available_memory(device)
    if need > 0.9 * have:
        raise ModelError(
            f"{model_id} needs {need / GiB:.1f} GiB for its weights ({plan.items[0].how}) but {device} has "
            f"{have / GiB:.1f} GiB available; choose a smaller shape, fewer layers (model.num_layers) or a "
            f"smaller dtype")


def check_fixed_pool(arch: ModelArch, settings: PoolSettings) -> None:
    """A fixed ``cache.num_blocks`` must hold the ``max_model_len`` the config asks for."""
    if settings.num_blocks is None or settings.max_model_len is None:
        return
    want = min(settings.max_model_len, arch.max_position_embeddings)
    check_request_len(want, fixed_pool_tokens(arch, settings, want), explicit=True)


def check_request_len(want: int, pool_tokens: int, explicit: bool) -> None:
    """A ``max_model_len`` the config asks for and the pool cannot hold is an error naming the
    largest that fits (a request that long could never be served)."""
    if explicit and pool_tokens < want:
        raise ConfigError("model.max_model_len", f"{want} tokens, but the KV pool holds {pool_tokens}: a request "
                          f"that long could never be served; set it to {pool_tokens} at most, or give the "
                          f"pool more (cache.num_blocks, cache.memory_gb)")


def check_pool_memory(num_blocks: int, total: int, device: str) -> None:
    """The pool must leave the device some memory."""
    free = available_memory(device)
    if total > 0.9 * free:
        raise ModelError(f"the KV pool of {num_blocks} blocks needs {total / GiB:.2f} GiB but "
                         f"{device} has {free / GiB:.2f} GiB free; lower cache.num_blocks or "
                         f"cache.memory_gb")


def on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def check_draft(config: Config, target: ResolvedModel) -> Config | None:
    """The draft model's config (``method = "draft"``), its vocabulary checked against the
    target's before either loads its weights."""
    if config.speculative.method != "draft":
        return None
    cfg = draft.draft_config(config)
    try:
        resolved = loader.resolve(cfg.model.source(), cfg.phases()[0].device)
    except ConfigError as exc:
        raise draft.rekeyed(exc) from None
    draft.check_vocabulary(target, resolved)
    return cfg
