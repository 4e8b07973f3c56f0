"""The IREE backend: the model compiled through MLIR (``twophase.exporters.mlir``) to a module
with a ``prefill`` and a ``decode`` entry point, run by IREE's ``local-task`` CPU driver or its
``cuda`` driver.

Two ways to hold the KV pool (option ``pool``):

- ``shared`` (cpu; the default there): the engine's pool is imported once into IREE as a host
  allocation (``import_host_allocation``), so each call passes a view of the same memory, never a
  copy (a numpy pool passed per call was copied: 2 s a step at 1 GiB). The module returns the new
  tokens' K/V and torch writes them at the batch's slots, as for the ONNX graph. Other backends
  may run the other phase over the same pool.
- ``owned`` (the only choice on cuda): the module keeps the pool in its own device memory and its
  ``write_kv`` entry point writes each step's K/V there in place; only the logits come back.
  IREE's Python runtime imports host memory but has no tested way here to take torch's CUDA
  allocations (3.13's ``HalDevice.from_dlpack_capsule`` may; no GPU was at hand to check it).
  The cost: ``shares_kv_pool = False``, so the engine refuses to route the other phase to another
  backend, and a step makes one more call (``write_kv``). Memory is not doubled: the engine gives
  such a backend a pool on the ``meta`` device, and the backend allocates the real one.

The module is compiled when the pool is bound, because the pool's block size is compiled in.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from twophase.backends.base import (Backend, BackendConfig, BackendUnavailable, Capabilities,
                                    DecodeBatch, KVCache, KVCacheSpec, ModelSpec, PrefillBatch)
from twophase.backends.hookspecs import hookimpl
from twophase.errors import ConfigError
from twophase.models.shapes import LlamaArch

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
                                 f"pip install 'twophase[mlir]'") from None
    return rt


class IreeBackend(Backend):
    name = "iree"

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        rt = _iree()
        kind = torch.device(device).type
        if kind not in DRIVERS:
            raise BackendUnavailable(f"the iree backend runs on cpu or cuda, not {device!r}")
        if kind == "cuda":
            try:
                found = rt.get_driver("cuda").query_available_devices()
            except Exception as exc:                  # no libcuda, no driver: IREE says why
                raise BackendUnavailable(f"IREE's cuda driver cannot start: {exc}") from None
            index = torch.device(device).index or 0
            if index >= len(found):
                raise BackendUnavailable(f"IREE sees {len(found)} CUDA device(s), so there is "
                                         f"no {device!r}")

    def capabilities(self) -> Capabilities:
        owned = getattr(self, "pool_mode", "shared") == "owned"
        return Capabilities(devices=tuple(DRIVERS), dtypes=(torch.float32,),
                            shares_kv_pool=not owned)

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the iree backend runs float32, not {model.dtype}")
        threads = cfg.options.get("threads", torch.get_num_threads())
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ConfigError("backend.options.threads", f"must be a positive integer; got {threads!r}")
        self.device = torch.device(cfg.device)
        on_cuda = self.device.type == "cuda"
        mode = cfg.options.get("pool", "owned" if on_cuda else "shared")
        if mode not in ("shared", "owned") or (on_cuda and mode == "shared"):
            allowed = '"owned"' if on_cuda else '"shared" or "owned"'
            raise ConfigError("backend.options.pool", f"must be {allowed} on {self.device.type}; "
                              f"got {mode!r}")
        self.model, self.cfg, self.threads, self.pool_mode = model, cfg, threads, mode
        self.arch = LlamaArch.from_dict(model.arch)

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, torch.float32, self.device)

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
        """The engine's cpu pool, seen by IREE without a copy."""
        if pool.device.type != "cpu":
            raise ConfigError("backend.options.pool", f"a shared pool must be on the cpu, not "
                                                      f"{pool.device}")
        buffer = self.config.device.allocator.import_host_allocation(
            pool.numpy(), memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.DEFAULT))
        return rt.HalBufferView(buffer, list(pool.shape), rt.HalElementType.FLOAT_32)

    def _own_pool(self, rt, pool: torch.Tensor):
        """A pool of the engine's shape in IREE's device memory: zeroed on the device, or a copy
        of ``pool``'s contents when it holds any (not on ``meta``; the conformance kit's case)."""
        device = self.config.device
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
        from twophase.exporters.onnx import graph_inputs

        x = graph_inputs(batch, self.kv.block_size, decodes=False)
        return self._run("prefill", batch.slot_mapping,
                         [x["input_ids"], x["positions"], self.pool_view, x["chunk_index"],
                          x["chunk_tables"], x["chunk_cached"], x["chunk_lens"], x["logits_index"]])

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        cached = batch.context_lens - 1
        width = max(1, -(-int(cached.max()) // self.kv.block_size))
        tables = batch.block_tables[:, :width]
        return self._run("decode", batch.slot_mapping,
                         [batch.token_ids, batch.positions, self.pool_view, tables, cached])

    def _run(self, entry: str, slots: torch.Tensor, args: list[Any]) -> torch.Tensor:
        from twophase.exporters.onnx import write_new_kv

        args = [np.ascontiguousarray(a.numpy()) if isinstance(a, torch.Tensor) else a for a in args]
        logits, new_k, new_v = self.entry[entry](*args)
        if self.pool_mode == "owned":
            self.entry["write_kv"](self.pool_view, new_k, new_v, np.ascontiguousarray(slots.numpy()))
        else:
            write_new_kv(self.kv.pool, torch.from_numpy(new_k.to_host()),
                         torch.from_numpy(new_v.to_host()), slots)
        return torch.from_numpy(logits.to_host())


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [IreeBackend]
