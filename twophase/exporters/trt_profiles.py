"""TensorRT's optimisation profiles for the step graph, and the activation memory they imply.

TensorRT sizes an engine's kernels and activation memory for every dimension of a profile at its
maximum at once, and many of its layers refuse a tensor of more than 2^31 - 1 elements. The step
graph's attention materialises its scores, ``[C, H, Q, Wc * BS + Q]`` for chunks (each padded to
the longest, after its cached context) and ``[D, Wd * BS, H]`` for decodes, and gathers each row's
cached K/V: with every dimension at the engine's own limits (64 chunks of 4,096 queries over
131,072 keys for llama3-8b) that is terabytes. So the profiles form a ladder over the cached
context: each *rung* is one profile whose rows (chunks ``C`` of ``Q`` tokens, or decodes ``D``)
are as many as keep every tensor at most ``TILE`` elements over its context width ``W`` blocks;
a narrower rung holds more rows. The backend cuts each step into calls that fit a rung
(``twophase.backends.trt_calls``), so the attention runs block-wise over the context: never one
padded square for the whole batch.

Pure integer arithmetic (no tensorrt, no torch), so a memory planner can call ``profile_memory``
before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twophase.arch import ModelArch
from twophase.cache.layout import KVHeads
from twophase.contract import EngineLimits
from twophase.errors import ConfigError
from twophase.graph.signature import STEP

# TensorRT's per-tensor volume: not configurable, since many of its kernels address offsets in
# 32 bits. It binds the KV pool too, which only a Gather reads: no exemption is documented for it
ELEMENT_LIMIT = 2**31 - 1
TILE = 2**29                     # the largest tensor a rung may imply: a quarter of the limit
WORKSPACE_BYTES = 1 << 30        # the builder's tactic scratch, part of an engine's device memory
LADDER = 16                      # each rung's context width a sixteenth of the last one's
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]      # input name → (min, opt, max)


@dataclass(frozen=True)
class Rung:
    """One profile's maxima: ``rows`` chunks of up to ``chunk`` tokens (``phase = "prefill"``)
    or ``rows`` one-token decodes, each after at most ``blocks`` cached blocks, ``tokens`` in all."""

    phase: str
    rows: int
    chunk: int
    blocks: int
    tokens: int


def itemsize(dtype: Any) -> int:
    """Bytes of one element of ``dtype`` (a torch dtype or its name)."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ConfigError("model.dtype", f"TensorRT runs {', '.join(ITEMSIZE)}, not {name}")
    return ITEMSIZE[name]


def rung_tensors(arch: ModelArch, rung: Rung, block_size: int) -> dict[str, int]:
    """Elements of the largest tensors the step graph computes at ``rung``'s maxima, one layer's
    worth (TensorRT reuses activation memory from layer to layer)."""
    H, width = arch.num_heads, key_width(arch, rung.phase)
    keys = rung.blocks * block_size
    if rung.phase == "decode":
        attention = {"kv_gather": rung.rows * keys * width, "scores": rung.rows * keys * H}
    else:
        attention = {"kv_gather": rung.rows * (keys + rung.chunk) * width,
                     "scores": rung.rows * H * rung.chunk * (keys + rung.chunk)}
    T = rung.tokens
    return {**attention, "qkv": T * (H + 2 * arch.num_kv_heads) * arch.head_dim, "mlp": T * mlp_width(arch),
            "logits": T * arch.vocab_size}


def mlp_width(arch: ModelArch) -> int:
    """A token's widest MLP activation in any layer: gate and up; where the graph runs every
    expert on every token (``exporters.tensorrt.MOE_FORM``) each expert's gate and up, or its
    input and output (``[E, T, hidden]``, the wider where hidden is), and a shared one's."""
    def width(s) -> int:
        f, e = s.mlp.intermediate_size, s.mlp.num_experts
        return (e * max(2 * f, arch.hidden_size) if e else 2 * f) + 2 * s.mlp.shared_intermediate_size
    return max(width(s) for s in arch.layers)


def rung_bytes(arch: ModelArch, rung: Rung, block_size: int, size: int) -> int:
    """Activation bytes at ``rung``'s maxima: K and V gathered and laid out for the matmul (four
    copies), scores and probabilities in float32 and the probabilities cast back, the
    projections' and the MLP's outputs, the logits before their cast to float32 (an output the
    backend allocates) and the builder's workspace."""
    t = rung_tensors(arch, rung, block_size)
    return (4 * t["kv_gather"] * size + t["scores"] * (2 * 4 + size) + 2 * t["qkv"] * size
            + 2 * t["mlp"] * size + t["logits"] * size + WORKSPACE_BYTES)


