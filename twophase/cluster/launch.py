"""Start the engines on Ray and stop them: a local Ray cluster (or the one at
``cluster.address``), the metrics board, and either the replicas' Serve deployment or the
prefill and decode workers. The workers' KV layouts are compared before anything is served: a
prefill worker whose blocks a decode worker could not take is refused here, by name."""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from twophase.cluster.board import BOARD, MetricsBoard, labelled
from twophase.config import Config
from twophase.errors import ConfigError, TwophaseError, install_hint

log = logging.getLogger(__name__)


def check_installed() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise TwophaseError(f"serving on a cluster needs Ray: {install_hint('cluster')}") from None


@dataclass(eq=False)
class Cluster:
    config: Config
    namespace: str
    board: Any
    handle: Any = None                                # the replicas' Serve deployment
    workers: dict[str, list[Any]] = field(default_factory=dict)   # role -> actors
    names: dict[str, list[str]] = field(default_factory=dict)
    busy: Counter = field(default_factory=Counter)    # requests in flight per worker
    prefixes: dict[str, Any] = field(default_factory=dict)   # role -> PrefixMap
    started_ray: bool = False
    info: dict[str, Any] = field(default_factory=dict)   # a worker's describe(): limits, layout

    @property
    def app_name(self) -> str:
        """The replicas' Serve application: one per server, beside others on a shared cluster."""
        return self.namespace

    @property
    def disaggregated(self) -> bool:
        return bool(self.workers)

    def pick(self, role: str, tokens: list[int] | None = None) -> Any:
        """The worker of ``role`` with the fewest of this frontend's requests in flight; given a
        prompt's ``tokens``, the one sent its deepest known prefix (its prefix cache likely holds
        it) unless that one has more than ``route_imbalance`` requests beyond the least busy:
        the replicas' routing rule (``affinity.py``)."""
        from twophase.cluster.affinity import PrefixMap, pick

        return pick(self.workers[role], lambda w: self.busy[w], self.prefixes.setdefault(role, PrefixMap()),
                    self.config.cluster.route_imbalance, tokens, self.config.cache.block_size)

    def tokenizer(self):
        """The model's tokenizer, for the frontend (no weights are loaded here)."""
        from twophase.models import loader

        return loader.resolve(self.config.model.source(), "cpu").tokenizer

    def kv_states(self) -> dict[str, dict[str, int]]:
        """Each worker's blocks in use and leased (the replicas': through Serve, one each)."""
        import ray

        return {name: s for role in self.workers for name, s in zip(
            self.names[role], ray.get([w.kv_state.remote() for w in self.workers[role]]))}

    def metrics_text(self) -> str:
        import ray

        return labelled(ray.get(self.board.collect.remote(), timeout=5))

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if self.handle is not None:
            try:                          # on a cluster we joined, only our own application
                serve.shutdown() if self.started_ray else serve.delete(self.app_name)
            except Exception:
                log.exception("stopping Ray Serve failed")
        for actors in self.workers.values():
            for a in actors:
                ray.kill(a)
        ray.kill(self.board)
        if self.started_ray:
            ray.shutdown()


def role_config(cfg: Config, role: str) -> Config:
    """A worker's config: its role's backend section where ``[cluster]`` names one."""
    section = getattr(cfg.cluster, f"{role}_backend", None) if role in ("prefill", "decode") else None
    return dataclasses.replace(cfg, backend=section) if section is not None else cfg


