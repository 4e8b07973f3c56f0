"""The IREE backend: the model compiled through MLIR (``twophase.exporters.mlir``) to a module
with a ``prefill`` and a ``decode`` entry point, run by IREE's ``local-task`` CPU driver.

Zero-copy: the engine's KV pool is imported once into IREE as a host allocation
(``import_host_allocation``), so each call passes a view of the same memory, never a copy (a numpy
pool passed per call was copied: 2 s a step at 1 GiB). The module returns the new tokens' K/V and
they are written at the batch's slots, as for the ONNX graph.

The module is compiled when the pool is bound, because the pool's block size is compiled in.
CPU only: IREE's Python runtime can import host memory but not torch's CUDA allocations, so on
a GPU it could not alias the shared pool.
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
OPTIONS = {"threads", "export_dir"}


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
        _iree()
        if device != "cpu":
            raise BackendUnavailable(
                f"the iree backend runs on cpu only, not {device!r}: IREE's Python runtime "
                f"cannot alias torch's CUDA memory, so it could not share the KV pool")

    def capabilities(self) -> Capabilities:
        return Capabilities(devices=("cpu",), dtypes=(torch.float32,))

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the iree backend runs float32 on cpu, "
                                             f"not {model.dtype}")
        threads = cfg.options.get("threads", torch.get_num_threads())
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ConfigError("backend.options.threads", f"must be a positive integer; got {threads!r}")
        self.model, self.cfg, self.threads = model, cfg, threads
        self.arch = LlamaArch.from_dict(model.arch)

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, torch.float32,
                           torch.device("cpu"))

    def bind_kv_cache(self, kv: KVCache) -> None:
        from twophase.exporters import mlir

        rt = _iree()
        if kv.pool.dtype != torch.float32 or kv.pool.device.type != "cpu":
            raise ConfigError("cache.dtype", f"the iree backend reads a float32 cpu pool, "
                              f"not {kv.pool.dtype} on {kv.pool.device}")
        path = mlir.export(self.model, "cpu", kv.block_size, self.cfg.options.get("export_dir"))
        rt.flags.parse_flags(f"--task_topology_group_count={self.threads}")
        self.config = rt.Config("local-task")
        self.ctx = rt.SystemContext(config=self.config)
        self.ctx.add_vm_module(rt.VmModule.mmap(self.config.vm_instance, str(path)))
        self.entry = {"prefill": self.ctx.modules.module["prefill"],
                      "decode": self.ctx.modules.module["decode"]}
        self.kv = kv
        device = self.config.device
        buffer = device.allocator.import_host_allocation(
            kv.pool.numpy(), memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.DEFAULT))
        self.pool_view = rt.HalBufferView(buffer, list(kv.pool.shape), rt.HalElementType.FLOAT_32)

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
        write_new_kv(self.kv.pool, torch.from_numpy(new_k.to_host()),
                     torch.from_numpy(new_v.to_host()), slots)
        return torch.from_numpy(logits.to_host())


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [IreeBackend]