def pool_block_elements(arch: ModelArch, block_size: int, slots: int | None = None) -> int:
    """Elements of one block of the pool: K and V (or a latent) for ``block_size`` tokens of
    each of its ``slots`` (every layer in a plain pool; ``KVGroups.num_slots`` in groups)."""
    kv = KVHeads.of(arch)
    return (slots or arch.num_layers) * kv.planes * kv.num_kv_heads * block_size * kv.head_dim


def key_width(arch: ModelArch, phase: str = "prefill") -> int:
    """A cached token's largest footprint in a row of the graph's attention: its K or V (or
    latent) gathered, a score a head, and under latent attention in a prefill every head's key
    and value made from its latent (the expanded form; a decode attends over the latents as
    they lie)."""
    kv = KVHeads.of(arch)
    width = max(arch.num_heads, kv.num_kv_heads * kv.head_dim)
    m = arch.mla
    if m is None or phase == "decode":
        return width
    return max(width, arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim))


def max_pool_blocks(arch: ModelArch, block_size: int, slots: int | None = None) -> int:
    """The most blocks a pool TensorRT binds may hold: ``ELEMENT_LIMIT`` elements at most
    (llama3-8b in 16-token blocks: 2,047 blocks, 32,752 tokens)."""
    return max(1, ELEMENT_LIMIT // pool_block_elements(arch, block_size, slots))


def _widths(width: int) -> list[int]:
    """Context widths from ``width`` down to one block, each ``LADDER`` times narrower."""
    out = [width]
    while out[-1] > 1:
        out.append(-(-out[-1] // LADDER))
    return out


def rungs(arch: ModelArch, limits: EngineLimits, num_blocks: int, block_size: int) -> list[Rung]:
    """The prefill rungs, widest context first, then the decode rungs, widest first: each as
    many rows as keep its tensors within ``TILE``, no more than the scheduler ever sends. A
    width has a rung for chunks as long as fit and, where that holds few, one for many chunks
    of a fair share of the token budget; narrowing stops once the context is shorter than the
    longest chunk and the decodes are all in one call. A call's tokens are at most what keeps the
    MLP's activations within ``TILE`` too (an MoE traced with every expert on every token is
    that many times wider: DeepSeek V3's, 291 tokens)."""
    H = arch.num_heads
    tokens = max(1, TILE // mlp_width(arch))
    budget, seqs = min(limits.max_num_batched_tokens, tokens), min(limits.max_num_seqs, tokens)
    width = max(1, min(-(-limits.max_model_len // block_size), num_blocks))
    per_key, per_decode_key = key_width(arch), key_width(arch, "decode")
    if width * block_size * per_key > TILE:
        longest = TILE // per_key // block_size * block_size
        raise ConfigError("model.max_model_len", f"{limits.max_model_len} tokens: TensorRT's "
                          f"attention over one sequence of it needs {width * block_size * per_key:,} "
                          f"elements, more than {TILE:,}; at most {longest}")
    prefill: list[Rung] = []
    decode: list[Rung] = []
    for w in _widths(width):
        keys = w * block_size
        long = min(budget, _longest_chunk(keys, H, per_key))
        # one rung for long chunks, and, where that holds few, one for many short chunks
        for q in (long, max(1, min(long, budget // seqs))):
            c = max(1, min(seqs, budget, TILE // (H * q * (keys + q)), TILE // ((keys + q) * per_key)))
            rung = Rung("prefill", c, q, w, min(budget, c * q))
            if rung not in prefill and (q == long or c > 1):
                prefill.append(rung)
            if c == seqs:
                break
        if not decode or decode[-1].rows < seqs:
            d = min(seqs, TILE // (keys * per_decode_key))
            decode.append(Rung("decode", d, 1, w, d))
        full = prefill[-1].rows == seqs and long == budget
        if (keys < long or full) and decode[-1].rows == seqs:   # a narrower context gains nothing
            break
    return prefill + decode


def _longest_chunk(keys: int, heads: int, per_key: int) -> int:
    """The most queries one chunk after ``keys`` cached keys may hold within ``TILE``."""
    lo, hi = 1, TILE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if heads * mid * (keys + mid) <= TILE and (keys + mid) * per_key <= TILE:
            lo = mid
        else:
            hi = mid - 1
    return lo


def profile_shapes(arch: ModelArch, limits: EngineLimits, block_size: int,
                   num_blocks: int, slots: int | None = None) -> list[Profile]:
    """The min/opt/max shape of every graph input in each rung's profile, in ``rungs`` order.
    The pool's block count is dynamic, from 1 to ``max_pool_blocks`` (the element limit), and
    tuned for (opt) the pool bound now. The opt is left out of the engine's cache key
    (``cache_key``): a pool sized by the free memory of the day reuses the engine; only maxima
    that depend on it (a context wider than the pool) rebuild it. ``slots``: the pool's first
    dimension (``KVGroups.num_slots``; default every layer), fixed in the engine."""
    kv = KVHeads.of(arch)
    fixed = {"L": arch.num_layers, "P": kv.planes, "KVH": kv.num_kv_heads, "hd": kv.head_dim, "BS": block_size}
    fixed["S"] = slots or arch.num_layers
    most = max_pool_blocks(arch, block_size, slots)
    profiles = []
    for r in rungs(arch, limits, num_blocks, block_size):
        if r.phase == "prefill":
            dims = {"T": (1, r.tokens, r.tokens), "N": (1, r.tokens, r.tokens), "C": (1, r.rows, r.rows),
                    "Q": (1, r.chunk, r.chunk), "Wc": (1, max(1, r.blocks // 2), r.blocks),
                    "D": (0, 0, 0), "Wd": (1, 1, 1)}
        else:
            dims = {"T": (1, r.rows, r.rows), "N": (1, r.rows, r.rows), "D": (1, r.rows, r.rows),
                    "Wd": (1, max(1, r.blocks // 2), r.blocks), "C": (0, 0, 0), "Q": (1, 1, 1),
                    "Wc": (1, 1, 1)}
        dims["NB"] = (1, max(1, min(num_blocks, most)), most)
        lo, opt, hi = ({**fixed, **{d: v[i] for d, v in dims.items()}} for i in range(3))
        profiles.append({n: (STEP.shape(n, lo), STEP.shape(n, opt), STEP.shape(n, hi)) for n in STEP.names})
    return profiles


POOL_OPT = "the bound pool's"      # what the cache key holds in place of the pool's opt shape


def cache_key(profiles: list[Profile]) -> list[dict[str, list]]:
    """The profiles as the engine's manifest (its cache key) holds them: every shape, except the
    pool's opt, which only tunes the kernels for the pool of the day."""
    return [{n: [list(lo), POOL_OPT if n == "kv_pool" else list(opt), list(hi)]
             for n, (lo, opt, hi) in p.items()} for p in profiles]


def profile_memory(arch: ModelArch, limits: EngineLimits, num_blocks: int, block_size: int,
                   dtype: Any) -> int:
    """Bytes of device memory the engine's activations need: the largest over its profiles, as
    the backend's execution contexts share one buffer. Refuses a config whose tensors would
    pass TensorRT's element limit (a ``ConfigError`` naming the scheduler key and the figures)."""
    size = itemsize(dtype)
    need = 0
    for r in rungs(arch, limits, num_blocks, block_size):
        for name, n in rung_tensors(arch, r, block_size).items():
            if n > ELEMENT_LIMIT:
                raise ConfigError("scheduler.max_num_batched_tokens", f"{limits.max_num_batched_tokens} "
                                  f"tokens a step: TensorRT's {name} tensor would hold {n:,} elements, "
                                  f"more than its limit of {ELEMENT_LIMIT:,}")
        need = max(need, rung_bytes(arch, r, block_size, size))
    return need


def check_fits(need: int, free: int, what: str = "the KV pool and the weights") -> None:
    """Refuse an engine whose activations do not fit in the ``free`` device bytes."""
    if need > free:
        raise ConfigError("scheduler.max_num_batched_tokens",
                          f"the TensorRT engine's activations need {need / 2**30:.1f} GiB, but only "
                          f"{free / 2**30:.1f} GiB of the device is left after {what}: lower "
                          f"scheduler.max_num_batched_tokens or max_num_seqs, or the pool "
                          f"(cache.num_blocks / cache.memory_fraction)")
