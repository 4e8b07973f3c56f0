"""The Python API: ``LLM.from_config(...)``, ``llm.generate(prompts, params)``.

``LLM`` wires a config into an ``Engine``: it resolves the model, loads the backend(s), sizes and
allocates the KV pool, and builds the scheduler. ``llm.engine`` is the incremental API
(``add_request`` / ``step`` / ``abort``) for servers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from twophase import draft, large_pages, routing
from twophase import plan as planner
from twophase.backends.registry import Registry
from twophase.config import BackendSection, Config, SchedulerConfig, load_config
from twophase.contract import BackendConfig, EngineLimits, KVCache, KVGroups, ModelSpec
from twophase.core.draft_proposer import DraftProposer
from twophase.core.engine import Engine
from twophase.core.kv_manager import KVManager, concurrency, context_tokens, sequence_blocks, step_blocks
from twophase.core.kv_transfer import KVConnector, layout_of
from twophase.core.metrics import phase_report
from twophase.core.ngram import NgramProposer
from twophase.core.outputs import RequestOutput
from twophase.core.params import SamplingParams
from twophase.core.scheduler import Scheduler
from twophase.core.seams import Proposer
from twophase.core.spec_control import SpecController
from twophase.device import available_memory, return_freed_memory, same_device
from twophase.errors import BackendUnavailable, ConfigError, ModelError, RequestRejected
from twophase.kv_formats import kv_format, kv_format_of
from twophase.models import loader
from twophase.plan import check as memcheck
from twophase.plan.model_source import planned_model
from twophase.report import load_line

if TYPE_CHECKING:
    from twophase.models.source import ModelSource

log = logging.getLogger(__name__)
GiB = 1 << 30
AUTO_MAX_DRAFTS = 6          # the most drafts num_tokens = "auto" gives a decode


class _Laps:
    """Seconds spent in each stage of a load, so a slow load says where its time went."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self._last
        self._last = now