def start(cfg: Config) -> Cluster:
    check_installed()
    import ray

    c = cfg.cluster
    namespace = f"twophase-{uuid.uuid4().hex[:8]}"
    threads = c.threads or 1
    cpus = (c.prefill_workers * (c.prefill_threads or threads) + c.decode_workers * (c.decode_threads or threads)
            if c.disaggregated else c.replicas * threads)
    started = not ray.is_initialized()
    if started:
        env = {k: v for k, v in os.environ.items() if k.startswith("TWOPHASE_")}
        env["OMP_NUM_THREADS"] = str(threads)
        # Ray starts workers at nice 15 (below its own daemons); engines serve at the priority
        # one engine in a process would have, and prefill_nice lowers prefill from there. The
        # raylet reads it from its environment, inherited at ray.init.
        saved = os.environ.get("RAY_worker_niceness")
        os.environ.setdefault("RAY_worker_niceness", "0")
        try:
            ray.init(address=c.address, namespace=namespace, include_dashboard=False,
                     num_cpus=None if c.address else max(os.cpu_count() or 1, cpus + 1),
                     runtime_env={"env_vars": env}, log_to_driver=False, logging_level=logging.WARNING)
        finally:
            if saved is None:
                os.environ.pop("RAY_worker_niceness", None)
    board = ray.remote(MetricsBoard).options(name=BOARD, namespace=namespace, num_cpus=0).remote()
    cluster = Cluster(cfg, namespace, board, started_ray=started)
    try:
        if c.disaggregated:
            _start_workers(cluster, threads)
        else:
            _start_replicas(cluster, threads)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _start_replicas(cluster: Cluster, threads: int) -> None:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from twophase.cluster.router import PrefixAffinityRouter
    from twophase.cluster.workers import EngineReplica

    c = cluster.config.cluster
    serve.start(proxy_location="Disabled")
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                 request_router_kwargs={"block_size": cluster.config.cache.block_size,
                                                        "imbalance": c.route_imbalance})
    app = EngineReplica.options(num_replicas=c.replicas, request_router_config=router,
                                max_ongoing_requests=cluster.config.server.max_queue,
                                ray_actor_options={"num_cpus": threads}).bind(
        cluster.config, threads, cluster.namespace)
    log.info("starting %d engine replicas on Ray Serve", c.replicas)
    cluster.handle = serve.run(app, name=cluster.app_name, route_prefix=None)
    cluster.info = cluster.handle.describe.remote().result()


def _start_workers(cluster: Cluster, threads: int) -> None:
    import ray

    from twophase.cluster.workers import EngineWorker

    c = cluster.config.cluster
    actor = ray.remote(EngineWorker)
    for role, n in (("prefill", c.prefill_workers), ("decode", c.decode_workers)):
        names = [f"twophase-{role}-{i}" for i in range(n)]
        role_threads = getattr(c, f"{role}_threads") or threads
        nice = c.prefill_nice if role == "prefill" else 0
        cluster.names[role] = names
        cluster.workers[role] = [
            # supervised: Ray starts a worker that dies again (its requests in flight get an
            # error; requests sent meanwhile wait for it)
            actor.options(name=name, namespace=cluster.namespace, num_cpus=role_threads,
                          max_concurrency=1000, max_restarts=-1, max_task_retries=0).remote(
                role_config(cluster.config, role), name, role_threads, cluster.namespace, role == "decode", nice)
            for name in names]
    log.info("starting %d prefill and %d decode workers on Ray", c.prefill_workers, c.decode_workers)
    described = {name: d for role in ("prefill", "decode") for name, d in zip(
        cluster.names[role], ray.get([w.describe.remote() for w in cluster.workers[role]]))}
    check_layouts(described)
    cluster.info = next(iter(described.values()))


def check_layouts(described: dict[str, dict[str, Any]]) -> None:
    """Every worker's KV layout must equal the first's: a decode worker writes a prefill
    worker's blocks as they are."""
    (first, ref), *rest = described.items()
    for name, d in rest:
        if d["layout"] != ref["layout"]:
            diff = ", ".join(f"{f.name} {getattr(ref['layout'], f.name)} vs {getattr(d['layout'], f.name)}"
                             for f in dataclasses.fields(ref["layout"])
                             if getattr(ref["layout"], f.name) != getattr(d["layout"], f.name))
            raise ConfigError("cluster", f"the KV layouts of {first} and {name} differ ({diff}): "
                                         f"a decode worker could not take the prefill worker's blocks")
