"""The waiting queue, in the order its requests start: by priority (the lower value first, as
vLLM takes it), then first come, first served. A preempted request (or a choice its parent could
not fork) goes back in front of the waiting requests of its own priority (it started before
them), behind any of higher priority.

Each request is kept with its key (priority, place): arrivals take increasing places, preempted
requests decreasing ones before every arrival. A request that goes last or first among those
queued costs O(1), so with equal priorities the queue is a plain deque (arrivals appended,
preempted requests put at its head); one that goes between others is placed by bisection.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from twophase.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._reqs: deque[Request] = deque()
        self._keys: deque[tuple[int, int]] = deque()      # (priority, place), ascending
        self._arrivals = itertools.count()                 # behind everyone of their priority
        self._returns = itertools.count(-1, -1)            # in front of everyone of theirs

    def add(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` at its place: after the waiting requests of its priority, or before
        them at the ``front`` (a preempted request: it started before them)."""
        key = (req.priority, next(self._returns if front else self._arrivals))
        if not self._keys or key > self._keys[-1]:
            self._keys.append(key)
            self._reqs.append(req)
        elif key < self._keys[0]:
            self._keys.appendleft(key)
            self._reqs.appendleft(req)
        else:
            i = bisect.bisect(self._keys, key)
            self._keys.insert(i, key)
            self._reqs.insert(i, req)

    def popleft(self) -> Request:
        """Take the request that starts next."""
        self._keys.popleft()
        return self._reqs.popleft()

    def remove(self, req: Request) -> None:
        i = self._reqs.index(req)
        del self._reqs[i]
        del self._keys[i]

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)
