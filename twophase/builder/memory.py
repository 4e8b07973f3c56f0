"""What a load holds in memory, and the plan's prediction checked against what the load measured."""

from __future__ import annotations

import logging
from typing import Any

import torch

from twophase.builder.backends import Backends
from twophase.cache.layout import PoolLayout
from twophase.contract import KVCache
from twophase.device import available_memory
from twophase.plan import Plan
from twophase.plan import check as memcheck

log = logging.getLogger(__name__)
GiB = 1 << 30


def held_memory(layout: PoolLayout, kv_cache: KVCache, plan: Plan, device: str) -> dict[str, Any]:
    """What the KV pool holds and the weights take (as the plan counts them: in the layout each
    backend holds), how many full-context sequences fit, and what the device has left."""
    pool = kv_cache.pool
    kv = pool.numel() * pool.element_size()          # a meta pool (IREE keeps its own) too
    free = available_memory(device)
    if torch.device(device).type == "cpu":
        free -= kv              # the pool's pages are the OS's until first written
    return {"kv_cache_bytes": kv, "kv_tokens": layout.kv_tokens,
            "max_concurrency": layout.concurrency(layout.max_model_len), "kv_groups": layout.groups.num_groups,
            "weight_bytes": plan.total("weights"), "headroom_bytes": free}


def checked_plan(plan: Plan, layout: PoolLayout, backends: Backends, device: str,
                 used: list[int]) -> dict[str, dict[str, int]]:
    """Predicted against measured (``used``: bytes in use before the backends, after them,
    after the pool and after bind): the weights (and engines) over the backends' load and bind;
    on CUDA the KV pool too (on the CPU its pages are the OS's until written)."""
    predicted = {"weights": plan.total("weights", resident=True)
                 - sum(i.bytes for i in plan.items if i.role == "draft" and i.kind == "weights")
                 + sum(i.bytes for i in plan.items if i.role == "at bind")}
    shared = backends.prefill.capabilities().shares_kv_pool
    kv = layout.num_blocks * plan.kv_bytes_per_token * layout.block_size
    if not shared:              # a backend keeping its own pool allocates it at bind
        predicted["weights"] += kv
    measured = {"weights": used[1] - used[0] + used[3] - used[2]}
    if torch.device(device).type == "cuda" and shared:
        predicted["kv cache"], measured["kv cache"] = kv, used[2] - used[1]
    return memcheck.compare(predicted, measured)


def log_memory(m: dict[str, Any], layout: PoolLayout) -> None:
    g = layout.groups
    grouped = (f" (in {g.num_groups} groups of {g.num_slots} layers: sliding layers hold their window)"
               if g.num_groups > 1 else "")
    log.info("KV cache %.2f GiB = %d tokens%s; max concurrency %d at %d tokens; weights %.2f GiB; "
             "headroom %.2f GiB", m["kv_cache_bytes"] / GiB, m["kv_tokens"], grouped, m["max_concurrency"],
             layout.max_model_len, m["weight_bytes"] / GiB, m["headroom_bytes"] / GiB)
