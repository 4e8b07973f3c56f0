"""K/V blocks between workers through Ray's object store: the decode worker calls the prefill
worker's ``read_kv`` (a copy of the leased blocks, put in the object store) and, once they are
here, its ``release_kv``.

This is the CPU transport. On GPUs the same pull would move device tensors with NCCL or NIXL
through Ray's tensor transport (``@ray.method(tensor_transport=...)``) instead of host copies;
that is not built here (no GPU to test it on)."""

from __future__ import annotations

import warnings
from typing import Any

import ray
import torch

from twophase.core.kv_transfer import KVTransferParams


class RayTransport:
    def __init__(self, namespace: str):
        self.namespace = namespace
        self._actors: dict[str, Any] = {}

    def _actor(self, name: str) -> Any:
        if name not in self._actors:
            self._actors[name] = ray.get_actor(name, namespace=self.namespace)
        return self._actors[name]

    def fetch(self, params: KVTransferParams) -> Any:
        ref = self._actor(str(params.remote_engine_id)).read_kv.remote(params.remote_request_id)
        return ref, params

    def poll(self, ticket: Any) -> torch.Tensor | None:
        """The peer's bytes once here (the connector reads them as blocks and a state)."""
        ref, _ = ticket
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        with warnings.catch_warnings():      # the object store's array is read-only: only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(ray.get(ref))

    def ack(self, params: KVTransferParams) -> None:
        self._actor(str(params.remote_engine_id)).release_kv.remote(params.remote_request_id)
