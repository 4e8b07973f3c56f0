"""The engine ``LLM`` builds for a config, with simulated backends in place of loaded ones.

``SimulatedLLM`` is an ``LLM`` whose load reads shapes only: the model from the planner
(``planned_model``: a named shape, a config.json or a GGUF header; nothing downloaded), the pool
sized by the memory plan for the simulated device (``twophase plan``'s figures, which are the
pool the engine allocates there), and a pool tensor on the ``meta`` device. The rest is
the engine's own code: the pool laid out by ``twophase.cache.layout``, the context fitted to it,
and the scheduler, KV manager and admission built by ``LLM.build_engine`` over the virtual clock.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from twophase import plan as planner
from twophase.backends.registry import Registry
from twophase.builder import Loaded, routing
from twophase.builder.backends import Backends
from twophase.builder.pool import fit_context
from twophase.cache.layout import lay_out_pool, model_len
from twophase.cli import flags
from twophase.config import Config
from twophase.contract import BackendConfig, KVCache, ModelSpec
from twophase.errors import ConfigError, ModelError
from twophase.kv_formats import kv_format
from twophase.llm import LLM
from twophase.models import loader
from twophase.plan.budget import kv_dtype_bytes, model_dtype
from twophase.plan.model_source import planned_model
from twophase.simulate.backend import SimulatedBackend, mirrored
from twophase.simulate.clock import VirtualClock
from twophase.simulate.cost import StepCostModel
from twophase.simulate.devices import DeviceSpec, check_tp
from twophase.simulate.drafts import AcceptingProposer


def for_device(config: Config, device: DeviceSpec) -> Config:
    """``config`` with its backends on the simulated device's kind (as ``twophase plan`` does),
    so defaults that depend on it (the token budget, bfloat16) are that device's."""
    if routing.wanted(config):            # auto is timed on real backends: simulate torch
        config = routing.apply(config, routing.Routing("torch", "torch"))
    return flags.on_device(config, "cuda") if device.kind == "cuda" else config


