"""A backend benched in a process of its own, serving the same calls the bench makes of a line
in its own process: a sweep round, the serving workload.

Why: IREE's runtime keeps memory that each call with a new shape allocated. Measured with the
default model: about 160 MB more resident after each 512-token prefill (torch: none), 7.2 GB
after prefilling 32 prompts of 256 tokens. In the bench's process that crowds out every other
line and the HF baseline; in a process of its own it is the OS's again when the bench ends, and
the other lines' figures are not measured beside it. ``ISOLATED`` names such backends.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from twophase.bench.lines import bench_llm
from twophase.config import Config, SchedulerConfig

ISOLATED = frozenset({"iree"})


class IsolatedLine:
    def __init__(self, cfg: Config, name: str):
        self.name = name
        ctx = multiprocessing.get_context("spawn")       # a clean interpreter: no forked threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, cfg, name), daemon=True,
                                 name=f"twophase-bench-{name}")
        self._proc.start()
        child.close()
        self.load_time_s: float = self._reply()

    def prefill_round(self, n: int, depth: int, salt: int) -> float:
        return self._call("prefill", n, depth, salt)

    def decode_round(self, batch: int, context: int, steps: int, salt: int) -> float:
        return self._call("decode", batch, context, steps, salt)

    def serve(self, scheduler: SchedulerConfig, requests: list) -> dict[str, Any]:
        return self._call("serve", scheduler, requests)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()
        self._conn.close()

    def _call(self, what: str, *args: Any) -> Any:
        self._conn.send((what, args))
        return self._reply()

    def _reply(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=5)
            raise RuntimeError(f"the {self.name} line's process ended (exit code "
                               f"{self._proc.exitcode})") from None
        if not ok:
            raise RuntimeError(f"{self.name} (in its own process): {value}")
        return value


def _worker(conn, cfg: Config, name: str) -> None:
    from twophase.bench import serving, sweeps

    try:
        llm = bench_llm(cfg, name)
    except Exception as exc:
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, llm.load_time_s))
    calls = {"prefill": lambda *a: sweeps.prefill_round(llm, *a),
             "decode": lambda *a: sweeps.decode_round(llm, *a),
             "serve": lambda scheduler, requests: (llm.reschedule(scheduler),
                                                   serving.run(llm.engine, requests))[1]}
    while True:
        what, args = conn.recv()
        if what == "stop":
            llm.close()
            return
        try:
            conn.send((True, calls[what](*args)))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))
