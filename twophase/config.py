"""Run configuration: one TOML file (or a dict of the same shape), checked key by key.

Every key has a default, so a config with only ``[model]`` runs. Unknown keys, wrong types and
values outside the allowed set raise ``ConfigError`` naming the key path and what is allowed.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from twophase.cache.tiers import InvalidOffloadSetting, OffloadConfig
from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError, InvalidSamplingParam
from twophase.models.source import ModelSource


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"   # a named model, or a shape with weights = "random"
    path: str | None = None               # a local HF folder or .gguf file (overrides name)
    weights: Literal["pretrained", "random"] = "pretrained"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"   # auto: fp32 on CPU, bf16 on CUDA
    num_layers: int | None = None         # override a shape's depth
    max_model_len: int | None = None      # context limit; default the model's own
    seed: int = 0                         # random weights
    # q4: 4-bit block weights (Q4_1, a Q8_0 head); gguf: every tensor as the GGUF file stores it
    quantization: Literal["none", "q4", "gguf"] = "none"
    accuracy_level: int = 4               # q4: 4 quantises activations to int8 per block (fastest)
    outlier_channels: int = 8             # q4: input channels per projection kept in float32
    max_loras: int = 4                    # LoRA adapters resident at once (the rest on disk)

    def source(self) -> ModelSource:
        """What the model loaders read of this section (the model layer never reads the config)."""
        return ModelSource(self.name, self.path, self.weights, self.dtype, self.num_layers, self.seed,
                           self.quantization, self.accuracy_level, self.outlier_channels)


@dataclass
class LoraModule:
    """An adapter served beside the base model (``[[lora]]``): a request names it to run with it."""

    name: str
    path: str                              # a PEFT adapter folder (relative to the config file)


@dataclass
class BackendSection:
    name: str = "torch"
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    # the phases on different backends over one KV pool: [backend.prefill] and [backend.decode]
    prefill: BackendSection | None = None
    decode: BackendSection | None = None


@dataclass
class SchedulerConfig:
    policy: Literal["decode-first", "prefill-first"] = "decode-first"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None   # default: 512 on CPU, 4096 on CUDA
    chunked_prefill: bool = True
    admission: Literal["reserve", "greedy"] = "reserve"   # reserve: keep running sequences' growth free


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | Literal["auto"] = "auto"
    memory_gb: float | None = None         # pool budget for num_blocks = "auto"
    memory_utilization: float = 0.9        # CUDA, num_blocks = "auto": the share of the GPU used
    prefix_caching: bool = True
    # auto: the model's; int8: q8_0 codes with a float16 scale per 32 values; fp8: float8 e4m3
    # (twophase/kv_formats.py)
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8"] = "auto"
    prefault: bool = False                 # CPU: back every page of the pool at start (servers)
    # models with state layers: a prefix hit restores the state saved where a computed prefix
    # reached a multiple of state_snapshot_every tokens (a multiple of block_size); so many
    # snapshots are kept, the least recently used given up first ("auto": 2 x max_num_seqs)
    state_snapshot_every: int = 512
    state_snapshots: int | Literal["auto"] = "auto"
    # blocks the pool evicts kept in host memory, then on disk ([cache.offload]; none: no tiers)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class SyntheticConfig:
    num_requests: int = 16
    input_len: list[int] = field(default_factory=lambda: [32, 128])    # [min, max]
    output_len: list[int] = field(default_factory=lambda: [32, 64])    # [min, max]
    seed: int = 0


@dataclass
class WorkloadConfig:
    prompts: list[str] | None = None       # none given (and no jsonl/synthetic): a few examples
    chat: bool | Literal["auto"] = "auto"  # the model's chat template; auto: where it has one
    jsonl: str | None = None               # one {"prompt": ..., optional sampling keys} a line
    synthetic: SyntheticConfig | None = None


@dataclass
class ServingConfig:
    num_requests: int = 32
    rate: float | None = None              # requests/s, Poisson arrivals; none: all at once
    input_len: list[int] = field(default_factory=lambda: [32, 256])    # [min, max]
    output_len: list[int] = field(default_factory=lambda: [16, 64])    # [min, max]
    jsonl: str | None = None               # a trace instead: {"prompt_token_ids", "max_tokens", "arrival_s"}
    seed: int = 0


@dataclass
class BenchConfig:
    backends: list[str] = field(default_factory=lambda: ["torch"])
    prompt_lens: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    cache_depth: int = 0                   # prefill after this many cached tokens (a prefix hit)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    decode_context: int = 256
    decode_steps: int = 8
    repeats: int = 3
    baseline: Literal["hf", "none"] = "hf"
    hf_batch_size: int = 16                # static batch of the baseline's serving run
    serving: ServingConfig = field(default_factory=ServingConfig)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None             # or TWOPHASE_API_KEY; checked on all routes but /health
    max_queue: int = 256                   # requests in flight before new ones get 503
    model_name: str | None = None          # the model id clients send; default the model's
    default_max_tokens: int = 256          # requests (completions and chat) without max_tokens
    max_n: int = 16                        # choices a prompt may ask for (n, best_of)
    max_body_bytes: int = 4 << 20          # a larger request body is a 413
    shutdown_timeout_s: float = 30.0       # after SIGTERM, streams still open then get an error


@dataclass
class DraftConfig:
    """The draft model of ``method = "draft"``: each key unset is the target's ``[model]``
    key, so ``quantization = "q4"`` alone drafts the target with its own 4-bit blocks."""

    name: str | None = None
    path: str | None = None
    weights: Literal["pretrained", "random"] | None = None
    num_layers: int | None = None
    seed: int | None = None
    quantization: Literal["none", "q4", "gguf"] | None = None
    backend: BackendSection | None = None  # default: the target's decode backend
    num_blocks: int | Literal["auto"] = "auto"   # its own KV pool; auto: as many as the target's


@dataclass
class SpeculativeConfig:
    method: Literal["none", "ngram", "draft"] = "none"   # ngram: prompt lookup; draft: a model
    num_tokens: int | Literal["auto"] = 4  # drafts verified a pass (k); auto: chosen per step
    prompt_lookup_min: int = 2             # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4             # ngram: the longest
    draft: DraftConfig | None = None       # method = "draft": [speculative.draft]


@dataclass
class ClusterConfig:
    """Engines on Ray (``twophase serve``): replicas behind one endpoint, or prefill and decode
    on different workers with the prompt's K/V pulled between them (docs/cluster.md)."""

    address: str | None = None             # "auto", "ray://host:port"; unset: a local cluster
    replicas: int = 1                      # engine replicas (a Ray Serve deployment)
    prefill_workers: int = 0               # with decode_workers: disaggregated prefill/decode
    decode_workers: int = 0
    prefill_backend: BackendSection | None = None   # the prefill workers' [backend]; default its own
    decode_backend: BackendSection | None = None    # the decode workers'
    threads: int | None = None             # CPU threads per worker (each backend and torch)
    prefill_threads: int | None = None     # the prefill workers' threads; default threads
    decode_threads: int | None = None      # the decode workers'
    prefill_nice: int = 0                  # 0-19: prefill workers' OS priority below decode
                                           # workers' (on shared cores a decode step goes first)
    route_imbalance: int = 4               # queue gap past which prefix affinity yields
    kv_lease_s: float = 30.0               # prefill side keeps a prompt's blocks this long
    kv_load_timeout_s: float = 2.0         # decode side waits this long for them
    kv_load_failure: Literal["fail", "recompute"] = "fail"

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0 or self.decode_workers > 0

    @property
    def enabled(self) -> bool:
        return self.replicas > 1 or self.disaggregated or self.address is not None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendSection = field(default_factory=BackendSection)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)   # request defaults
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    lora: list[LoraModule] = field(default_factory=list)
    base_dir: Path = field(default=Path("."), metadata={"internal": True})

    def phases(self) -> tuple[BackendSection, BackendSection]:
        """The (prefill, decode) backend sections: the pair if given, else [backend] twice."""
        b = self.backend
        return (b.prefill, b.decode) if b.prefill is not None else (b, b)

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative).expanduser()
        return p if p.is_absolute() else self.base_dir / p