class LLM:
    def __init__(self, config: Config, registry: Registry | None = None):
        t0, lap = time.perf_counter(), _Laps()
        self.registry = registry or Registry()
        self.routing: routing.Routing | None = None
        if routing.wanted(config):                # [backend] name = "auto": measured, or cached
            config = self._route_backends(config)
            lap("backend auto")
        self.config = config
        device = self._check_devices()
        source = config.model.source()            # built once a load: the model and its spec read it
        self.model = loader.resolve(source, device)
        self._check_backends_compute()            # before any of them loads or exports
        lap("model files")
        self._draft_config(config)                # refuse a bad draft before any weights load
        self.draft: LLM | None = None             # loaded by the first engine that drafts with it
        self.max_model_len = self._model_context()
        self.plan = self._plan(device)
        lap("memory plan")
        self._check_fits(device)
        used = self._load_backends(device, source)
        lap("backend load")
        used += self._allocate_and_bind_pool(device)
        lap("KV pool and bind")
        self.engine = self._build_engine()
        lap("engine")
        self.load_time_s = time.perf_counter() - t0
        self.load_breakdown_s = lap.laps
        self._log_load(device)
        self.memory = self._check_memory(device, used)

    # -- load steps, in the order __init__ takes them -----------------------------------------
    def _route_backends(self, config: Config) -> Config:
        """``config`` with its ``auto`` phases named by the routing (cached, or the stored table)."""
        self.routing = routing.resolve(config, self.registry, make_engine=LLM, measure=False)
        config = routing.apply(config, self.routing)
        log.info("backend auto: %s", self.routing.describe())
        if "stored" in self.routing.table:
            log.info("backend auto: `twophase backends CONFIG` times the backends on this "
                     "machine once (minutes, with progress); later runs route by that table")
        return config

    def _check_devices(self) -> str:
        """The device both phases run on, once each backend says it can run there: the phases
        read and write one KV pool, so they must share it."""
        pcfg, dcfg = self.config.phases()
        split = self.config.backend.prefill is not None
        for key, sec in ((("backend.prefill", pcfg), ("backend.decode", dcfg)) if split
                         else (("backend", pcfg),)):
            self.registry.get(sec.name, f"{key}.name").check_available(sec.device)
        if not same_device(pcfg.device, dcfg.device):
            raise ConfigError("backend.decode.device",
                              f"prefill runs on {pcfg.device!r} and decode on {dcfg.device!r}: both "
                              f"phases read and write one KV pool, so they must share a device")
        return pcfg.device

    def _check_backends_compute(self) -> None:
        """Each phase's backend computes this architecture, or the run stops here with what it
        lacks, by name ("native: QK-norm is not implemented")."""
        for sec in dict.fromkeys(s.name for s in self.config.phases()):
            why = self.registry.get(sec)().supports_weights(self.model.arch, self.config.model.quantization)
            if why:
                raise BackendUnavailable(f"{why}; backends that compute every feature of this "
                                         f"{self.model.arch.family} model: {', '.join(self._computing())}")

    def _computing(self) -> list[str]:
        out, q = [], self.config.model.quantization
        for name, info in sorted(self.registry.backends.items()):
            try:
                if info.cls is not None and info.cls().supports_weights(self.model.arch, q) is None:
                    out.append(name)
            except Exception:          # a plugin whose capabilities need a load: not listed
                continue
        return out or ["none installed"]

    def _model_context(self) -> int:
        """The longest request: the model's context, or less where ``model.max_model_len`` asks
        (the pool may lower it further, see ``_fit_context``)."""
        limit = self.model.arch.max_position_embeddings
        return min(self.config.model.max_model_len or limit, limit)

    def _load_backends(self, device: str, source: ModelSource) -> list[int]:
        """The prefill and decode backends (one instance where the phases agree) and those
        ``auto`` routes smaller decode batches to; returns the bytes in use before them, which
        the plan's check reads."""
        self.spec = spec = loader.model_spec(self.model, source)
        if torch.device(device).type == "cpu":
            return_freed_memory()                 # a model loaded and closed before this one
        used = [memcheck.in_use(device)]
        pcfg, dcfg = self.config.phases()
        self.prefill_backend = self._load_backend(pcfg, spec)
        same = _one_backend(pcfg, dcfg)
        self.decode_backend = self.prefill_backend if same else self._load_backend(dcfg, spec)
        if not same:
            self._check_pool_sharing(pcfg, dcfg)
        self.decode_routes = self._load_routes(pcfg, dcfg, spec)
        return used

    def _allocate_and_bind_pool(self, device: str) -> list[int]:
        """The KV pool, allocated and bound to every backend, the context lowered to what it
        holds; returns the bytes in use before the pool, after it and after bind (the plan's
        check)."""
        self.backend = self.prefill_backend
        if torch.device(device).type == "cpu":
            return_freed_memory()
        used = [memcheck.in_use(device)]
        self.kv_cache = self._allocate_pool(device)
        if self.config.cache.prefault:
            prefault(self.kv_cache.pool)
        used.append(memcheck.in_use(device))
        self._fit_context(self._pool_tokens())
        routed = [b for _, b in self.decode_routes]
        for b in {id(b): b for b in (self.prefill_backend, self.decode_backend, *routed)}.values():
            b.bind_kv_cache(self.kv_cache)      # TensorRT and IREE load their engines here
        used.append(memcheck.in_use(device))
        return used

    def _log_load(self, device: str) -> None:
        pcfg, dcfg = self.config.phases()
        names = pcfg.name if _one_backend(pcfg, dcfg) else f"{pcfg.name} prefill + {dcfg.name} decode"
        log.info("loaded %s on %s/%s in %s (%d KV blocks of %d tokens)", self.model.model_id, names,
                 device, load_line({"load_time_s": self.load_time_s,
                                    "load_breakdown_s": self.load_breakdown_s}),
                 self.num_blocks, self.config.cache.block_size)

    def _check_memory(self, device: str, used: list[int]) -> dict[str, Any]:
        """What the load holds (``_memory``) and the plan checked against what it measured, logged."""
        m = self._memory(device)
        m["check"] = self._check_plan(device, used)
        g = self.kv_groups
        grouped = (f" (in {g.num_groups} groups of {g.num_slots} layers: sliding layers hold their window)"
                   if g.num_groups > 1 else "")
        log.info("KV cache %.2f GiB = %d tokens%s; max concurrency %d at %d tokens; weights %.2f GiB; "
                 "headroom %.2f GiB", m["kv_cache_bytes"] / GiB, m["kv_tokens"], grouped, m["max_concurrency"],
                 self.max_model_len, m["weight_bytes"] / GiB, m["headroom_bytes"] / GiB)
        return m

    def _plan(self, device: str) -> planner.Plan:
        """The memory plan for this config on this device (``twophase plan``): the budget the
        KV pool is sized from on CUDA, and the figures checked after load."""
        kind = torch.device(device).type
        if kind == "cuda":
            total = torch.cuda.mem_get_info(torch.device(device))[1]
            dev = planner.DeviceProfile(device, "cuda", total, "this GPU's total")
        else:
            dev = planner.DeviceProfile(device, "cpu", available_memory(device), "free now")
        routed = tuple(n for _, n in self.routing.routes) if self.routing else ()
        return planner.plan(self.config, dev, model=planned_model(self.config.model), routed=routed,
                            registry=self.registry)

    def _check_plan(self, device: str, used: list[int]) -> dict[str, dict[str, int]]:
        """Predicted against measured: the weights (and engines) over the backends' load and
        bind; on CUDA the KV pool too (on the CPU its pages are the OS's until written)."""
        predicted = {"weights": self.plan.total("weights", resident=True)
                     - sum(i.bytes for i in self.plan.items if i.name.startswith("draft model:"))
                     + sum(i.bytes for i in self.plan.items if i.name == "TensorRT profiles")}  # at bind
        shared = self.prefill_backend.capabilities().shares_kv_pool
        kv = self.num_blocks * self.plan.kv_bytes_per_token * self.config.cache.block_size
        if not shared:              # a backend keeping its own pool allocates it at bind
            predicted["weights"] += kv
        measured = {"weights": used[1] - used[0] + used[3] - used[2]}
        if torch.device(device).type == "cuda" and shared:
            predicted["kv cache"], measured["kv cache"] = kv, used[2] - used[1]
        return memcheck.compare(predicted, measured)

    def _memory(self, device: str) -> dict[str, Any]:
        """What the KV pool holds and the weights take (as the plan counts them: in the layout
        each backend holds), how many full-context sequences fit, and what the device has left."""
        pool, bs = self.kv_cache.pool, self.config.cache.block_size
        weights = self.plan.total("weights")
        kv = pool.numel() * pool.element_size()          # a meta pool (IREE keeps its own) too
        free = available_memory(device)
        if torch.device(device).type == "cpu":
            free -= kv              # the pool's pages are the OS's until first written
        windows, chunk = self.kv_groups.windows, self._token_budget(self.config.scheduler.chunked_prefill)
        return {"kv_cache_bytes": kv, "kv_tokens": min(self._pool_tokens(), self.num_blocks * bs),
                "max_concurrency": concurrency(windows, self.num_blocks, self.max_model_len, chunk, bs),
                "kv_groups": self.kv_groups.num_groups,
                "weight_bytes": weights, "headroom_bytes": free}

    def _load_backend(self, sec, spec: ModelSpec):
        backend = self.registry.get(sec.name)()
        if spec.quantization not in backend.quantizations:
            runs = [n for n, i in self.registry.backends.items()
                    if i.cls is not None and spec.quantization in i.cls.quantizations]
            raise ConfigError("model.quantization", f"the {sec.name} backend does not run "
                              f"{spec.quantization!r} weights; backends that do: "
                              f"{', '.join(runs) or 'none installed'}")
        self._check_kv_format(backend, spec.dtype)
        sc = self.config.scheduler
        limits = EngineLimits(sc.max_num_seqs, self._token_budget(sc.chunked_prefill), self.max_model_len)
        backend.load(spec, BackendConfig(sec.name, sec.device, dict(sec.options), limits))
        return backend

    def _load_routes(self, pcfg, dcfg, spec: ModelSpec) -> list[tuple[int, Any]]:
        """The backends ``auto`` routes smaller decode batches to (each loaded once)."""
        if self.routing is None or not self.routing.routes:
            return []
        loaded = {pcfg.name: self.prefill_backend, dcfg.name: self.decode_backend}
        routes = []
        for largest, name in self.routing.routes:
            if name not in loaded:
                sec = dataclasses.replace(dcfg, name=name)
                loaded[name] = self._load_backend(sec, spec)
                self._check_pool_sharing(pcfg, sec, loaded[name])
            routes.append((largest, loaded[name]))
        return routes

    def _check_pool_sharing(self, pcfg, dcfg, decode=None) -> None:
        p, d = self.prefill_backend, decode or self.decode_backend
        for key, b, sec in (("backend.prefill", p, pcfg), ("backend.decode", d, dcfg)):
            if not b.capabilities().shares_kv_pool:
                raise ConfigError(f"{key}.name", f"the {sec.name} backend keeps its own KV pool, "
                                  f"so it cannot share the phases with another backend")
        ps, ds = p.kv_cache_spec(), d.kv_cache_spec()
        if ps.dtype != ds.dtype:
            raise ConfigError("backend.decode.name", f"prefill ({pcfg.name}) keeps K/V in "
                              f"{ps.dtype} and decode ({dcfg.name}) in {ds.dtype}: the phases "
                              f"share one pool, so they must agree")

    def _draft_config(self, config: Config) -> Config | None:
        """The draft model's config (``method = "draft"``), its vocabulary checked against the
        target's before either loads its weights."""
        if config.speculative.method != "draft":
            return None
        cfg = draft.draft_config(config)
        try:
            resolved = loader.resolve(cfg.model.source(), cfg.phases()[0].device)
        except ConfigError as exc:
            raise draft.rekeyed(exc) from None
        draft.check_vocabulary(self.model, resolved)
        return cfg

    def _load_draft(self) -> LLM:
        """The draft model (``method = "draft"``), loaded once, with a pool as large as the
        target's unless its ``num_blocks`` says otherwise."""
        if self.draft is None:
            cfg = self._draft_config(self.config)
            assert cfg is not None
            self.draft = LLM(draft.with_pool(cfg, self.num_blocks), self.registry)
        return self.draft

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any]) -> "LLM":
        return cls(load_config(source))

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # -- setup ------------------------------------------------------------------------------
    def _fit_context(self, pool_tokens: int) -> None:
        """One request must fit the pool: a ``max_model_len`` the config asks for and the pool
        cannot hold is an error naming the largest that fits; the model's own context is
        lowered to the pool's, with a log line."""
        if pool_tokens >= self.max_model_len:
            return
        if self.config.model.max_model_len is not None:
            raise ConfigError("model.max_model_len", f"{self.max_model_len} tokens, but the KV pool "
                              f"holds {pool_tokens}: a request that long could never be served; set "
                              f"it to {pool_tokens} at most, or give the pool more (cache.num_blocks, "
                              f"cache.memory_gb)")
        log.info("max_model_len %d, what the KV pool holds (the model's context is %d; "
                 "cache.num_blocks or cache.memory_gb give the pool more)", pool_tokens, self.max_model_len)
        self.max_model_len = pool_tokens

    def _check_fits(self, device: str) -> None:
        """Refuse, before any weights load, weights the device cannot hold and a fixed pool
        too small for one request."""
        need = self.plan.total("weights")
        have = available_memory(device)
        if need > 0.9 * have:
            raise ModelError(
                f"{self.model.model_id} needs {need / GiB:.1f} GiB for its weights "
                f"({self.plan.items[0].how}) but {device} has "
                f"{have / GiB:.1f} GiB available; choose a smaller shape, fewer layers "
                f"(model.num_layers) or a smaller dtype")
        cc = self.config.cache
        if isinstance(cc.num_blocks, int):        # known before any weights load (in groups if
            chunk = self._token_budget(self.config.scheduler.chunked_prefill)    # backends allow)
            self._fit_context(context_tokens(KVGroups.of(self.model.arch).windows, cc.num_blocks, chunk,
                                             cc.block_size))

    def _allocate_pool(self, device: str) -> KVCache:
        cc = self.config.cache
        spec = self.prefill_backend.kv_cache_spec()
        self.kv_groups = self._kv_groups()
        spec = type(spec)(**{**spec.__dict__, "num_layers": self.kv_groups.num_slots})
        scratch = max(spec.scratch_blocks, self.decode_backend.kv_cache_spec().scratch_blocks)
        spec = type(spec)(**{**spec.__dict__, "scratch_blocks": scratch})
        if cc.dtype != "auto":
            spec = type(spec)(**{**spec.__dict__, "dtype": kv_format(cc.dtype).storage})
        per_block = spec.bytes_per_block(cc.block_size)
        if cc.num_blocks == "auto":
            windows, chunk = self.kv_groups.windows, self._token_budget(self.config.scheduler.chunked_prefill)
            each = sequence_blocks(windows, self.max_model_len, 1, cc.block_size)
            wanted = self.config.scheduler.max_num_seqs * each + step_blocks(windows, chunk, cc.block_size)
            free = available_memory(device)
            if cc.memory_gb is None and torch.device(device).type == "cuda":
                num_blocks = self._cuda_pool_blocks(free, per_block)
            else:
                num_blocks = planner.pool_blocks(self.config, 0, per_block, "cpu", free)
            num_blocks = max(1, min(wanted, num_blocks, self._pool_limit(spec, cc.block_size)))
        else:
            num_blocks = cc.num_blocks
        total = (num_blocks + spec.scratch_blocks) * per_block
        free = available_memory(device)
        if total > 0.9 * free:
            raise ModelError(f"the KV pool of {num_blocks} blocks needs {total / GiB:.2f} GiB but "
                             f"{device} has {free / GiB:.2f} GiB free; lower cache.num_blocks or "
                             f"cache.memory_gb")
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks + spec.scratch_blocks, spec.num_kv_heads,
                 cc.block_size, kv_format_of(spec.dtype).row(spec.head_dim))
        shared = self.prefill_backend.capabilities().shares_kv_pool
        # a backend that keeps its own pool gets a shape without memory (see bind_kv_cache)
        return KVCache(zeros(shape, spec.dtype, spec.device if shared else "meta"), cc.block_size,
                       self.kv_groups)

    def _check_kv_format(self, backend, native: torch.dtype) -> None:
        """Refuse, before ``backend`` loads (an export can take minutes) and naming it, a K/V
        format (``cache.dtype``) it does not read."""
        name = self.config.cache.dtype
        if name == "auto":
            return
        fmt = kv_format(name)
        try:
            fmt.check(self.model.arch.head_dim)
        except ValueError as exc:
            raise ConfigError("cache.dtype", str(exc)) from None
        reads = backend.capabilities().kv_formats
        if fmt.storage != native and name not in reads:
            names = dict.fromkeys([str(native).removeprefix("torch."), *reads])
            raise ConfigError("cache.dtype", f"the {backend.name} backend reads K/V in "
                              f"{', '.join(names)}, not {name}")

    def _pool_tokens(self) -> int:
        """The longest context one sequence can have in the pool."""
        chunk = self._token_budget(self.config.scheduler.chunked_prefill)
        return context_tokens(self.kv_groups.windows, self.num_blocks, chunk, self.config.cache.block_size)

    def _kv_groups(self) -> KVGroups:
        """The pool's layout: in groups where the model mixes full and sliding layers and every
        backend reads groups (and no K/V move between engines); else a slot a layer."""
        arch = self.model.arch
        groups = KVGroups.of(arch)
        if groups.num_groups == 1:
            return groups
        backends = [self.prefill_backend, self.decode_backend] + [b for _, b in self.decode_routes]
        unable = sorted({b.name for b in backends if not b.capabilities().kv_groups})
        why = (f"the {', '.join(unable)} backend reads one block table" if unable else
               "K/V move between engines in one block table" if self.config.cluster.disaggregated else None)
        if why is None:
            return groups
        log.info("K/V of every layer kept for the whole context, sliding layers too: %s", why)
        return KVGroups.plain(arch.num_layers)

    def _pool_limit(self, spec, block_size: int) -> int:
        """The most blocks every backend can index (``Capabilities.max_pool_elements``)."""
        per_block = spec.num_layers * 2 * spec.num_kv_heads * block_size * spec.head_dim
        limits = [b.capabilities().max_pool_elements for _, b in self.decode_routes]
        limits += [self.prefill_backend.capabilities().max_pool_elements,
                   self.decode_backend.capabilities().max_pool_elements]
        known = [n // per_block - spec.scratch_blocks for n in limits if n]
        return min(known) if known else 1 << 62

    def _cuda_pool_blocks(self, free: int, per_block: int) -> int:
        """The plan's pool (everything else and the reserve budgeted from the GPU's total,
        including the engines TensorRT and IREE load only after the pool), and never more than
        the memory free now less what the steps will still take and the reserve: another
        process's memory counts."""
        p = self.plan
        later = sum(i.bytes for i in p.items if i.kind not in ("weights", "runtime", "kv cache", "reserve"))
        later += sum(i.bytes for i in p.items if i.name.startswith("draft model:"))  # loaded after the pool
        if not self.prefill_backend.capabilities().shares_kv_pool:
            later += p.total("kv cache")          # its runtime's own copy of the pool (IREE)
        cap = (free - later - p.total("reserve")) // (per_block + p.draft_bytes_per_block)
        if cap < 1:
            raise ModelError(f"no room for a KV pool on the GPU: {free / GiB:.2f} GiB free after the "
                             f"weights, and the steps need {later / GiB:.2f} GiB and the reserve "
                             f"{p.total('reserve') / GiB:.2f} GiB (see twophase plan; lower "
                             f"scheduler.max_num_seqs or model.max_model_len, or raise "
                             f"cache.memory_utilization)")
        if p.num_blocks == 0:
            raise ModelError(f"no room for a KV pool on the GPU: {'; '.join(p.notes) or 'see twophase plan'}")
        return min(p.num_blocks, cap)

    def _token_budget(self, chunked: bool) -> int:
        """Tokens one step may compute: the config's, else a default for the device."""
        on_cuda = torch.device(self.config.phases()[0].device).type == "cuda"
        return self.config.scheduler.max_num_batched_tokens or (
            (4096 if on_cuda else 512) if chunked else self.max_model_len)

    def _build_engine(self, clock: Callable[[], float] = time.perf_counter,
                      sleep: Callable[[float], None] = time.sleep) -> Engine:
        sc, cc = self.config.scheduler, self.config.cache
        pc, dc = self.prefill_backend.capabilities(), self.decode_backend.capabilities()
        chunked = sc.chunked_prefill and pc.chunked_prefill
        budget = self._token_budget(chunked)
        max_seqs = min(x for x in (sc.max_num_seqs, pc.max_num_seqs, dc.max_num_seqs) if x)
        if pc.max_num_tokens:
            budget = min(budget, pc.max_num_tokens)
        if sc.policy == "decode-first" and chunked and budget <= max_seqs:
            raise ConfigError("scheduler.max_num_batched_tokens",
                              f"{budget} must exceed scheduler.max_num_seqs ({max_seqs})")
        arch = self.model.arch
        kv = KVManager(self.num_blocks, cc.block_size, cc.prefix_caching, self.kv_groups.windows)
        sp = self.config.speculative
        proposer: Proposer | None = None
        if sp.method == "ngram":
            proposer = NgramProposer(sp.prompt_lookup_min, sp.prompt_lookup_max)
        elif sp.method == "draft":
            d = self._load_draft()
            proposer = DraftProposer(d.prefill_backend, d.decode_backend,
                                     KVManager(d.num_blocks, cc.block_size, prefix_caching=False),
                                     tuple(arch.eos_token_ids), budget)
        auto = sp.num_tokens == "auto"
        k = AUTO_MAX_DRAFTS if auto else sp.num_tokens
        cl = self.config.cluster
        pool = self.kv_cache.pool
        connector = KVConnector(f"{socket.gethostname()}:{os.getpid()}:{id(self):x}", kv, pool,
                                layout_of(pool), lease_s=cl.kv_lease_s,
                                load_timeout_s=cl.kv_load_timeout_s, on_failure=cl.kv_load_failure,
                                clock=clock, sleep=sleep)
        scheduler = Scheduler(kv, max_seqs, budget, sc.policy, chunked,
                              max_model_len=self.max_model_len,
                              eos_token_ids=tuple(arch.eos_token_ids), vocab_size=arch.vocab_size,
                              proposer=proposer, num_spec_tokens=k,
                              spec_control=SpecController(k) if auto else None,
                              reserve=sc.admission == "reserve", connector=connector)
        return Engine(self.prefill_backend, self.decode_backend, scheduler, self.tokenizer,
                      vocab_size=arch.vocab_size, clock=clock, decode_routes=self.decode_routes)

    # -- generation -------------------------------------------------------------------------
    def apply_chat_template(self, prompt: str) -> str:
        if self.tokenizer is None:
            raise RequestRejected("this model has no tokenizer, so no chat template")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the prompts' order. A prompt that can
        never be served comes back with ``finish_reason = "rejected"`` and the reason."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        pending: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                req = self.engine.add_request(prompt, p)
                pending[req.request_id] = i
            except RequestRejected as exc:
                log.warning("prompt %d rejected: %s", i, exc)
                outputs[i] = RequestOutput.rejected(f"rejected-{i}", prompt, str(exc))
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(pending), desc="generating", unit="req")
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.output is not None and d.request_id in pending:
                    outputs[pending.pop(d.request_id)] = d.output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return outputs  # type: ignore[return-value]

    def report(self, outputs: list[RequestOutput] = ()) -> dict[str, Any]:
        """The phase report over every step since the last ``reset_stats``, with latencies of
        ``outputs``."""
        served = [o for o in outputs if o.times is not None]
        rep = phase_report(list(self.engine.steps.records), [o.times for o in served],
                           sum(len(o.token_ids) for o in served))
        rep["prefix_cache_hit_rate"] = self.engine.kv.hit_rate
        rep["kv_blocks_total"] = self.num_blocks
        rep["memory"] = self.memory
        rep["load_time_s"] = self.load_time_s
        rep["load_breakdown_s"] = dict(self.load_breakdown_s)
        p, d = self.config.phases()
        rep["backend"] = {"prefill": p.name, "decode": d.name, "device": p.device}
        if self.draft is not None and self.config.speculative.method == "draft":
            dp, dd = self.draft.config.phases()
            rep["backend"]["draft"] = {"model": self.draft.model.model_id, "prefill": dp.name,
                                       "decode": dd.name, "quantization": self.draft.spec.quantization}
        return rep

    def reschedule(self, scheduler: SchedulerConfig) -> None:
        """New scheduler settings over the same backends and pool (between runs: any request
        still in flight is dropped with the old engine)."""
        self.config = dataclasses.replace(self.config, scheduler=scheduler)
        self.engine = self._build_engine()

    def close(self) -> None:
        """Release the backends' resources (device memory, runtime sessions)."""
        self.engine.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_stats(self) -> None:
        self.engine.steps.clear()
        self.engine.kv.queries = self.engine.kv.hits = 0


