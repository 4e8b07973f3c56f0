"""A deployment of several engines on one virtual timeline: replicas behind the frontend's
prefix-affinity router, or prefill workers handing each prompt's K/V to decode workers.

Each engine is a ``SimulatedLLM`` with its own virtual clock. The loop always steps the engine
whose clock is earliest among those with work, and delivers an event (an arrival, a handoff)
once no busy engine is behind it, so every engine sees events in time order and no step begins
before the one that caused it. Requests are routed with the cluster's own rule
(``twophase/cluster/affinity.py``: deepest known prefix unless that engine has more than
``route_imbalance`` requests beyond the least loaded, else the least loaded) and handed over
with the engines' own KV connector: the prefill side keeps the prompt's blocks under a lease, the
decode side pulls them (``SimulatedTransport``: they arrive after the link's time for their bytes)
and acknowledges, as ``twophase serve``'s disaggregated workers do (``cluster/frontend.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from twophase.bench.serving import TimedRequest
from twophase.cluster.affinity import PrefixMap, pick
from twophase.cluster.launch import role_config
from twophase.config import ClusterConfig, Config
from twophase.core.handoff import continues_on_peer, first_token_params, joined, wants_decode_peer
from twophase.core.kv_transfer import KVConnector, KVTransferParams, LocalTransport
from twophase.core.metrics import StepRecord, phase_report
from twophase.core.outputs import RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError, RequestRejected
from twophase.simulate.driver import Run
from twophase.simulate.engine import SimulatedLLM


class SimulatedTransport(LocalTransport):
    """Pulls between engines of one simulation: the peer's blocks (shapes only: a ``meta``
    pool) arrive once the puller's clock passes the link's time for their bytes."""

    def __init__(self, clock: Callable[[], float], seconds: Callable[[float], float],
                 peers: dict[str, KVConnector]):
        super().__init__(peers)
        self.clock, self.seconds = clock, seconds

    def fetch(self, params: KVTransferParams) -> Any:
        blocks = super().fetch(params)
        return self.clock() + self.seconds(blocks.numel() * blocks.element_size()), blocks

    def poll(self, ticket: Any) -> torch.Tensor | None:
        ready, blocks = ticket
        return blocks if self.clock() >= ready else None


@dataclass(eq=False)
class Member:
    role: str                    # "replica", "prefill" or "decode"
    name: str
    llm: SimulatedLLM

    @property
    def clock(self) -> float:
        return self.llm.clock()

    @property
    def connector(self) -> KVConnector:
        c = self.llm.engine.connector
        assert c is not None, "LLM's engines have a KV connector"
        return c


def _alone(config: Config) -> Config:
    """A worker's own config: one engine, no cluster around it."""
    c = config.cluster
    return dataclasses.replace(config, cluster=ClusterConfig(
        kv_lease_s=c.kv_lease_s, kv_load_timeout_s=c.kv_load_timeout_s, kv_load_failure=c.kv_load_failure))


