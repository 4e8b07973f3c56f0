"""Prometheus metrics of a server: one registry per app (tests start several servers)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MEMORY = {"kv_cache_bytes": "bytes of the KV pool", "kv_tokens": "tokens the KV pool holds",
          "max_concurrency": "sequences of max_model_len tokens the KV pool holds at once",
          "weight_bytes": "bytes of the model's weights",
          "headroom_bytes": "bytes the device had left after the KV pool, at start-up"}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# a token's time: 1 ms (a GPU's decode step) to 1 s (a large model on a CPU)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    def __init__(self, extra: Callable[[], str] | None = None) -> None:
        """``extra``: the engines' figures from elsewhere (workers on Ray, each labelled): this
        server then exposes its HTTP figures only, and ``extra``'s engine figures after them."""
        self.extra = extra
        self.registry = CollectorRegistry()
        self.requests = Counter("twophase_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        # the engine's figures: exposed here only when the engine is here
        r = self.registry if extra is None else CollectorRegistry()
        self.ttft = Histogram("twophase_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("twophase_time_per_output_token_seconds",
                              "mean gap between a request's output tokens", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("twophase_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_tokens = Counter("twophase_prefill_tokens", "prompt tokens computed", registry=r)
        self.decode_tokens = Counter("twophase_decode_tokens", "tokens decoded", registry=r)
        self.preemptions = Counter("twophase_preemptions", "requests preempted for KV blocks",
                                   registry=r)
        self.recomputed = Counter("twophase_recomputed_tokens", "computed tokens preemptions threw "
                                  "away (to be computed again)", registry=r)
        self.draft_tokens = Counter("twophase_spec_draft_tokens", "speculative tokens verified",
                                    registry=r)
        self.accepted_tokens = Counter("twophase_spec_accepted_tokens",
                                       "speculative tokens the target kept", registry=r)
        self.decode_batch = Histogram("twophase_step_decode_sequences",
                                      "sequences decoding in one engine step",
                                      buckets=BATCH_BUCKETS, registry=r)
        self.running = Gauge("twophase_requests_running", "requests being computed", registry=r)
        self.waiting = Gauge("twophase_requests_waiting", "requests queued in the scheduler",
                             registry=r)
        self.kv_used = Gauge("twophase_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.finished_requests = Counter("twophase_requests_finished",
                                         "requests the engine finished (any reason)", registry=r)
        self.prefix_hit_rate = Gauge("twophase_prefix_cache_hit_rate",
                                     "prompt tokens found in the prefix cache, as a fraction",
                                     registry=r)
        self.lora_resident = Gauge("twophase_lora_resident", "1 where the adapter is resident in a "
                                   "slot, 0 where it waits on disk", ["adapter"], registry=r)
        self.lora_requests = Gauge("twophase_lora_requests_served", "requests served with the adapter "
                                   "since it was loaded", ["adapter"], registry=r)
        self.kv_tiers = Gauge("twophase_kv_tier", "the K/V host and disk tiers' counters (hits, "
                              "bytes in and out, blocks and bytes held, restored blocks, evictions)",
                              ["tier", "counter"], registry=r)
        self.kv_restore_seconds = Gauge("twophase_kv_tier_restore_seconds", "seconds spent reading "
                                        "blocks back from the tiers", registry=r)
        self.kv_offload_seconds = Gauge("twophase_kv_tier_offload_seconds", "seconds steps spent "
                                        "handing evicted blocks down to the tiers", registry=r)
        self.kv_total = Gauge("twophase_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.memory = {key: Gauge(f"twophase_{key}", what, registry=r) for key, what in MEMORY.items()}

    def exposition(self) -> bytes:
        """What ``/metrics`` answers."""
        text = generate_latest(self.registry)
        return text + self.extra().encode() if self.extra is not None else text

    def loaded(self, memory: dict[str, int]) -> None:
        """What the memory is for, as the start-up log line says it (``LLM.memory``)."""
        for key, gauge in self.memory.items():
            gauge.set(memory[key])

    def step(self, rec) -> None:
        """After each engine step (on the engine's thread)."""
        self.prefill_tokens.inc(rec.prefill_tokens)
        self.decode_tokens.inc(rec.decode_tokens)
        self.preemptions.inc(rec.preemptions)
        self.recomputed.inc(rec.recomputed_tokens)
        self.draft_tokens.inc(rec.draft_tokens)
        self.accepted_tokens.inc(rec.accepted_tokens)
        if rec.decode_seqs:
            self.decode_batch.observe(rec.decode_seqs)

    def refresh(self, stats, adapters=None, tiers=None) -> None:
        """The gauges from the engine's ``EngineStats`` (and its ``LoraManager`` and K/V tiers'
        counters), after every step and every batch of commands (aborts included)."""
        if tiers is not None:
            for key, value in tiers.items():
                tier, _, what = key.partition("_")
                if tier in ("host", "disk"):
                    self.kv_tiers.labels(tier=tier, counter=what).set(value)
            self.kv_restore_seconds.set(tiers.get("restore_seconds", 0.0))
            self.kv_offload_seconds.set(tiers.get("offload_seconds", 0.0))
        if adapters is not None:
            self.lora_resident.clear()
            self.lora_requests.clear()
            for name in adapters.known:
                self.lora_resident.labels(adapter=name).set(int(adapters.slot_of(name) is not None))
                self.lora_requests.labels(adapter=name).set(adapters.stats[name].served)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.used_blocks)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)

    def finished(self, output) -> None:
        """A request's latencies, from its ``RequestOutput``."""
        self.finished_requests.inc()
        t = output.times
        if t is None:
            return
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        if t.tpot is not None:
            self.tpot.observe(t.tpot)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
