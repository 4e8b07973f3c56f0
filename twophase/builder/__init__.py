"""Loading a config into an engine, as its stages: route the backends, resolve the model, check
what the backends compute, plan the memory, load the backends, lay out and bind the pool, build
the engine. Each stage takes its inputs as arguments and returns values; ``LLM`` is the facade
over what ``load`` returns."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from twophase.backends.registry import Registry
from twophase.builder import routing
from twophase.builder.backends import Backends, load_backends, one_backend
from twophase.builder.checks import check_devices, check_draft, check_features, check_fits, check_fixed_pool
from twophase.builder.memory import checked_plan, held_memory, log_memory
from twophase.builder.pool import allocate, fit_context, lay_out
from twophase.builder.stage_times import StageTimes, load_line
from twophase.cache.layout import PoolLayout, PoolSettings, model_len, token_budget
from twophase.config import Config
from twophase.contract import EngineLimits, KVCache, ModelSpec
from twophase.device import available_memory, return_freed_memory
from twophase.kv_formats import kv_format, kv_format_of
from twophase.models import loader
from twophase.models.loader import ResolvedModel
from twophase.plan import DeviceProfile, Plan, pool_settings
from twophase.plan import check as memcheck
from twophase.plan import plan as memory_plan
from twophase.plan.model_source import planned_model

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """What a load made: everything an engine is built over."""

    config: Config                      # the config, ``auto`` backends named
    routing: routing.Routing | None     # how ``auto`` routed the phases (None: named in the config)
    device: str
    model: ResolvedModel
    spec: ModelSpec
    plan: Plan
    backends: Backends
    settings: PoolSettings              # what the config asked of the pool
    layout: PoolLayout
    kv_cache: KVCache
    draft_config: Config | None         # the draft model's (``method = "draft"``), checked
    memory: dict[str, Any] = field(default_factory=dict)
    load_time_s: float = 0.0
    load_breakdown_s: dict[str, float] = field(default_factory=dict)


def load(config: Config, registry: Registry, make_engine=None) -> Loaded:
    """``config`` loaded: backends with their weights, and the pool bound to them.
    ``make_engine``: what ``auto`` times the backends with when it has no table."""
    t0, lap = time.perf_counter(), StageTimes()
    route = None
    if routing.wanted(config):                # [backend] name = "auto": measured, or cached
        config, route = route_backends(config, registry, make_engine)
        lap("backend auto")
    device = check_devices(config, registry)
    source = config.model.source()            # built once a load: the model and its spec read it
    model = loader.resolve(source, device)
    check_features(config, registry, model.arch)
    lap("model files")
    draft_config = check_draft(config, model)     # a bad draft refused before any weights load
    plan = plan_memory(config, registry, device, route)
    lap("memory plan")
    check_fits(model.model_id, plan, device)
    settings = pool_settings(config, torch.device(device).type, kv_format_name(config, model))
    check_fixed_pool(model.arch, settings)
    spec = loader.model_spec(model, source)
    used = [in_use(device)]
    length = model_len(model.arch, settings)
    limits = EngineLimits(config.scheduler.max_num_seqs,
                          token_budget(settings, length, settings.chunked_prefill), length)
    backends = load_backends(config, registry, model.arch, spec, limits, route)
    lap("backend load")
    used.append(in_use(device))
    settings = pool_settings(config, settings.device_kind, pool_format(config, backends))
    layout = lay_out(model.arch, settings, backends, device, plan, may_group=not config.cluster.disaggregated)
    kv_cache = allocate(layout, kv_format(settings.format).storage, backends.prefill.kv_cache_spec().device,
                        backends.prefill.capabilities().shares_kv_pool, device, config.cache.prefault)
    used.append(memcheck.in_use(device))
    fit_context(layout, explicit=config.model.max_model_len is not None)
    for b in backends.distinct():
        b.bind_kv_cache(kv_cache)               # TensorRT and IREE load their engines here
    used.append(memcheck.in_use(device))
    lap("KV pool and bind")
    loaded = Loaded(config, route, device, model, spec, plan, backends, settings, layout, kv_cache, draft_config)
    loaded.load_time_s, loaded.load_breakdown_s = time.perf_counter() - t0, lap.seconds
    log_load(loaded)
    loaded.memory = held_memory(layout, kv_cache, plan, device)
    loaded.memory["check"] = checked_plan(plan, layout, backends, device, used)
    log_memory(loaded.memory, layout)
    return loaded


def route_backends(config: Config, registry: Registry, make_engine) -> tuple[Config, routing.Routing]:
    """``config`` with its ``auto`` phases named by the routing (cached, or the stored table)."""
    route = routing.resolve(config, registry, make_engine=make_engine, measure=False)
    config = routing.apply(config, route)
    log.info("backend auto: %s", route.describe())
    if "stored" in route.table:
        log.info("backend auto: `twophase backends CONFIG` times the backends on this machine once (minutes, "
                 "with progress); later runs route by that table")
    return config, route


def plan_memory(config: Config, registry: Registry, device: str, route: routing.Routing | None) -> Plan:
    """The memory plan for this config on this device (``twophase plan``): the budget the pool is
    sized from on CUDA, and the figures checked after load."""
    if torch.device(device).type == "cuda":
        total = torch.cuda.mem_get_info(torch.device(device))[1]
        dev = DeviceProfile(device, "cuda", total, "this GPU's total")
    else:
        dev = DeviceProfile(device, "cpu", available_memory(device), "free now")
    routed = tuple(n for _, n in route.routes) if route else ()
    return memory_plan(config, dev, model=planned_model(config.model), routed=routed, registry=registry)


def kv_format_name(config: Config, model: ResolvedModel) -> str:
    """The K/V format before the backends load: ``cache.dtype``, or the model's dtype."""
    return config.cache.dtype if config.cache.dtype != "auto" else kv_format_of(model.dtype).name


def pool_format(config: Config, backends: Backends) -> str:
    """The K/V format of the pool: ``cache.dtype``, or what the prefill backend keeps."""
    if config.cache.dtype != "auto":
        return config.cache.dtype
    return kv_format_of(backends.prefill.kv_cache_spec().dtype).name


def in_use(device: str) -> int:
    """Bytes in use on ``device``, a model loaded and closed before this one given back first."""
    if torch.device(device).type == "cpu":
        return_freed_memory()
    return memcheck.in_use(device)


def log_load(loaded: Loaded) -> None:
    pcfg, dcfg = loaded.config.phases()
    names = pcfg.name if one_backend(pcfg, dcfg) else f"{pcfg.name} prefill + {dcfg.name} decode"
    log.info("loaded %s on %s/%s in %s (%d KV blocks of %d tokens)", loaded.model.model_id, names, loaded.device,
             load_line({"load_time_s": loaded.load_time_s, "load_breakdown_s": loaded.load_breakdown_s}),
             loaded.layout.num_blocks, loaded.layout.block_size)