class Fleet:
    """The engines ``config.cluster`` asks for (``replicas``, or ``prefill_workers`` and
    ``decode_workers``), each over ``tp`` devices of ``device``."""

    def __init__(self, config: Config, device: Any, acceptance: float = 0.7, tp: int = 1):
        c = config.cluster
        self.config, self.device, self.tp = config, device, tp
        if (c.disaggregated or tp > 1) and device.link_bandwidth <= 0:
            raise ConfigError("--link-gbps", f"{device.name} has no figure for its link to a peer "
                                             f"device: give --link-gbps")
        if c.disaggregated:
            if c.prefill_workers < 1 or c.decode_workers < 1:
                raise ConfigError("cluster", "disaggregated serving needs prefill_workers and "
                                             "decode_workers, one or more each")
            if config.speculative.method != "none":
                raise ConfigError("speculative", "the simulator speculates on one engine or "
                                                 "replicas, not across prefill/decode workers")
            roles = [("prefill", c.prefill_workers), ("decode", c.decode_workers)]
        else:
            roles = [("replica", max(1, c.replicas))]
        self.members = [Member(role, f"{role}-{i}", SimulatedLLM(
            _alone(role_config(config, role)), device, acceptance=acceptance, tp=tp))
            for role, n in roles for i in range(n)]
        if c.disaggregated:
            try:                # what each request's handoff would meet: refused once, up front
                self.members[0].connector.check(KVTransferParams(do_remote_decode=True))
            except RequestRejected as exc:
                model = self.members[0].llm.model.model_id
                raise ConfigError("cluster", f"prefill/decode workers cannot serve {model}: {exc}") from None
            peers = {k.engine_id: k for k in (m.connector for m in self.by_role("prefill"))}
            for m in self.by_role("decode"):
                cost = m.llm.prefill_backend.cost
                assert cost is not None
                m.connector.transport = SimulatedTransport(m.llm.clock, cost.transfer_s, peers)
        first = self.members[0].llm
        self.model, self.max_model_len = first.model, first.max_model_len

    def by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    @property
    def devices(self) -> int:
        return len(self.members) * self.tp

    @property
    def num_blocks(self) -> int:
        return sum(m.llm.num_blocks for m in self.members)

    @property
    def backends(self) -> list[Any]:
        return [b for m in self.members for b in m.llm.backends]

    @property
    def steps(self) -> list[StepRecord]:
        """Every engine's steps, by start time."""
        return sorted((s for m in self.members for s in m.llm.engine.step_records()), key=lambda s: s.start)

    def report(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """``LLM.report``'s keys over the whole deployment: its steps on one timeline, the
        requests' latencies from arrival at the frontend to their last token."""
        if len(self.members) == 1:
            return self.members[0].llm.report(outputs)
        served = [o for o in outputs if o.times is not None]
        rep = phase_report(self.steps, [o.times for o in served if o.times is not None],
                           sum(len(o.token_ids) for o in served))
        stats = [m.llm.engine.stats() for m in self.members]
        rep["prefix_cache_hit_rate"] = (sum(s.prefix_hits for s in stats)
                                        / max(1, sum(s.prefix_queries for s in stats)))
        rep["kv_blocks_total"] = self.num_blocks
        rep["memory"] = self.members[0].llm.memory
        rep["load_time_s"] = sum(m.llm.load_time_s for m in self.members)
        rep["load_breakdown_s"] = {"simulated load": rep["load_time_s"]}
        p, d = self.config.phases()
        if self.config.cluster.disaggregated:
            p, d = role_config(self.config, "prefill").phases()[0], role_config(self.config, "decode").phases()[1]
        rep["backend"] = {"prefill": p.name, "decode": d.name, "device": p.device}
        return rep


def drive(fleet: Fleet, requests: list[TimedRequest]) -> Run:
    """Serve ``requests`` (arriving ``offset_s`` after 0) on the fleet until each has finished;
    outputs in the requests' order, the fleet's queue after each step."""
    return _Frontend(fleet, requests).run()


class _Frontend:
    """What ``twophase serve``'s frontend does for a fleet, on the virtual timeline: route each
    arrival, hand a finished prefill to a decode worker, join the two sides' outputs."""

    def __init__(self, fleet: Fleet, requests: list[TimedRequest]):
        if any(isinstance(r.prompt, str) for r in requests):
            raise ConfigError("--workload", "the simulator has no tokenizer: give prompt_token_ids")
        self.fleet = fleet
        self.prompts = [[int(t) for t in r.prompt] for r in requests]
        self.params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        self.load: Counter[str] = Counter()        # requests in flight per engine, as the frontend counts
        self.prefixes = PrefixMap()
        self.seq = itertools.count()
        self.events: list[tuple[float, int, str, int]] = [(r.offset_s, next(self.seq), "arrive", i)
                                                          for i, r in enumerate(requests)]
        heapq.heapify(self.events)
        self.owner: dict[str, int] = {}            # "engine/request id" -> the request's index
        self.firsts: dict[int, RequestOutput] = {}  # the prefill side's output, until decode ends
        self.done: dict[int, RequestOutput] = {}
        self.rejected: list[str] = []
        self.queue: list[tuple[float, int, int, int]] = []

    def run(self) -> Run:
        t0 = time.perf_counter()
        members = self.fleet.members
        while self.events or any(m.llm.engine.has_unfinished() for m in members):
            busy = [m for m in members if m.llm.engine.has_unfinished()]
            ahead = min((m.clock for m in busy), default=float("inf"))
            if self.events and self.events[0][0] <= ahead:     # no busy engine is behind it
                t, _, kind, i = heapq.heappop(self.events)
                self.arrive(t, i) if kind == "arrive" else self.hand_off(t, i)
            else:
                self.step(min(busy, key=lambda w: w.clock))
        done = self.done
        return Run([done[i] for i in sorted(done)], self.rejected, 0.0, time.perf_counter() - t0, self.queue)

    def arrive(self, t: float, i: int) -> None:
        f, prompt, p = self.fleet, self.prompts[i], self.params[i]
        entry = f.by_role("prefill" if f.config.cluster.disaggregated else "replica")
        m = pick(entry, lambda w: self.load[w.name], self.prefixes, f.config.cluster.route_imbalance,
                 prompt, f.config.cache.block_size)
        if m.role == "prefill":
            peer = KVTransferParams(do_remote_decode=True) if wants_decode_peer(p) else None
            self.send(m, t, i, first_token_params(p), kv_transfer=peer)
        else:
            self.send(m, t, i, p)

    def hand_off(self, t: float, i: int) -> None:
        first = self.firsts[i]
        kv = KVTransferParams.from_dict(first.kv_transfer_params or {})
        d = min(self.fleet.by_role("decode"), key=lambda w: self.load[w.name])
        self.send(d, t, i, self.params[i], kv_transfer=kv, first_token_ids=tuple(first.token_ids))

    def send(self, m: Member, t: float, i: int, params: SamplingParams, **kw: Any) -> None:
        m.llm.clock.now = max(m.llm.clock.now, t)      # an idle engine's clock catches up
        try:
            req = m.llm.engine.add_request(self.prompts[i], params, request_id=str(i),
                                           arrival=t, **kw)
        except RequestRejected as exc:
            self.rejected.append(str(exc))
            return
        self.owner[f"{m.name}/{req.request_id}"] = i
        self.load[m.name] += 1

    def step(self, m: Member) -> None:
        engine = m.llm.engine
        before = m.clock
        result = engine.step_with_record()
        for delta in result.deltas:
            if delta.output is not None:
                self.finished(m, delta.output)
        engine.expire_leases()                # as the server's loop does after each step
        if result.record is not None:
            stats = [w.llm.engine.stats() for w in self.fleet.members]
            self.queue.append((m.clock, sum(s.waiting for s in stats), sum(s.running for s in stats),
                               sum(s.used_blocks for s in stats)))
        elif m.clock == before:               # work it cannot schedule yet: wait for the next event
            if not self.events:
                raise RuntimeError(f"{m.name} has work but schedules none")
            m.llm.clock.now = max(m.llm.clock.now, self.events[0][0])

    def finished(self, m: Member, out: RequestOutput) -> None:
        self.load[m.name] -= 1
        i = self.owner.pop(f"{m.name}/{out.request_id}")
        if m.role == "prefill" and continues_on_peer(out):
            self.firsts[i] = out
            heapq.heappush(self.events, (m.clock, next(self.seq), "handoff", i))
        elif i in self.firsts:
            self.done[i] = joined(self.firsts.pop(i), out, self.params[i])
        else:
            self.done[i] = out