class SimulatedLLM(LLM):
    def __init__(self, config: Config, device: DeviceSpec, registry: Registry | None = None,
                 acceptance: float = 0.7, tp: int = 1):
        """``tp``: the engine spans that many devices of ``device``'s kind, tensor-parallel (its
        pool planned on their memory together; each step costed with its all-reduces)."""
        t0 = time.perf_counter()
        config = for_device(config, device)
        if config.speculative.method == "draft":
            raise ConfigError("speculative.method", "the simulator does not cost a draft model's "
                              "steps; simulate speculation as \"ngram\" with --acceptance")
        if config.cluster.disaggregated or config.cluster.replicas > 1:
            raise ConfigError("cluster", "the simulator runs one engine: no replicas or "
                              "disaggregated workers")
        if config.lora:
            raise ConfigError("lora", "the simulator does not cost adapters' steps")
        if config.cache.offload.enabled:
            raise ConfigError("cache.offload", "the simulator does not model the host and disk tiers")
        check_tp(tp, device.kind)
        self.tp = tp
        self.adapters = None
        self.registry = registry or Registry()
        kind = device.kind
        planned = planned_model(config.model)
        dtype = model_dtype(config, kind)
        spec_dtype = loader.DTYPES[dtype]
        model = loader.ResolvedModel(planned.model_id, planned.arch, "none: shapes only", None, spec_dtype)
        profile = planner.profile(device.name if kind == "cuda" else "cpu")
        if tp > 1:       # weights and K/V split over the devices, each with its own reserve
            profile = dataclasses.replace(profile, name=f"{tp}x {profile.name}",
                                          total_bytes=tp * profile.total_bytes)
        plan = planner.plan(config, profile, model=planned, registry=self.registry)
        if plan.num_blocks == 0:
            raise ModelError(f"{planned.model_id} leaves no room for a KV pool on {device.name}: "
                             f"{'; '.join(plan.notes) or 'see twophase plan'}")
        self.clock = VirtualClock()
        weights = "q4" if config.model.quantization == "q4" else dtype
        cost = StepCostModel(planned.arch, device, weights, kv_dtype_bytes(config, kind, planned.arch), tp)
        pcfg, dcfg = config.phases()
        prefill = self._simulated(pcfg.name, cost)
        same = (pcfg.name, pcfg.options) == (dcfg.name, dcfg.options)
        backends = Backends(prefill, prefill if same else self._simulated(dcfg.name, cost), [])
        spec = ModelSpec(planned.arch, "none: shapes only", spec_dtype, planned.model_id,
                         quantization=config.model.quantization)
        for b, sec in {id(b): (b, s) for b, s in ((backends.prefill, pcfg), (backends.decode, dcfg))}.values():
            b.load(spec, BackendConfig(sec.name, sec.device))
        # the plan's pool on the simulated device, laid out as the engine lays it out
        settings = planner.pool_settings(config, kind)
        layout = lay_out_pool(planned.arch, dataclasses.replace(settings, num_blocks=plan.num_blocks),
                              prefill.capabilities(), [backends.decode.capabilities()], 0)
        layout = dataclasses.replace(layout, model_len=model_len(planned.arch, settings))
        fit_context(layout, explicit=config.model.max_model_len is not None)
        kv = layout.specs[0]              # K/V of heads, or a latent
        shape = (layout.groups.num_slots, kv.planes, layout.num_blocks, kv.num_kv_heads,  # type: ignore[attr-defined]
                 layout.block_size, kv_format(settings.format).row(kv.head_dim))  # type: ignore[attr-defined]
        kv_cache = KVCache(torch.empty(shape, dtype=kv_format(settings.format).storage, device="meta"),
                           layout.block_size, layout.groups)
        for b in backends.distinct():
            b.bind_kv_cache(kv_cache)
        self.loaded = Loaded(config, None, device.name, model, spec, plan, backends, settings, layout, kv_cache,
                             None)
        self.draft = None
        self.engine = self.build_engine(clock=self.clock, sleep=self.clock.sleep)
        if config.speculative.method != "none":       # drafts at the workload's acceptance rate
            self.engine.set_proposer(AcceptingProposer(prefill.token, acceptance))
        self.loaded.load_time_s = time.perf_counter() - t0
        self.loaded.load_breakdown_s = {"simulated load": self.loaded.load_time_s}
        self.loaded.memory = self._planned_memory()

    def with_blocks(self, num_blocks: int) -> None:
        """The pool of ``num_blocks`` (an engine measured beside), with a fresh engine over it."""
        self.loaded.layout = dataclasses.replace(self.loaded.layout, num_blocks=num_blocks)
        self.engine = self.build_engine(clock=self.clock, sleep=self.clock.sleep)

    def _simulated(self, name: str, cost: StepCostModel) -> SimulatedBackend:
        """A simulated backend with the batching and limits of the backend the config names."""
        try:
            caps = self.registry.get(name)().capabilities()
        except Exception:          # a backend that cannot start here: plain capabilities
            caps = SimulatedBackend().capabilities()
        return SimulatedBackend(cost, self.clock, mirrored(caps))

    def _planned_memory(self) -> dict:
        """``LLM.memory``'s figures as the plan counts them on the simulated device."""
        p, layout = self.plan, self.loaded.layout
        pool = self.kv_cache.pool
        return {"kv_cache_bytes": pool.numel() * pool.element_size(), "kv_tokens": layout.kv_tokens,
                "max_concurrency": layout.concurrency(layout.max_model_len), "kv_groups": layout.groups.num_groups,
                "weight_bytes": p.total("weights"),
                "headroom_bytes": max(0, p.device.total_bytes - p.total() + p.total("reserve")), "check": {}}

    @property
    def backends(self) -> list[SimulatedBackend]:
        return list({id(b): b for b in (self.prefill_backend, self.decode_backend)}.values())
