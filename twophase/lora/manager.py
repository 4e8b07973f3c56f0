"""Which adapters are known, which are resident, and which slot each resident one holds.

A fixed number of slots (``max_loras``) hold adapters' deltas beside the model; the rest are
known by name and path and read from disk on first use. A request holds its adapter's slot
from admission to its end; a slot whose adapter no request holds is given up least recently
used first when another adapter needs one. Where every slot is held, a request for another
adapter waits (the scheduler tries again); loading one then is refused with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twophase.lora.peft_adapter import WEIGHTS, AdapterError, LoraAdapter

log = logging.getLogger(__name__)

Loader = Callable[[str, Path], LoraAdapter]          # read and check an adapter for this model
Placer = Callable[[int, LoraAdapter | None], None]   # put its deltas in a slot (None: empty it)


@dataclass
class AdapterStats:
    served: int = 0                  # requests that ran with it
    loads: int = 0                   # times it was read from disk
    load_s: float = 0.0              # seconds those reads took (with placing it in its slot)


@dataclass
class _Resident:
    adapter: LoraAdapter
    slot: int
    holders: int = 0                 # requests holding its slot now


@dataclass
class LoraManager:
    loader: Loader
    placer: Placer
    max_loras: int = 4
    known: dict[str, Path] = field(default_factory=dict)
    stats: dict[str, AdapterStats] = field(default_factory=dict)
    _resident: OrderedDict[str, _Resident] = field(default_factory=OrderedDict)   # LRU first
    _held: dict[str, tuple[str, int]] = field(default_factory=dict)   # request id -> (adapter, slot)

    def register(self, name: str, path: str | Path, load_now: bool = False) -> None:
        """Make ``name`` known (checked now where ``load_now``: a bad adapter fails here, not
        on its first request)."""
        if not name or name != name.strip():
            raise AdapterError(f"adapter name {name!r} is not a name")
        if name in self.known:
            raise AdapterError(f"an adapter named {name!r} is already loaded: unload it first")
        self.known[name] = Path(path)
        self.stats.setdefault(name, AdapterStats())
        if load_now:
            try:
                self._load(name)
            except BaseException:
                del self.known[name]
                raise

    def unregister(self, name: str) -> None:
        """Forget ``name``; refused while a request holds it."""
        if name not in self.known:
            raise AdapterError(f"no adapter named {name!r}", not_found=True)
        r = self._resident.get(name)
        if r is not None and r.holders:
            raise AdapterError(f"adapter {name!r} is serving {r.holders} request(s): unload it "
                               "when they are done")
        if r is not None:
            self.placer(r.slot, None)
            del self._resident[name]
        del self.known[name]

    def cache_root(self, name: str) -> bytes:
        """Where the hash chain of blocks computed with ``name`` starts: its name and its file
        as it is now, so blocks of an adapter replaced under the same name are never reused."""
        path = self.known[name]
        try:
            st = (path / WEIGHTS).stat()
            mark = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            mark = "?"
        return hashlib.sha256(f"lora\0{name}\0{path.resolve()}\0{mark}".encode()).digest()

    # -- what the KV manager asks (``SeqSlots``): a sequence holds its adapter's slot while it
    # holds blocks
    def hold(self, seq: Any) -> bool:
        name = getattr(seq, "lora", None)
        if name is None or seq.request_id in self._held:
            return True
        if not self.can_acquire(name):
            return False
        self._held[seq.request_id] = (name, self.acquire(name))
        return True

    def drop(self, seq: Any) -> None:
        held = self._held.pop(seq.request_id, None)
        if held is not None:
            self.release(held[0])

    def slot(self, seq: Any) -> int:
        held = self._held.get(seq.request_id)
        return -1 if held is None else held[1]

    def busy(self, name: str) -> int:
        """Requests holding ``name``'s slot now."""
        r = self._resident.get(name)
        return 0 if r is None else r.holders

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def slot_of(self, name: str) -> int | None:
        r = self._resident.get(name)
        return None if r is None else r.slot

    def can_acquire(self, name: str) -> bool:
        """Whether ``acquire`` would find a slot now (resident, a free slot, or one to give up)."""
        return (name in self._resident or len(self._resident) < self.max_loras
                or any(r.holders == 0 for r in self._resident.values()))

    def acquire(self, name: str) -> int:
        """The slot of ``name`` for one more request, loaded if need be."""
        if name not in self.known:
            raise AdapterError(f"no adapter named {name!r} (known: {', '.join(sorted(self.known)) or 'none'})",
                               not_found=True)
        r = self._resident.get(name) or self._load(name)
        self._resident.move_to_end(name)
        r.holders += 1
        self.stats[name].served += 1
        return r.slot

    def release(self, name: str) -> None:
        r = self._resident.get(name)
        if r is not None and r.holders > 0:
            r.holders -= 1

    def _load(self, name: str) -> _Resident:
        if name in self._resident:
            return self._resident[name]
        slot = self._free_slot(name)
        start = time.perf_counter()
        adapter = self.loader(name, self.known[name])
        self.placer(slot, adapter)
        st = self.stats[name]
        st.loads += 1
        st.load_s += time.perf_counter() - start
        log.info("adapter %s loaded into slot %d (rank %d, %.1f MiB) in %.3f s", name, slot,
                 adapter.rank, adapter.nbytes / 2 ** 20, time.perf_counter() - start)
        self._resident[name] = r = _Resident(adapter, slot)
        return r

    def _free_slot(self, name: str) -> int:
        used = {r.slot for r in self._resident.values()}
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        idle = next((n for n, r in self._resident.items() if r.holders == 0), None)
        if idle is None:
            raise AdapterError(f"all {self.max_loras} adapter slots (lora.max_loras) serve running "
                               f"requests: {name!r} cannot be loaded now", busy=True)
        slot = self._resident.pop(idle).slot
        self.placer(slot, None)
        log.info("adapter %s left slot %d for %s", idle, slot, name)
        return slot