def load_config(source: str | Path | dict[str, Any] | None,
                overrides: dict[str, Any] | None = None) -> Config:
    """A checked ``Config`` from a TOML path or a dict of the TOML's shape (``None``: every
    default), with ``overrides`` (the same shape, e.g. from command-line flags) over it."""
    if source is None or isinstance(source, dict):
        data = merged(source or {}, overrides or {})
        _check_backend_shape(data)
        cfg = _build(Config, data, "")
        cfg.base_dir = Path(".")
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError("", f"config file {str(path)!r} not found")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise ConfigError("", f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("", f"{path}: TOML syntax error: {exc}") from None
        data = merged(data, overrides or {})
        _check_backend_shape(data)
        cfg = _build(Config, data, "")
        cfg.base_dir = path.resolve().parent
    _check(cfg)
    return cfg


def merged(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``overrides`` over it, section by section (a value replaces, ``None``
    removes the key, back to its default; a table is merged into the table it replaces)."""
    out = dict(data)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):       # into the table there, or a new one (its Nones dropped)
            out[key] = merged(out[key] if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = value
    return out


def _check_backend_shape(data: dict[str, Any], where: str = "") -> None:
    """``[backend]`` (and the draft model's) is one section or a prefill/decode pair."""
    spec = data.get("speculative")
    draft = spec.get("draft") if isinstance(spec, dict) else None
    if not where and isinstance(draft, dict):
        _check_backend_shape(draft, "speculative.draft.")
    b = data.get("backend")
    if not isinstance(b, dict):
        return
    key = f"{where}backend"
    split = [k for k in ("prefill", "decode") if k in b]
    if split and len(split) != 2:
        raise ConfigError(f"{key}.{split[0]}", f"give both [{key}.prefill] and [{key}.decode]")
    if split and set(b) - {"prefill", "decode"}:
        other = sorted(set(b) - {"prefill", "decode"})[0]
        raise ConfigError(f"{key}.{other}", f"give either [{key}] (one backend for both "
                          f"phases) or [{key}.prefill] and [{key}.decode], not both")
    for k in split:
        if isinstance(b[k], dict) and {"prefill", "decode"} & set(b[k]):
            raise ConfigError(f"{key}.{k}", "a phase's backend cannot be split again")


def _check(cfg: Config) -> None:
    """Cross-field rules a type cannot express."""
    for check in (_check_limits, _check_sampling, _check_bench, _check_model, _check_server,
                  _check_workload, _check_speculative, _check_cluster, _check_lora, _check_offload):
        check(cfg)


def _check_offload(cfg: Config) -> None:
    o = cfg.cache.offload
    try:
        OffloadConfig(o.host_gib, o.disk_dir, o.disk_gib)
    except InvalidOffloadSetting as exc:
        raise ConfigError(f"cache.offload.{exc.name}", exc.message) from None
    if o.disk_dir is not None:
        o.disk_dir = str(cfg.resolve(o.disk_dir))


def _check_lora(cfg: Config) -> None:
    if cfg.model.max_loras < 1:
        raise ConfigError("model.max_loras", f"must be at least 1, got {cfg.model.max_loras}")
    seen: set[str] = set()
    for i, a in enumerate(cfg.lora):
        if not a.name.strip() or a.name != a.name.strip():
            raise ConfigError(f"lora[{i}].name", f"must be a name without surrounding spaces, got {a.name!r}")
        if a.name in seen:
            raise ConfigError(f"lora[{i}].name", f"{a.name!r} is given twice")
        seen.add(a.name)


def _check_cluster(cfg: Config) -> None:
    c = cfg.cluster
    positive = ("replicas", "threads", "prefill_threads", "decode_threads")
    for key in positive + ("prefill_workers", "decode_workers", "route_imbalance"):
        value = getattr(c, key)
        if value is not None and value < (1 if key in positive else 0):
            raise ConfigError(f"cluster.{key}", f"must be at least {1 if key in positive else 0}, got {value}")
    for key in ("prefill_threads", "decode_threads", "prefill_nice"):
        if getattr(c, key) and not c.disaggregated:
            raise ConfigError(f"cluster.{key}", "applies to disaggregated serving: give prefill_workers and "
                                                "decode_workers too")
    if not 0 <= c.prefill_nice <= 19:
        raise ConfigError("cluster.prefill_nice", f"must be a nice value in [0, 19], got {c.prefill_nice}")
    if (c.prefill_workers > 0) != (c.decode_workers > 0):
        raise ConfigError("cluster.decode_workers" if c.prefill_workers else "cluster.prefill_workers",
                          "disaggregated serving needs both prefill_workers and decode_workers")
    if c.disaggregated and c.replicas > 1:
        raise ConfigError("cluster.replicas", "give either replicas or prefill_workers/decode_workers")
    for key in ("kv_lease_s", "kv_load_timeout_s"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"cluster.{key}", f"must be a positive number of seconds, got {getattr(c, key)}")
    if c.address is not None and not (c.address == "auto" or c.address.startswith("ray://")):
        raise ConfigError("cluster.address", f"must be \"auto\" or \"ray://host:port\", got {c.address!r}")


def _check_limits(cfg: Config) -> None:
    s, c, m = cfg.scheduler, cfg.cache, cfg.model
    positive = [("scheduler.max_num_seqs", s.max_num_seqs), ("cache.block_size", c.block_size),
                ("scheduler.max_num_batched_tokens", s.max_num_batched_tokens),
                ("model.num_layers", m.num_layers), ("model.max_model_len", m.max_model_len),
                ("sampling.max_tokens", cfg.sampling.max_tokens)]
    if isinstance(c.num_blocks, int):
        positive.append(("cache.num_blocks", c.num_blocks))
    for key, value in positive:
        if value is not None and value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value}")
    if s.policy == "decode-first" and s.max_num_batched_tokens is not None \
            and s.max_num_batched_tokens <= s.max_num_seqs and s.chunked_prefill:
        raise ConfigError("scheduler.max_num_batched_tokens",
                          f"must exceed scheduler.max_num_seqs ({s.max_num_seqs}) under "
                          f"decode-first, so running decodes always leave budget for prefill")
    if c.state_snapshot_every < 1 or c.state_snapshot_every % c.block_size:
        raise ConfigError("cache.state_snapshot_every", f"must be a positive multiple of cache.block_size "
                          f"({c.block_size}), so a snapshot ends a whole block; got {c.state_snapshot_every}")
    if c.state_snapshots != "auto" and (not isinstance(c.state_snapshots, int) or c.state_snapshots < 0):
        raise ConfigError("cache.state_snapshots",
                          f"must be \"auto\" or a whole number >= 0, got {c.state_snapshots!r}")
    if c.memory_gb is not None and c.memory_gb <= 0:
        raise ConfigError("cache.memory_gb", f"must be a positive number of GiB, got {c.memory_gb}")
    if not 0 < c.memory_utilization <= 1:
        raise ConfigError("cache.memory_utilization", f"must be in (0, 1], got {c.memory_utilization}")


def _check_sampling(cfg: Config) -> None:
    """``[sampling]`` was built unchecked (``_unchecked``): its values are checked here, after the
    limits, and the section becomes the checked ``SamplingParams``."""
    try:
        cfg.sampling = SamplingParams(**dataclasses.asdict(cfg.sampling))
    except InvalidSamplingParam as exc:
        raise ConfigError(f"sampling.{exc.name}", exc.message) from None


def _check_model(cfg: Config) -> None:
    m = cfg.model
    if not 0 <= m.accuracy_level <= 4:
        raise ConfigError("model.accuracy_level", f"must be in [0, 4], got {m.accuracy_level}")
    if not 0 <= m.outlier_channels <= 64:
        raise ConfigError("model.outlier_channels", f"must be in [0, 64], got {m.outlier_channels}")
    path = Path(m.path).expanduser() if m.path else None
    if path is not None and path.is_file() and path.suffix != ".gguf":
        hint = " (a config file? give it as the command's CONFIG argument)" if path.suffix == ".toml" else ""
        raise ConfigError("model.path", f"{str(path)!r} is a file but not a .gguf: give a .gguf file or a "
                                        f"model folder{hint}")


def _check_server(cfg: Config) -> None:
    sv = cfg.server
    if not 0 <= sv.port <= 65535:
        raise ConfigError("server.port", f"must be in [0, 65535], got {sv.port}")
    if sv.shutdown_timeout_s < 0:
        raise ConfigError("server.shutdown_timeout_s", f"must be >= 0 seconds, got {sv.shutdown_timeout_s}")
    for key in ("max_queue", "default_max_tokens", "max_body_bytes"):
        if getattr(sv, key) < 1:
            raise ConfigError(f"server.{key}", f"must be a positive integer, got {getattr(sv, key)}")


def _check_speculative(cfg: Config) -> None:
    sp = cfg.speculative
    if sp.num_tokens != "auto" and not 1 <= sp.num_tokens <= 32:
        raise ConfigError("speculative.num_tokens", f"must be in [1, 32], got {sp.num_tokens}")
    if not 1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max:
        raise ConfigError("speculative.prompt_lookup_min", f"must be in [1, prompt_lookup_max "
                          f"({sp.prompt_lookup_max})], got {sp.prompt_lookup_min}")
    if sp.method == "draft" and sp.draft is None:
        raise ConfigError("speculative.draft", 'method = "draft" needs a [speculative.draft] '
                          'section naming the draft, e.g. quantization = "q4" with '
                          '[speculative.draft.backend] name = "native"')
    if sp.draft is not None and sp.method != "draft":
        raise ConfigError("speculative.draft", f'is read only with method = "draft" (method is '
                          f'{sp.method!r})')
    d = sp.draft
    if d is not None:
        for key in ("num_layers", "num_blocks"):
            v = getattr(d, key)
            if isinstance(v, int) and v < 1:
                raise ConfigError(f"speculative.draft.{key}", f"must be a positive integer, got {v}")


def _check_workload(cfg: Config) -> None:
    if cfg.workload.prompts == []:
        raise ConfigError("workload.prompts", "is empty: give prompts, or leave the key out to "
                          "run a few example prompts")
    syn = cfg.workload.synthetic
    if syn is not None:
        if syn.num_requests < 1:
            raise ConfigError("workload.synthetic.num_requests", f"must be at least 1, got {syn.num_requests}")
        for key in ("input_len", "output_len"):
            v = getattr(syn, key)
            if len(v) != 2 or not 1 <= v[0] <= v[1]:
                raise ConfigError(f"workload.synthetic.{key}", f"must be [min, max] with 1 <= min <= max, got {v}")


def _check_bench(cfg: Config) -> None:
    b = cfg.bench
    for key in ("prompt_lens", "batch_sizes"):
        v = getattr(b, key)
        if not v or any(x < 1 for x in v):
            raise ConfigError(f"bench.{key}", f"must be a non-empty list of positive integers, got {v}")
    for key in ("decode_context", "decode_steps", "hf_batch_size"):
        if getattr(b, key) < 1:
            raise ConfigError(f"bench.{key}", f"must be a positive integer, got {getattr(b, key)}")
    if b.repeats < 3:
        raise ConfigError("bench.repeats", f"must be at least 3 (a median and its min-max need "
                          f"three rounds; with two the median is their mean), got {b.repeats}")
    if b.cache_depth < 0 or b.cache_depth % cfg.cache.block_size:
        raise ConfigError("bench.cache_depth", f"must be a multiple of cache.block_size "
                          f"({cfg.cache.block_size}) so the cached prefix is whole blocks; got {b.cache_depth}")
    if not b.backends:
        raise ConfigError("bench.backends", "name at least one backend")
    s = b.serving
    if s.num_requests < 1:
        raise ConfigError("bench.serving.num_requests", f"must be at least 1, got {s.num_requests}")
    if s.rate is not None and s.rate <= 0:
        raise ConfigError("bench.serving.rate", f"must be a positive number of requests/s (leave "
                          f"it out for all at once), got {s.rate}")
    for key in ("input_len", "output_len"):
        v = getattr(s, key)
        if len(v) != 2 or not 1 <= v[0] <= v[1]:
            raise ConfigError(f"bench.serving.{key}", f"must be [min, max] with 1 <= min <= max, got {v}")


def _build(cls: type, data: Any, path: str):
    if not isinstance(data, dict):
        raise ConfigError(path or "config", f"must be a table, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(key, f"unknown key; allowed keys here: {', '.join(fields)}")
    values = {name: _value(hints[name], data[name], f"{path}.{name}" if path else name)
              for name in fields if name in data}
    if cls in _CHECKED_LATER:
        return _unchecked(cls, values)
    return cls(**values)


# sections whose own constructor checks their values: built without that check, which their
# ``_check_*`` makes in its turn, so a config's errors are reported in the order of ``_check``
_CHECKED_LATER = (SamplingParams, OffloadConfig)


def _unchecked(cls: type, values: dict[str, Any]):
    """A ``cls`` of ``values`` (every other field its default) without running ``__post_init__``."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            v = values[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
        else:
            v = f.default
        object.__setattr__(obj, f.name, v)
    return obj


def _union_value(args: tuple[Any, ...], v: Any, path: str):
    if v is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    tables = [a for a in options if dataclasses.is_dataclass(a)]
    if isinstance(v, dict) and tables:       # a section: report what is wrong inside it
        return _value(tables[0], v, path)
    for arg in options:
        try:
            return _value(arg, v, path)
        except ConfigError:
            pass
    allowed = " or ".join(_describe(a) for a in options)
    raise ConfigError(path, f"expected {allowed}, got {_kind(v)} {v!r}")


def _value(tp: Any, v: Any, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _union_value(args, v, path)
    if origin is Literal:
        if v not in args:
            raise ConfigError(path, f"must be one of {', '.join(repr(a) for a in args)}; got {v!r}")
        return v
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, path)
    if origin is list:
        if not isinstance(v, list):
            raise ConfigError(path, f"expected a list of {_describe(args[0], plural=True)}, got {_kind(v)}")
        return [_value(args[0], x, f"{path}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(path, f"expected a table, got {_kind(v)}")
        return dict(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp is Any or (isinstance(v, tp) and not (tp is int and isinstance(v, bool))):
        return v
    raise ConfigError(path, f"expected {_describe(tp)}, got {_kind(v)} {v!r}")


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def _describe(tp: Any, plural: bool = False) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "a list"
    if tp in _PLURAL and plural:
        return _PLURAL[tp]
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
