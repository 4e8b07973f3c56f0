"""The engine's KV pool: laid out (``twophase.cache.layout``) for the loaded backends and the
memory free now, allocated, and bound to every backend."""

from __future__ import annotations

import logging
import math
import time

import torch

from twophase import large_pages
from twophase.builder.backends import Backends
from twophase.builder.checks import check_pool_memory, check_request_len
from twophase.cache.layout import KVHeads, PoolLayout, PoolSettings, lay_out_pool
from twophase.contract import KVCache, ModelArch
from twophase.device import available_memory
from twophase.errors import ModelError
from twophase.kv_formats import kv_format_of
from twophase.plan import Plan

log = logging.getLogger(__name__)
GiB = 1 << 30


def lay_out(arch: ModelArch, settings: PoolSettings, backends: Backends, device: str, plan: Plan,
            may_group: bool) -> PoolLayout:
    """The pool for the loaded backends: their K/V as they hold it (``kv_cache_spec``), the
    memory free now, and on CUDA never more than the plan's."""
    spec = backends.prefill.kv_cache_spec()
    scratch = max(spec.scratch_blocks, backends.decode.kv_cache_spec().scratch_blocks)
    prefill, others = backends.prefill.capabilities(), [b.capabilities() for b in backends.decoders()]
    free, extra = available_memory(device), 0
    if settings.num_blocks is None and settings.memory_bytes is None and torch.device(device).type == "cuda":
        free, extra = cuda_pool_bytes(plan, free, backends.prefill.capabilities().shares_kv_pool), \
            plan.draft_bytes_per_block
    kv = KVHeads(spec.num_kv_heads, spec.head_dim, spec.planes)
    layout = lay_out_pool(arch, settings, prefill, others, free, kv=kv, may_group=may_group, scratch_blocks=scratch,
                          extra_bytes_per_block=extra, minimum_blocks=1)
    if layout.groups.num_groups == 1 and len(set(s.attention.window for s in arch.layers)) > 1:
        unable = sorted({b.name for b in backends.distinct() if not b.capabilities().kv_groups})
        why = f"the {', '.join(unable)} backend reads one block table" if unable else \
            "K/V move between engines in one block table"
        log.info("K/V of every layer kept for the whole context, sliding layers too: %s", why)
    return layout


def cuda_pool_bytes(plan: Plan, free: int, shares_pool: bool) -> int:
    """What the pool may take on a GPU: the plan's pool (everything else and the reserve
    budgeted from the GPU's total, including the engines TensorRT and IREE load only after the
    pool), and never more than the memory free now less what the steps will still take and the
    reserve: another process's memory counts."""
    later = sum(i.bytes for i in plan.items if i.kind not in ("weights", "runtime", "kv cache", "reserve"))
    later += sum(i.bytes for i in plan.items if i.role == "draft" and i.kind == "weights")  # loaded after the pool
    if not shares_pool:
        later += plan.total("kv cache")          # its runtime's own copy of the pool (IREE)
    per_block = plan.pool.page_bytes + plan.draft_bytes_per_block
    room = free - later - plan.total("reserve")
    if room // per_block < 1:
        raise ModelError(f"no room for a KV pool on the GPU: {free / GiB:.2f} GiB free after the "
                         f"weights, and the steps need {later / GiB:.2f} GiB and the reserve "
                         f"{plan.total('reserve') / GiB:.2f} GiB (see twophase plan; lower "
                         f"scheduler.max_num_seqs or model.max_model_len, or raise "
                         f"cache.memory_utilization)")
    if plan.num_blocks == 0:
        raise ModelError(f"no room for a KV pool on the GPU: {'; '.join(plan.notes) or 'see twophase plan'}")
    return min(room, plan.num_blocks * per_block)


def fit_context(layout: PoolLayout, explicit: bool) -> None:
    """One request must fit the pool: a ``max_model_len`` the config asks for and the pool cannot
    hold is an error; the model's own context is lowered to the pool's, with a log line."""
    check_request_len(layout.model_len, layout.pool_tokens, explicit)
    if layout.pool_tokens < layout.model_len:
        log.info("max_model_len %d, what the KV pool holds (the model's context is %d; cache.num_blocks or "
                 "cache.memory_gb give the pool more)", layout.pool_tokens, layout.model_len)


def allocate(layout: PoolLayout, dtype: torch.dtype, device: torch.device, shared: bool, device_name: str,
             prefault_pages: bool) -> KVCache:
    """The pool, zero-filled: ``[slots, planes, blocks + scratch, kv_heads, block_size, row]``
    (planes: K and V, or one latent). A backend that keeps its own pool gets a shape without
    memory (see ``bind_kv_cache``)."""
    check_pool_memory(layout.num_blocks, layout.pool_bytes, device_name)
    spec = layout.specs[0]
    heads, hd, planes = spec.num_kv_heads, spec.head_dim, spec.planes        # type: ignore[attr-defined]
    shape = (layout.groups.num_slots, planes, layout.num_blocks + layout.scratch_blocks, heads, layout.block_size,
             kv_format_of(dtype).row(hd))
    pool = zeros(shape, dtype, device if shared else torch.device("meta"))
    if prefault_pages:
        prefault(pool)
    states: tuple[tuple[torch.Tensor, ...], ...] = ()
    if layout.state is not None:
        st = layout.state
        states = tuple(tuple(torch.zeros((layout.state_slots, *shape), dtype=getattr(torch, st.dtype), device=device)
                             for shape in st.shapes) for _ in range(st.num_layers))
    return KVCache(pool, layout.block_size, layout.groups, states)


def prefault(t: torch.Tensor) -> None:
    """Write every page of a CPU tensor from ``zeros`` (with zeros: its contents stay), so the OS
    backs its memory now. Otherwise the first step to use a page pays for it (in a virtual
    machine, seconds a GiB), which lands on one request's latency."""
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
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(large_pages.zeroed(nbytes)).view(dtype).view(shape)
