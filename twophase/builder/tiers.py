"""The host and disk tiers below the pool (``[cache.offload]``): their store, filed under the
fingerprint of what produces this engine's K/V, and the root every block key starts from."""

from __future__ import annotations

from pathlib import Path

from twophase.cache.fingerprint import cache_fingerprint, model_identity, root_hash
from twophase.cache.layout import PoolLayout
from twophase.cache.pool_blocks import PoolBlocks, StateRows
from twophase.cache.tiers import TieredStore
from twophase.config import Config
from twophase.contract import KVCache, ModelSpec
from twophase.core.kv_manager import KVManager
from twophase.errors import ConfigError


def fingerprint(config: Config, spec: ModelSpec, layout: PoolLayout, kv_cache: KVCache,
                backends: tuple[str, ...]) -> bytes:
    """What produced a block's K/V: the weights (their files, or a random model's seed), their
    format, the backends that compute it (their rounding differs), the K/V format and the pool's
    shape. A different one of any never reads another's blocks."""
    weights = Path(spec.weights) if spec.weights != "random" else None
    model = model_identity(weights) if weights is not None and weights.exists() else \
        {"model_id": spec.model_id, "weights": spec.weights, "seed": spec.seed}
    pool = kv_cache.pool
    return cache_fingerprint(
        model=model, backends=list(backends),
        weights_format=[str(spec.dtype), spec.quantization, spec.accuracy_level, spec.outlier_channels],
        kv_format=[str(pool.dtype), config.cache.dtype], block_size=layout.block_size,
        layout={"pool": list(pool.shape[:2]) + list(pool.shape[3:]), "windows": list(layout.windows),
                "states": [[str(t.dtype), *t.shape[1:]] for s in kv_cache.states for t in s]},
        tokenizer=spec.model_id, adapter=None)        # an adapter roots its requests' chains itself


def use_tiers(config: Config, spec: ModelSpec, layout: PoolLayout, kv_cache: KVCache, kv: KVManager,
              backends: tuple[str, ...]) -> TieredStore | None:
    """The tiers, set on ``kv``; None where ``[cache.offload]`` sets none. What they cannot hold
    yet is refused by name."""
    off = config.cache.offload
    if not off.enabled:
        return None
    if not config.cache.prefix_caching:
        raise ConfigError("cache.offload", "needs cache.prefix_caching: the tiers keep cached prefixes")
    if kv_cache.pool.device.type == "meta":
        raise ConfigError("cache.offload", "the backends keep their own pool: the tiers read and "
                                           "write the engine's")
    fp = fingerprint(config, spec, layout, kv_cache, backends)
    store = TieredStore.from_config(off, fp)
    kv.use_tiers(store, PoolBlocks(kv_cache.pool), root_hash(fp),
                 StateRows(kv_cache.states) if kv_cache.states else None)
    return store
