"""The engine over a laid-out pool: its KV manager, scheduler, proposer (speculative decoding)
and KV connector, from the config's scheduler and speculative settings."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from twophase.builder.backends import Backends
from twophase.builder.tiers import use_tiers
from twophase.cache.layout import PoolLayout
from twophase.config import Config
from twophase.contract import KVCache, ModelArch, ModelSpec
from twophase.core.draft_proposer import DraftProposer
from twophase.core.engine import Engine
from twophase.core.kv_manager import KVManager, SeqSlots
from twophase.core.kv_transfer import KVConnector, layout_of
from twophase.core.ngram import NgramProposer
from twophase.core.pooling import PoolingConfig
from twophase.core.proposer import Proposer
from twophase.core.scheduler import Scheduler
from twophase.core.spec_control import SpecController
from twophase.errors import ConfigError

log = logging.getLogger(__name__)

AUTO_MAX_DRAFTS = 6          # the most drafts num_tokens = "auto" gives a decode


def make_engine(config: Config, layout: PoolLayout, kv_cache: KVCache, backends: Backends, arch: ModelArch,
                tokenizer, draft: Callable[[], tuple[Backends, int]] | None, owner: str,
                clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                adapters: SeqSlots | None = None, spec: ModelSpec | None = None,
                pooling: PoolingConfig | None = None) -> Engine:
    """An engine with a fresh scheduler and prefix cache over ``kv_cache``. ``draft``: loads the
    draft model once, giving its backends and pool blocks (``method = "draft"``). ``adapters``:
    the LoRA adapters' slots (one ``LoraManager`` for every engine over these backends).
    ``spec``: the model's, for the tiers' fingerprint (``[cache.offload]``). ``pooling``: the
    model folder's embedding config, where it ships one."""
    sc, cc = config.scheduler, config.cache
    budget, max_seqs = layout.token_budget, layout.max_num_seqs
    if sc.policy == "decode-first" and layout.chunked_prefill and budget <= max_seqs:
        raise ConfigError("scheduler.max_num_batched_tokens",
                          f"{budget} must exceed scheduler.max_num_seqs ({max_seqs})")
    sp = config.speculative
    prefix_caching = cc.prefix_caching
    if layout.state is not None:
        fmt = getattr(layout.specs[0], "format", layout.state.dtype)
        if fmt != layout.state.dtype:
            log.info("cache.dtype %s holds the attention layers' K/V; the %d state layers keep their state in %s "
                     "(a recurrence accumulates in it)", fmt, layout.state.num_layers, layout.state.dtype)
        if prefix_caching and not layout.state_snapshots:
            log.info("prefix caching off: a hit restores the state layers' state saved at the prefix's end, "
                     "and cache.state_snapshots is 0")
            prefix_caching = False
    kv = KVManager(layout.num_blocks, cc.block_size, prefix_caching, layout.specs, layout.state_slots,
                   layout.state_snapshots, cc.state_snapshot_every, verify_rows=layout.state_verify_rows)
    kv.adapters = adapters
    if spec is not None:
        phases = config.phases()
        use_tiers(config, spec, layout, kv_cache, kv, (phases[0].name, phases[1].name))
    proposer: Proposer | None = None
    if sp.method == "ngram":
        proposer = NgramProposer(sp.prompt_lookup_min, sp.prompt_lookup_max)
    elif sp.method == "draft":
        assert draft is not None, "a draft model's loader comes with method = 'draft'"
        d, blocks = draft()
        proposer = DraftProposer(d.prefill, d.decode, KVManager(blocks, cc.block_size, prefix_caching=False),
                                 tuple(arch.eos_token_ids), budget)
    auto = sp.num_tokens == "auto"
    k = AUTO_MAX_DRAFTS if auto else int(sp.num_tokens)
    cl = config.cluster
    connector = KVConnector(f"{socket.gethostname()}:{os.getpid()}:{owner}", kv, kv_cache.pool,
                            layout_of(kv_cache.pool, kv_cache.states), lease_s=cl.kv_lease_s,
                            load_timeout_s=cl.kv_load_timeout_s, on_failure=cl.kv_load_failure, clock=clock,
                            sleep=sleep, states=kv_cache.states)
    scheduler = Scheduler(kv, max_seqs, budget, sc.policy, layout.chunked_prefill,
                          max_model_len=layout.max_model_len, eos_token_ids=tuple(arch.eos_token_ids),
                          vocab_size=arch.vocab_size, proposer=proposer, num_spec_tokens=k,
                          spec_control=SpecController(k) if auto else None,
                          reserve=sc.admission == "reserve", connector=connector)
    return Engine(backends.prefill, backends.decode, scheduler, tokenizer, vocab_size=arch.vocab_size, clock=clock,
                  decode_routes=backends.routes, pooling=pooling)