def _one_backend(pcfg: BackendSection, dcfg: BackendSection) -> bool:
    """Whether the phases name one backend, device and options: then one instance runs both."""
    return (pcfg.name, pcfg.device, pcfg.options) == (dcfg.name, dcfg.device, dcfg.options)


def prefault(t: torch.Tensor) -> None:
    """Write every page of a CPU tensor from ``zeros`` (with zeros: its contents stay), so the OS
    backs its memory now. Otherwise the first step to use a page pays for it: about 2 s a GiB in
    a virtual machine, which lands on one request's latency (a pulled prompt's blocks, a long
    prefill's K/V)."""
    if t.device.type != "cpu":
        return
    t0 = time.perf_counter()
    flat = t.view(-1)
    flat[::max(1, 4096 // t.element_size())].zero_()
    flat[-1:].zero_()                    # the last page, where t does not start on a page
    log.info("KV pool prefaulted: %.2f GiB in %.1f s", t.numel() * t.element_size() / GiB,
             time.perf_counter() - t0)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it comes from calloc'd memory (``large_pages.zeroed``),
    which the OS zeroes page by page on first touch, so a GiB-sized pool costs nothing until
    used; it starts on a 64-byte boundary, as runtimes that import it (IREE through DLPack)
    require. (Not on large pages: see ``twophase.large_pages``.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(large_pages.zeroed(nbytes)).view(dtype).view(shape)

