"""The IREE backend: the model compiled through MLIR (``twophase.exporters.mlir``) to a module
with a ``prefill`` and a ``decode`` entry point, run by IREE's ``local-task`` CPU driver or its
``cuda`` driver.

Two ways to hold the KV pool (option ``pool``):

- ``shared`` (the default): the engine's pool is imported once into IREE through DLPack
  (``HalDevice.from_dlpack_capsule``, the route iree-turbine takes for torch's CUDA tensors), so
  each call passes a view of the same memory, never a copy (a numpy pool passed per call was
  copied: 2 s a step at 1 GiB). The module returns the new tokens' K/V and torch writes them at
  the batch's slots, as for the ONNX graph. Other backends may run the other phase over the
  same pool. On CUDA, torch's stream is synchronised before each call (IREE runs on its own).
- ``owned``: the module keeps the pool in its own device memory, zeroes it there, and its
  ``write_kv`` entry point writes each step's K/V into it; only logits come back. For a runtime
  that cannot import torch's memory. It costs ``shares_kv_pool = False`` (no other backend for
  the other phase) and, measured, a copy of the whole pool per step: IREE realises an in-place
  update of a function argument as a copy (its cost: docs/measurements.md).
  Memory is not doubled: the engine gives such a backend a pool on the ``meta`` device.

The module is compiled when the pool is bound, because the pool's block size is compiled in.

A model with state layers (Gated DeltaNet, short convolutions, Mamba-2) runs its decodes here:
the ``decode`` entry point takes the decodes' states gathered at their slots and returns the new
ones, which torch writes back at the slots (``graph.inputs.state_inputs``/``write_states``), after
the batch's ``state_copies``; the states stay the engine's, as a shared pool does. Its prefill is
refused by name (``Capabilities.features_in``): route it to torch (``[backend.prefill] name =
"torch"``, ``[backend.decode] name = "iree"``), so the pool must be ``shared`` (the engine
refuses an ``owned`` one beside another phase's backend).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from twophase.backends.hookspecs import hookimpl
from twophase.backends.traced import GRAPH_FEATURES, MOE_IREE, STATE_DECODE
from twophase.cache.layout import KVHeads
from twophase.contract import (
    CONTRACT_VERSION,
    Backend,
    BackendConfig,
    BackendUnavailable,
    Capabilities,
    DecodeBatch,
    KVCache,
    KVCacheSpec,
    ModelSpec,
    PrefillBatch,
    parse_device,
)
from twophase.device import require_device, threads_option
from twophase.errors import ConfigError, install_hint
from twophase.graph.inputs import kv_rows, layer_blocks, state_inputs, step_inputs, write_rows, write_states

log = logging.getLogger(__name__)
OPTIONS = {"threads", "export_dir", "pool"}
DRIVERS = {"cpu": "local-task", "cuda": "cuda"}


def _iree():
    try:
        import iree.compiler  # noqa: F401
        import iree.runtime as rt
        import iree.turbine  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(f"IREE is not installed ({exc.name} missing): "
                                 f"{install_hint('mlir')}") from None
    return rt


class IreeBackend(Backend):
    name = "iree"
    contract_version = CONTRACT_VERSION

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        rt = _iree()
        dev = parse_device(device)
        kind = dev.type
        if kind not in DRIVERS:
            raise BackendUnavailable(f"the iree backend runs on cpu or cuda, not {device!r}")
        if kind == "cuda":
            require_device(device)                # the engine's pool and streams are torch's
            try:
                found = rt.get_driver("cuda").query_available_devices()
            except Exception as exc:                  # no libcuda, no driver: IREE says why
                raise BackendUnavailable(f"IREE's cuda driver cannot start: {exc}") from None
            index = dev.index or 0
            if index >= len(found):
                raise BackendUnavailable(f"IREE sees {len(found)} CUDA device(s), so there is "
                                         f"no {device!r}")

    def capabilities(self) -> Capabilities:
        owned = getattr(self, "pool_mode", "shared") == "owned"
        # state layers in decode only (their prefill, the chunked form, is not traced)
        return Capabilities(features=GRAPH_FEATURES, devices=tuple(DRIVERS), dtypes=(torch.float32,),
                            shares_kv_pool=not owned, own_threads=True, kv_groups=True,
                            features_in={"prefill": GRAPH_FEATURES - STATE_DECODE},
                            computes={"moe": MOE_IREE})

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the iree backend runs float32, not {model.dtype}")
        threads = threads_option(cfg.options)
        self.device = torch.device(cfg.device)
        mode = cfg.options.get("pool", "shared")
        if mode not in ("shared", "owned"):
            raise ConfigError("backend.options.pool", f'must be "shared" or "owned"; got {mode!r}')
        self.model, self.cfg, self.threads, self.pool_mode = model, cfg, threads, mode
        self.arch = model.arch

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVHeads.of(self.arch).spec(len(self.arch.attention_layers), torch.float32, self.device)

    def bind_kv_cache(self, kv: KVCache) -> None:
        from twophase.exporters import mlir

        rt = _iree()
        if kv.pool.dtype != torch.float32:
            raise ConfigError("cache.dtype", f"the iree backend keeps K/V in float32, "
                                             f"not {kv.pool.dtype}")
        path = mlir.export(self.model, self.device.type, kv.block_size,
                           self.cfg.options.get("export_dir"))
        if self.device.type == "cpu":
            rt.flags.parse_flags(f"--task_topology_group_count={self.threads}")
            self.config = rt.Config("local-task")
        else:
            self.config = rt.Config(device=rt.get_device(f"cuda://{self.device.index or 0}"))
        self.ctx = rt.SystemContext(config=self.config)
        self.ctx.add_vm_module(rt.VmModule.mmap(self.config.vm_instance, str(path)))
        self.entry = self.ctx.modules.module
        self.kv = kv
        self.pool_view = self._import_pool(rt, kv.pool) if self.pool_mode == "shared" \
            else self._own_pool(rt, kv.pool)

    def _import_pool(self, rt, pool: torch.Tensor):
        """The engine's pool, seen by IREE without a copy."""
        if pool.device.type != self.device.type:
            raise ConfigError("backend.options.pool", f"the shared pool must be on {self.device}, "
                                                      f"not on {pool.device}")
        if not pool.is_contiguous():
            raise ConfigError("backend.options.pool", "the shared pool must be contiguous")
        try:
            return self.config.device.from_dlpack_capsule(pool.__dlpack__())
        except Exception as exc:                  # a runtime that takes no foreign memory
            raise ConfigError("backend.options.pool", f"IREE could not import the engine's pool "
                              f"({exc}); set pool = \"owned\" to let the module keep its own") from None

    def _own_pool(self, rt, pool: torch.Tensor):
        """A pool of the engine's shape in IREE's device memory: zeroed on the device, or a copy
        of ``pool``'s contents when it holds any (not on ``meta``; the conformance kit's case)."""
        device = self.config.device
        log.warning("iree keeps its own KV pool (%.2f GiB): each step's write copies all of it "
                    "(IREE realises an in-place update as a copy); bound it with cache.num_blocks",
                    pool.numel() * pool.element_size() / 2**30)
        if pool.device.type != "meta":
            return rt.asdevicearray(device, pool.detach().cpu().numpy())
        buffer = device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.DEVICE_LOCAL), allowed_usage=int(rt.BufferUsage.DEFAULT),
            allocation_size=pool.numel() * pool.element_size())
        view = rt.DeviceArray(device, rt.HalBufferView(buffer, list(pool.shape),
                                                       rt.HalElementType.FLOAT_32))
        self.entry["clear_kv"](view)
        return view

    def read_kv_pool(self) -> torch.Tensor | None:
        if self.pool_mode == "shared":
            return None
        return torch.from_numpy(np.array(self.pool_view.to_host()))

    # -- the two operations -----------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        if self.kv.states:                        # the decode entry point, for one-token chunks only
            if max(batch.query_lens) > 1:
                raise BackendUnavailable(self.supports_phase(self.arch, self.model.quantization,
                                                             "prefill") or "")
            return self.decode(DecodeBatch(batch.token_ids, batch.positions, batch.slot_mapping,
                                           batch.block_tables, batch.context_lens,
                                           batch.state_slots, batch.state_copies))
        x = step_inputs(batch, self.kv, decodes=False)
        return self._run("prefill", batch.slot_mapping,
                         [x["input_ids"], x["positions"], self.pool_view, x["chunk_index"],
                          x["chunk_blocks"], x["chunk_cached"], x["chunk_lens"], x["logits_index"]])[0]

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        cached = batch.context_lens - 1
        width = max(1, -(-int(cached.max()) // self.kv.block_size))
        blocks = layer_blocks(batch.block_tables[..., :width], tuple(self.kv.pool.shape), self.kv.groups)
        args = [batch.token_ids, batch.positions, self.pool_view, blocks, cached]
        if not self.kv.states:
            return self._run("decode", batch.slot_mapping, args)[0]
        self.kv.copy_states(batch.state_copies)
        assert batch.state_slots is not None
        slots = batch.state_slots.to(self.device)
        states = state_inputs(self.kv, slots)
        logits, new = self._run("decode", batch.slot_mapping, args + [t.cpu() for t in states.values()])
        write_states(self.kv, {f"new_{n}": t.to(self.device) for n, t in zip(states, new, strict=True)},
                     slots)
        return logits

    def _run(self, entry: str, slots: torch.Tensor, args: list[Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits of one call, its K/V written at ``slots``, and its results after the K/V (a
        state model's new states), on the host."""
        args = [np.ascontiguousarray(a.numpy()) if isinstance(a, torch.Tensor) else a for a in args]
        if self.device.type == "cuda" and self.pool_mode == "shared":
            torch.cuda.current_stream(self.device).synchronize()   # the pool's last writes land
        logits, new_k, new_v, *more = self.entry[entry](*args)
        rows = kv_rows(tuple(self.kv.pool.shape), slots, self.kv.groups)
        if self.pool_mode == "owned":
            self.entry["write_kv"](self.pool_view, new_k, new_v, np.ascontiguousarray(rows.numpy()))
        else:     # through the host: a step's K/V are small (23 KB a token, default model)
            write_rows(self.kv.pool, torch.from_numpy(new_k.to_host()).to(self.device),
                       torch.from_numpy(new_v.to_host()).to(self.device), rows.to(self.device))
        return torch.from_numpy(logits.to_host()), [torch.from_numpy(t.to_host()) for t in more]


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [IreeBackend]
