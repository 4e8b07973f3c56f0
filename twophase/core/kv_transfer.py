"""KV blocks that move between engines: the KV connector, a scheduler half and a worker half.

Disaggregated serving runs a prompt on a prefill engine and its decode on another, and the
decode side pulls the prompt's K/V (as vLLM's NIXL connector does):

- Prefill side: a request sent with ``do_remote_decode`` runs its prompt and samples its first
  token as usual. When it finishes, ``KVConnector.request_finished`` keeps the blocks holding the
  prompt's full blocks under a lease and describes them in ``KVTransferParams`` (vLLM's
  ``kv_transfer_params`` shape, plus the token count and the layout). The blocks return to the
  pool when the peer acknowledges (``release``) or the lease runs out (``expire``).
- Decode side: a request sent with ``do_remote_prefill`` (and the first token it continues from)
  is admitted against this pool; the scheduler allocates its blocks and ``start_pull`` asks the
  ``KVTransport`` for the peer's blocks. Once they arrive (``pulled``), the scheduler counts them
  computed and schedules the rest (the partial last block and the first token) in that step, and
  the worker half (``load``) writes them into the pool before the step computes; the peer is then
  acknowledged. A pull that fails or takes longer than ``load_timeout_s`` ends the request with an
  error or recomputes its prompt here (``on_failure = "fail" | "recompute"``).

Phases routed to two backends in one process are the zero-copy case: both backends bind the one
pool, so an engine without a connector has nothing to move.

The request's side of it, ``KVTransferParams`` and the pools' ``KVLayout``, are plain values in
``core/kv_params.py`` (the request holds them); the rules of the handoff on outputs
(``first_token_params``, ``joined``, ...) are in ``core/handoff.py``. Both are importable from here.

Transports: the object store of Ray on the CPU (``twophase/cluster``); on GPUs the same pull would
go over NCCL or NIXL through Ray's tensor transport (not built: no GPU here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from twophase.core.handoff import continues_on_peer, first_text, first_token_params, joined, wants_decode_peer
from twophase.core.kv_params import KVLayout, KVTransferParams
from twophase.errors import RequestRejected
from twophase.kv_formats import kv_format_of

if TYPE_CHECKING:
    from twophase.core.kv_manager import KVManager
    from twophase.core.request import Request

# the values (core/kv_params.py) and the handoff rules (core/handoff.py) are importable from here too
__all__ = ["KVConnector", "KVLayout", "KVTransferParams", "KVTransport", "LocalTransport", "PullResults",
           "first_text", "first_token_params", "continues_on_peer", "joined", "layout_of", "wants_decode_peer"]

log = logging.getLogger(__name__)


class KVTransport(Protocol):
    """Moves a peer's leased blocks here. ``fetch`` starts a pull and returns a ticket; ``poll``
    returns what the peer's ``KVConnector.read`` gave (the blocks and, in a model with state
    layers, the sequence's state, as bytes: ``KVLayout.pack``) once it arrived (``None`` before)
    and raises if the pull failed; ``ack`` tells the peer it may free them."""

    def fetch(self, params: KVTransferParams) -> Any: ...

    def poll(self, ticket: Any) -> torch.Tensor | None: ...

    def ack(self, params: KVTransferParams) -> None: ...


@dataclass
class _Lease:
    blocks: list[int]
    expires: float
    state: torch.Tensor | None = None          # the sequence's state at the end of its prompt


@dataclass
class _Pull:
    req: Request
    block_ids: list[int]                       # where the blocks go in this pool
    params: KVTransferParams
    ticket: Any
    started: float
    blocks: torch.Tensor | None = None         # arrived, not yet written
    state: torch.Tensor | None = None          # with them, a model with state layers


@dataclass
class PullResults:
    """What ``pulled`` found: requests whose blocks arrived, and those whose pull failed."""

    ready: list[tuple[Request, int]] = field(default_factory=list)    # (request, tokens pulled)
    failed: list[tuple[Request, str]] = field(default_factory=list)   # (request, why)


class KVConnector:
    def __init__(self, engine_id: str, kv: KVManager, pool: torch.Tensor, layout: KVLayout,
                 transport: KVTransport | None = None, lease_s: float = 30.0,
                 load_timeout_s: float = 2.0,
                 on_failure: Literal["fail", "recompute"] = "fail",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 states: tuple[tuple[torch.Tensor, ...], ...] = ()):
        self.engine_id, self.kv, self.pool, self.layout = engine_id, kv, pool, layout
        # state layers' tensors (``KVCache.states``): a state cannot be cut at a block, so a
        # prompt moves whole, every block of it and its state at its end
        self.states = states
        self.transport = transport
        self.lease_s, self.load_timeout_s, self.on_failure = lease_s, load_timeout_s, on_failure
        self.clock, self.sleep = clock, sleep
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()          # reads of leased blocks come from other threads
        self._pulls: dict[str, _Pull] = {}
        self._arrived: list[_Pull] = []        # counted computed this step: written by ``load``
        # (tokens, bytes, seconds) of recent pulls: what the transfer costs (benchmarks)
        self.transfers: deque[tuple[int, int, float]] = deque(maxlen=1000)

    # -- scheduler half: prefill side --------------------------------------------------------
    def request_finished(self, req: Request) -> KVTransferParams | None:
        """Keep ``req``'s full prompt blocks for a peer if it asked (its blocks are freed by the
        scheduler right after: the lease holds its own reference)."""
        t = req.kv_transfer
        if t is None or not t.do_remote_decode or req.finish_reason != "length":
            return None
        bs = self.kv.block_size
        tokens = min(req.num_prompt_tokens - 1, req.num_computed_tokens) // bs * bs
        state = None
        if self.states:
            if req.num_computed_tokens != req.num_prompt_tokens:
                return None
            tokens, slot = req.num_prompt_tokens, self.kv.state_slot(req)
            state = torch.cat([t[slot].flatten().float() for layer in self.states for t in layer])
        blocks = self.kv.block_table(req)[:-(-tokens // bs)]
        self.release(req.request_id)             # a reused request id: its old lease goes
        self.kv.pool.touch(blocks)
        with self._lock:
            self._leases[req.request_id] = _Lease(blocks, self.clock() + self.lease_s, state)
        gen = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_request_id=req.request_id, remote_block_ids=tuple(blocks),
                                num_tokens=tokens, layout=self.layout,
                                lease_s=self.lease_s, generator_state=gen)

    def read(self, lease_id: str) -> torch.Tensor:
        """A copy of a lease's blocks and state as bytes (``KVLayout.pack``; any thread):
        ``KeyError`` if it is gone."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise KeyError(f"KV lease {lease_id!r} of {self.engine_id} expired or was released")
            return self.layout.pack(self.pool[:, :, lease.blocks], lease.state)

    def release(self, lease_id: str) -> bool:
        """The peer has the blocks (or gave up): return them to the pool. False if unknown."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.kv.pool.release(lease.blocks[::-1])
        return True

    def expire(self) -> int:
        """Release every lease past its time; how many."""
        now = self.clock()
        with self._lock:
            gone = [k for k, lease in self._leases.items() if lease.expires <= now]
        for k in gone:
            log.warning("KV lease %s expired before the peer took its blocks", k)
            self.release(k)
        return len(gone)

    @property
    def num_leased_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.blocks) for lease in self._leases.values())

    # -- scheduler half: decode side ---------------------------------------------------------
    def check(self, t: KVTransferParams) -> None:
        """Refuse, when it is added, a request this engine could not pull for."""
        if (t.do_remote_prefill or t.do_remote_decode) and self.kv.num_groups > 1:
            raise RequestRejected("kv_transfer_params: this engine's K/V are in groups of layers "
                                  "(sliding and full), which do not move between engines")
        if t.do_remote_prefill and self.transport is None:
            raise RequestRejected("kv_transfer_params: this engine has no KV transport to pull from")
        if t.do_remote_prefill and t.layout != self.layout:
            raise RequestRejected(f"kv_transfer_params: the peer's KV layout {t.layout} is not "
                                  f"this engine's {self.layout}")

    def external_tokens(self, req: Request) -> int:
        """Tokens of ``req`` a peer holds: its full blocks, never the last token (whose logits
        must be computed here)."""
        t = req.kv_transfer
        if t is None or not t.do_remote_prefill or self.transport is None:
            return 0
        bs = self.kv.block_size
        if self.states:              # the whole prompt and its state, or nothing
            whole = t.num_tokens == req.num_tokens - 1 and len(t.remote_block_ids) == -(-t.num_tokens // bs)
            return t.num_tokens if whole else 0
        n = min(t.num_tokens, len(t.remote_block_ids) * bs, (req.num_tokens - 1) // bs * bs)
        return n

    def start_pull(self, req: Request, n_tokens: int) -> None:
        """Ask the peer for ``req``'s first ``n_tokens`` (blocks already allocated here)."""
        assert self.transport is not None and req.kv_transfer is not None
        t = req.kv_transfer
        nb = -(-n_tokens // self.kv.block_size)
        want = KVTransferParams(**{**t.__dict__, "remote_block_ids": t.remote_block_ids[:nb],
                                   "num_tokens": n_tokens})
        try:
            ticket = self.transport.fetch(want)
        except Exception as exc:                # a dead peer may fail at once
            ticket = exc
        self._pulls[req.request_id] = _Pull(req, self.kv.block_table(req)[:nb], want, ticket,
                                            self.clock())

    @property
    def pulling(self) -> bool:
        return bool(self._pulls)

    def pulled(self) -> PullResults:
        """Pulls that completed or failed since the last call."""
        out = PullResults()
        now = self.clock()
        for rid, p in list(self._pulls.items()):
            why = None
            try:
                if isinstance(p.ticket, Exception):
                    raise p.ticket
                raw = self.transport.poll(p.ticket)     # type: ignore[union-attr]
                if raw is None and now - p.started > self.load_timeout_s:
                    why = f"the KV blocks did not arrive within {self.load_timeout_s:g} s"
                elif raw is not None:
                    blocks, state = self.layout.unpack(raw, len(p.block_ids))
                    why = self._check(blocks, len(p.block_ids))
                    if why is None:
                        p.blocks, p.state = blocks, state
            except Exception as exc:
                why = f"pulling the KV blocks from {p.params.remote_engine_id} failed: {exc}"
            if why is None and p.blocks is None:
                continue
            del self._pulls[rid]
            self._ack(p.params)
            if why is not None:
                log.warning("request %s: %s", rid, why)
                out.failed.append((p.req, why))
            else:
                assert p.blocks is not None
                self.transfers.append((p.params.num_tokens, p.blocks.numel() * p.blocks.element_size(),
                                       now - p.started))
                self._arrived.append(p)
                out.ready.append((p.req, p.params.num_tokens))
        return out

    def cancel(self, req: Request) -> None:
        """``req`` ended (aborted, failed) while its pull was open: tell the peer."""
        p = self._pulls.pop(req.request_id, None)
        if p is not None:
            self._ack(p.params)
        self._arrived = [a for a in self._arrived if a.req is not req]

    def wait(self, seconds: float) -> None:
        """Nothing to compute but pulls in flight: let them progress instead of spinning."""
        self.sleep(seconds)

    def _check(self, blocks: torch.Tensor, n: int) -> str | None:
        want = (self.layout.num_layers, self.layout.planes, n, self.layout.num_kv_heads, self.layout.block_size,
                tuple(self.pool.shape)[-1])
        if tuple(blocks.shape) != want:
            return f"the peer sent K/V of shape {tuple(blocks.shape)}, expected {want}"
        return None

    def _ack(self, params: KVTransferParams) -> None:
        try:
            self.transport.ack(params)      # type: ignore[union-attr]
        except Exception as exc:             # the peer is gone: its lease ends it anyway
            log.warning("acknowledging %s to %s failed: %s", params.remote_request_id,
                        params.remote_engine_id, exc)

    # -- worker half -------------------------------------------------------------------------
    def load(self) -> None:
        """Write the blocks that arrived into the pool, before the step that counts them."""
        for p in self._arrived:
            assert p.blocks is not None
            self.pool[:, :, p.block_ids] = p.blocks.to(self.pool.device, self.pool.dtype)
            if p.state is not None:
                slot, at = self.kv.state_slot(p.req), 0
                for layer in self.states:
                    for t in layer:
                        n = t[slot].numel()
                        t[slot] = p.state[at:at + n].view(t.shape[1:]).to(t.device, t.dtype)
                        at += n
        self._arrived = []


def layout_of(pool: torch.Tensor, states: tuple[tuple[torch.Tensor, ...], ...] = ()) -> KVLayout:
    """The layout of a pool ``[layers, planes, num_blocks, kv_heads, block_size, head_dim]`` and
    of the state layers' tensors beside it (a row a slot)."""
    layers, planes, _, heads, block_size, row = pool.shape
    fmt = kv_format_of(pool.dtype)
    state = sum(t[0].numel() * 4 for layer in states for t in layer)
    return KVLayout(layers, heads, fmt.head_dim(row), block_size, fmt.name, state, planes)


class LocalTransport:
    """Peers in this process, stepped on one thread (tests): a pull is a copy between pools.
    ``fail`` (a message) makes every pull fail, as a dead peer's would."""

    def __init__(self, peers: dict[str, KVConnector] | None = None):
        self.peers = dict(peers or {})
        self.fail: str | None = None
        self.hold = False                    # pulls never arrive (a stalled peer)

    def fetch(self, params: KVTransferParams) -> Any:
        if self.fail is not None:
            raise ConnectionError(self.fail)
        peer = self.peers[str(params.remote_engine_id)]
        return peer.read(str(params.remote_request_id))

    def poll(self, ticket: Any) -> torch.Tensor | None:
        return None if self.hold else ticket

    def ack(self, params: KVTransferParams) -> None:
        peer = self.peers.get(str(params.remote_engine_id))
        if peer is not None:
            peer.release(str(params.remote_request_id))
