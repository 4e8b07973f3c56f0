"""Loading the backends: one for both phases where they agree, a second where they differ, and
those ``auto`` routes small decode batches to; each refused by name, before its load, where it
does not run the weights or read the K/V format asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twophase.backends.registry import Registry
from twophase.builder.routing import Routing, name_of, section
from twophase.config import BackendSection, Config
from twophase.contract import Backend, BackendConfig, EngineLimits, ModelArch, ModelSpec
from twophase.errors import ConfigError
from twophase.kv_formats import kv_format


@dataclass
class Backends:
    """The loaded backends: the phases', and those ``auto`` routes decode batches of at most
    ``largest`` sequences to."""

    prefill: Backend
    decode: Backend
    routes: list[tuple[int, Backend]]

    def distinct(self) -> list[Backend]:
        """Each loaded backend once."""
        every = (self.prefill, self.decode, *(b for _, b in self.routes))
        return list({id(b): b for b in every}.values())

    def decoders(self) -> list[Backend]:
        """The decode backend and the routed ones (which read the same pool)."""
        return [self.decode, *(b for _, b in self.routes)]


def one_backend(pcfg: BackendSection, dcfg: BackendSection) -> bool:
    """Whether the phases name one backend, device and options: then one instance runs both."""
    return (pcfg.name, pcfg.device, pcfg.options) == (dcfg.name, dcfg.device, dcfg.options)


def load_backends(config: Config, registry: Registry, arch: ModelArch, spec: ModelSpec, limits: EngineLimits,
                  routing: Routing | None) -> Backends:
    """The prefill and decode backends (one instance where the phases agree) and the routed ones."""
    pcfg, dcfg = config.phases()
    prefill = load_backend(config, registry, arch, pcfg, spec, limits)
    same = one_backend(pcfg, dcfg)
    decode = prefill if same else load_backend(config, registry, arch, dcfg, spec, limits)
    if not same:
        check_pool_sharing(prefill, decode, pcfg, dcfg)
    routes: list[tuple[int, Backend]] = []
    if routing is not None and routing.routes:
        loaded = {name_of(pcfg): prefill, name_of(dcfg): decode}
        for largest, name in routing.routes:
            if name not in loaded:
                sec = section(name, dcfg.device, dcfg.options)
                loaded[name] = load_backend(config, registry, arch, sec, spec, limits)
                check_pool_sharing(prefill, loaded[name], pcfg, sec)
            routes.append((largest, loaded[name]))
    return Backends(prefill, decode, routes)


def load_backend(config: Config, registry: Registry, arch: ModelArch, sec: BackendSection, spec: ModelSpec,
                 limits: EngineLimits) -> Backend:
    backend = registry.get(sec.name)()
    if spec.quantization not in backend.quantizations:
        runs = [n for n, i in registry.backends.items()
                if i.cls is not None and spec.quantization in i.cls.quantizations]
        raise ConfigError("model.quantization", f"the {sec.name} backend does not run {spec.quantization!r} "
                          f"weights; backends that do: {', '.join(runs) or 'none installed'}")
    check_kv_format(config.cache.dtype, arch, backend, spec.dtype)
    backend.load(spec, BackendConfig(sec.name, sec.device, dict(sec.options), limits))
    return backend


def check_kv_format(name: str, arch: ModelArch, backend: Backend, native: torch.dtype) -> None:
    """Refuse, before ``backend`` loads and naming it, a K/V format (``cache.dtype``) it does not read."""
    if name == "auto":
        return
    fmt = kv_format(name)
    try:
        fmt.check(arch.mla.latent_dim if arch.mla else arch.head_dim)
    except ValueError as exc:
        why = str(exc)
        if arch.mla:                 # the cache's row is the latent, not a head
            m = arch.mla
            why = why.replace(f"head_dim is {m.latent_dim}", f"latent is {m.latent_dim} values a token "
                              f"(kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim})")
        raise ConfigError("cache.dtype", why) from None
    reads = backend.capabilities().kv_formats
    if fmt.storage != native and name not in reads:
        names = dict.fromkeys([str(native).removeprefix("torch."), *reads])
        raise ConfigError("cache.dtype", f"the {backend.name} backend reads K/V in {', '.join(names)}, not {name}")


def check_pool_sharing(prefill: Backend, decode: Backend, pcfg: BackendSection, dcfg: BackendSection) -> None:
    """Two backends over one pool must both write it in place, in one K/V dtype."""
    for key, b, sec in (("backend.prefill", prefill, pcfg), ("backend.decode", decode, dcfg)):
        if not b.capabilities().shares_kv_pool:
            raise ConfigError(f"{key}.name", f"the {sec.name} backend keeps its own KV pool, "
                              f"so it cannot share the phases with another backend")
    ps, ds = prefill.kv_cache_spec(), decode.kv_cache_spec()
    if ps.dtype != ds.dtype:
        raise ConfigError("backend.decode.name", f"prefill ({pcfg.name}) keeps K/V in {ps.dtype} and decode "
                          f"({dcfg.name}) in {ds.dtype}: the phases share one pool, so they must agree")
