"""What a request and an engine say about K/V that move between engines, as plain values: the
pools' ``KVLayout`` and a request's ``KVTransferParams`` (vLLM's ``kv_transfer_params``).

They sit below the request and the connector, which both read them (``core/request.py``,
``core/kv_transfer.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from twophase.errors import RequestRejected
from twophase.kv_formats import kv_format


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on before blocks move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str                  # the K/V format's name (twophase/kv_formats.py)
    state_bytes: int = 0        # one sequence's state in every state layer (float32), 0: none
    planes: int = 2             # K and V, or one latent a token (MLA)

    def blocks_from_bytes(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` blocks sent as bytes (``blocks.view(torch.uint8)``: numpy has no bfloat16 or
        float8) as the pool's ``[layers, planes, n, kv_heads, block_size, row]``."""
        fmt = kv_format(self.dtype)
        shape = (self.num_layers, self.planes, n, self.num_kv_heads, self.block_size, fmt.row(self.head_dim))
        return raw.view(fmt.storage).view(shape)

    def pack(self, blocks: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """What crosses between engines, as bytes: the blocks, then the sequence's state (a
        model with state layers)."""
        raw = blocks.contiguous().view(torch.uint8).flatten()
        return raw if state is None else torch.cat([raw, state.float().contiguous().view(torch.uint8)])

    def unpack(self, raw: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``pack``'s bytes as ``n`` blocks and the float32 state (None without state layers);
        a payload of another length is a ``ValueError`` saying both."""
        raw = raw.flatten()
        want = len(raw) - self.state_bytes
        fmt = kv_format(self.dtype)
        block_bytes = (self.num_layers * self.planes * n * self.num_kv_heads * self.block_size * fmt.row(self.head_dim)
                       * torch.empty((), dtype=fmt.storage).element_size())
        if want != block_bytes:
            raise ValueError(f"the peer sent {len(raw)} bytes; {n} blocks and the state are "
                             f"{block_bytes + self.state_bytes}")
        state = raw[block_bytes:].view(torch.float32) if self.state_bytes else None
        return self.blocks_from_bytes(raw[:block_bytes], n), state


@dataclass(frozen=True)
class KVTransferParams:
    """What a request tells an engine about K/V held elsewhere (vLLM's ``kv_transfer_params``)."""

    do_remote_decode: bool = False              # prefill side: keep the blocks for a peer
    do_remote_prefill: bool = False             # decode side: the blocks are at a peer
    remote_engine_id: str | None = None
    remote_request_id: str | None = None        # the lease to pull from and acknowledge
    remote_block_ids: tuple[int, ...] = ()
    num_tokens: int = 0                         # tokens whose K/V the blocks hold
    layout: KVLayout | None = None
    lease_s: float = 0.0                        # how long the peer keeps them
    generator_state: bytes | None = None        # a seeded request's generator after the first token

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["remote_block_ids"] = list(self.remote_block_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVTransferParams:
        """Checked: a malformed description is the request's fault (``RequestRejected``)."""
        known = set(cls.__dataclass_fields__)
        if not isinstance(d, dict) or set(d) - known:
            raise RequestRejected(f"kv_transfer_params: unknown keys {sorted(set(d) - known)}"
                                  if isinstance(d, dict) else "kv_transfer_params must be an object")
        d = dict(d)
        layout = d.get("layout")
        try:
            if isinstance(layout, dict):
                d["layout"] = KVLayout(**layout)
            d["remote_block_ids"] = tuple(int(b) for b in d.get("remote_block_ids", ()))
            params = cls(**d)
        except (TypeError, ValueError) as exc:
            raise RequestRejected(f"kv_transfer_params: {exc}") from None
        if params.num_tokens < 0 or any(b < 0 for b in params.remote_block_ids):
            raise RequestRejected("kv_transfer_params: negative token count or block id")
        return params
