"""``[backend] name = "auto"``: each phase on the fastest backend this machine has for the model.

Until a (model, machine) pair is measured, a stored table picks one backend for both phases, so a
first run starts at once (``twophase backends CONFIG`` says so, and measures). Measuring times each
candidate backend that can run the model here through the engine on a prefill of the token budget
and on decode steps at batch sizes 1 to ``max_num_seqs``, rounds interleaved across backends so
drift on a busy machine hits all alike. Prefill goes to the fastest; decode to the fastest at each
batch size, split by batch size where two backends cross (a route is kept only where it is at least
``MARGIN`` faster than the prefill's backend, whose weights are loaded anyway). The table is cached
under ``$TWOPHASE_CACHE/routing``; ``twophase backends CONFIG`` shows it.

Candidates: ``torch``, ``onnxruntime`` and ``native`` where installed and able to run the model
(IREE and TensorRT compile for minutes: name them in ``[backend.options] candidates`` to include
them). All share one KV pool, so only backends that read and write it in place qualify. A
candidate may name the dtype a backend computes in, ``torch:bfloat16`` (torch's
``compute_dtype``: on a CPU with AMX, oneDNN's bf16 tiles): ``auto`` never lowers the model's
precision on its own, so such a candidate is timed only where the config names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from twophase.arch import ModelArch
from twophase.config import BackendSection, CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from twophase.errors import BackendUnavailable, ConfigError, TwophaseError
from twophase.measure import machine
from twophase.paths import cache_dir
from twophase.plan.model_source import planned_model

log = logging.getLogger(__name__)

AUTO = "auto"
OPTIONS = {"candidates", "threads"}
DEFAULT_CANDIDATES = ("torch", "onnxruntime", "native")
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT, DECODE_STEPS, ROUNDS = 128, 4, 3
MARGIN = 1.05
VERSION = 1                 # of the cached table's format and of the method that fills it


class TimedEngine(Protocol):
    """What ``calibrate`` times a backend through: an ``LLM`` (``phase_timing`` drives it)."""

    max_model_len: int

    def close(self) -> None: ...


# config -> an engine on that config's one backend; the caller passes ``LLM`` (this module sits
# below the Python API, so it is handed the engine rather than importing it)
EngineFactory = Callable[[Config], TimedEngine]


@dataclass
class Routing:
    prefill: str
    decode: str                                   # batches past the last route
    routes: list[tuple[int, str]] = field(default_factory=list)    # (largest batch, backend)
    table: dict[str, Any] = field(default_factory=dict)           # tokens/s as measured

    def names(self) -> list[str]:
        return list(dict.fromkeys([self.prefill, *(n for _, n in self.routes), self.decode]))

    def describe(self) -> str:
        decode = ", ".join(f"batch <= {b}: {n}" for b, n in self.routes)
        decode = f"{decode}, larger: {self.decode}" if decode else self.decode
        how = f" (stored table for {self.table['stored']}: not measured here yet)" \
            if "stored" in self.table else ""
        return f"prefill on {self.prefill}; decode on {decode}{how}"


def _passed_on(sec: BackendSection) -> dict[str, Any]:
    """The options of an ``auto`` section that each backend it picks takes: ``threads``."""
    return {"threads": sec.options["threads"]} if "threads" in sec.options else {}


def section(name: str, device: str, options: dict[str, Any]) -> BackendSection:
    """A candidate's backend section with ``options``: ``torch:bfloat16`` is torch with
    ``compute_dtype = "bfloat16"``, ``torch`` torch in the model's dtype (whatever ``options``
    held)."""
    base, _, dtype = name.partition(":")
    kept = {k: v for k, v in options.items() if k != "compute_dtype"}
    return BackendSection(name=base, device=device, options=kept | ({"compute_dtype": dtype} if dtype else {}))


def name_of(sec: BackendSection) -> str:
    """The candidate a section is (``section``'s inverse)."""
    dtype = sec.options.get("compute_dtype")
    return f"{sec.name}:{dtype}" if dtype else sec.name


def wanted(config: Config) -> bool:
    return any(s.name == AUTO for s in config.phases())


def _auto_section(config: Config) -> BackendSection:
    return next(s for s in config.phases() if s.name == AUTO)


def candidates(config: Config, registry) -> tuple[list[str], dict[str, str]]:
    """The backends ``auto`` may choose, and why each other was left out."""
    sec = _auto_section(config)
    unknown = set(sec.options) - OPTIONS
    if unknown:
        raise ConfigError(f"backend.options.{sorted(unknown)[0]}",
                          f"auto takes only {', '.join(sorted(OPTIONS))}")
    names = sec.options.get("candidates", list(DEFAULT_CANDIDATES))
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError("backend.options.candidates", f"must be a non-empty list of backend names; got {names!r}")
    chosen, left_out = [], {}
    arch = planned_model(config.model).arch
    for name in names:
        base = _backend_of(name)
        if base not in registry.backends:
            if "candidates" in sec.options:
                raise ConfigError("backend.options.candidates", f"no backend named {name!r}; installed: "
                                                                f"{', '.join(sorted(registry.backends))}")
            left_out[name] = "not installed"
            continue
        why = _why_not(registry.get(base), config, sec.device, arch)
        if why:
            left_out[name] = why
        else:
            chosen.append(name)
    if not chosen:
        raise ConfigError("backend.name", "auto found no backend that runs this model here: "
                          + "; ".join(f"{n}: {w}" for n, w in left_out.items()))
    return chosen, left_out


def _backend_of(name: str) -> str:
    """A candidate's backend; the dtype it may name is one torch computes in."""
    from twophase.backends.torch_eager import COMPUTE_DTYPES

    base, _, dtype = name.partition(":")
    if dtype and (base != "torch" or dtype not in COMPUTE_DTYPES):
        raise ConfigError("backend.options.candidates", f"{name!r}: a candidate's compute dtype is torch's "
                          f"(torch:{', torch:'.join(COMPUTE_DTYPES)})")
    return base


def _why_not(cls, config: Config, device: str, arch: ModelArch) -> str | None:
    try:
        cls.check_available(device)
    except BackendUnavailable as exc:
        return str(exc)
    if config.model.quantization not in cls.quantizations:
        return f"does not run {config.model.quantization!r} weights"
    try:
        caps = cls().capabilities()
    except Exception:            # one that knows its capabilities only once loaded: timing will say
        return None
    if not caps.shares_kv_pool:
        return "keeps its own KV pool"
    # each candidate is timed alone, on both phases
    refused = next(filter(None, (cls().supports_phase(arch, config.model.quantization, phase)
                                 for phase in ("prefill", "decode"))), None)
    if refused:
        return refused.removeprefix(f"{cls.name}: ")
    from twophase.models.loader import resolve_dtype

    dtype = resolve_dtype(config.model.dtype, device)
    if dtype not in caps.dtypes:
        return f"does not run {str(dtype).removeprefix('torch.')}"
    kv = config.cache.dtype
    if kv not in ("auto", str(dtype).removeprefix("torch.")) and kv not in caps.kv_formats:
        return f"does not read K/V in {kv}"
    return None


# Before this machine is measured, by device and weight format, in order of preference: the
# fastest backend that builds nothing first (float32 on onnxruntime decodes 3x faster than on
# torch here, docs/measurements.md, but its first run exports the model for minutes), so a first
# run starts at once; ``twophase backends CONFIG`` builds and times them all.
STORED = {("cpu", "none"): ("torch", "onnxruntime", "native"),
          ("cpu", "q4"): ("native", "onnxruntime", "torch"),
          ("cpu", "gguf"): ("native",),
          ("cuda", "none"): ("torch", "onnxruntime"),
          ("cuda", "q4"): ("torch", "onnxruntime")}


def stored(config: Config, names: list[str], left_out: dict[str, str]) -> Routing:
    """The routing by the stored table, for a machine not measured yet (one backend for both
    phases: the first of the table's that is a candidate here)."""
    kind = "cuda" if _auto_section(config).device.startswith("cuda") else "cpu"
    order = STORED.get((kind, config.model.quantization), ())
    best = next((n for n in order if n in names), names[0])
    pcfg, dcfg = config.phases()
    return Routing(best if pcfg.name == AUTO else pcfg.name, best if dcfg.name == AUTO else dcfg.name,
                   table={"left_out": left_out, "stored": f"{kind}, {config.model.quantization!r} weights"})


def resolve(config: Config, registry, *, make_engine: EngineFactory, recalibrate: bool = False,
            measure: bool = True) -> Routing:
    """The routing for ``config`` (its ``auto`` phases): cached, else measured now (``measure``)
    through engines ``make_engine`` builds or, where not, taken from the stored table until
    ``twophase backends CONFIG`` measures."""
    from twophase.plan.model_source import planned_model

    planned_model(config.model)              # a model that does not exist is its own error, first
    names, left_out = candidates(config, registry)
    pcfg, dcfg = config.phases()
    fixed_prefill = None if pcfg.name == AUTO else name_of(pcfg)
    fixed_decode = None if dcfg.name == AUTO else name_of(dcfg)
    if len(names) == 1:
        only = names[0]
        return Routing(fixed_prefill or only, fixed_decode or only, table={"left_out": left_out})
    path = cache_dir() / "routing" / f"{_key(config, names)}.json"
    table = None if recalibrate else _read(path)
    if table is None and not measure:
        return stored(config, names, left_out)
    if table is None:
        table = calibrate(config, names, make_engine)
        failed = table.get("left_out", {})
        table["left_out"] = {**left_out, **failed}
        busy = machine.busy_reasons(table.get("machine"))
        if busy:
            table["busy"] = busy
            log.warning("backend auto: timed while the machine was busy (%s): these figures route this run "
                        "but are not cached; `twophase backends CONFIG` on a quiet machine times them again",
                        "; ".join(busy))
        if not failed and not busy:            # a failure to load may pass: time it again next start
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=2))
            tmp.replace(path)                  # whole or not at all
    if not table["prefill"]:
        raise ConfigError("backend.name", "auto found no backend that runs this model here: " + "; ".join(
            f"{n}: {w}" for n, w in table.get("left_out", {}).items()))
    return choose(table, fixed_prefill, fixed_decode)


def cached(config: Config, registry) -> Routing | None:
    """The routing already measured for ``config`` here, without measuring (None if none)."""
    names, left_out = candidates(config, registry)
    pcfg, dcfg = config.phases()
    fixed = (None if pcfg.name == AUTO else name_of(pcfg), None if dcfg.name == AUTO else name_of(dcfg))
    if len(names) == 1:
        return Routing(fixed[0] or names[0], fixed[1] or names[0], table={"left_out": left_out})
    table = _read(cache_dir() / "routing" / f"{_key(config, names)}.json")
    return choose(table, *fixed) if table and table["prefill"] else None


def _read(path) -> dict[str, Any] | None:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):              # none yet, or a torn write: measure again
        return None
    return table if isinstance(table, dict) and table.get("version") == VERSION else None


def _key(config: Config, names: list[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from twophase.device import cpu_signature

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return ""

    sec = _auto_section(config)
    m, cc = config.model, config.cache
    gpu = torch.cuda.get_device_name(torch.device(sec.device)) if sec.device.startswith("cuda") else ""
    facts = {"v": VERSION, "model": [m.name, m.path, m.weights, m.num_layers, m.quantization, m.dtype,
                                     m.accuracy_level, m.outlier_channels],
             "device": [sec.device, gpu], "cpu": cpu_signature(), "names": names,
             "threads": sec.options.get("threads", torch.get_num_threads()),
             "seqs": config.scheduler.max_num_seqs, "budget": _prefill_tokens(config),
             "cache": [cc.dtype, cc.block_size], "kernels": _sources(names),
             "versions": [torch.__version__, ver("onnxruntime"), ver("onnxruntime-gpu"), ver("twophase")]}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sources(names: list[str]) -> str:
    """A digest of the candidates' own source files: a kernel change times them again."""
    import importlib

    h = hashlib.sha256()
    for name in dict.fromkeys(n.partition(":")[0] for n in names):
        try:
            mod = importlib.import_module(f"twophase.backends.{'torch_eager' if name == 'torch' else name}")
        except ImportError:                    # a plugin: its version is in the key's versions
            continue
        folder = Path(mod.__file__ or "").parent if (mod.__file__ or "").endswith("__init__.py") else None
        files = sorted(folder.glob("*.[ch]") if folder else []) + [Path(mod.__file__ or "")]
        for f in files:
            if f.is_file():
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _prefill_tokens(config: Config) -> int:
    on_cuda = _auto_section(config).device.startswith("cuda")
    return config.scheduler.max_num_batched_tokens or (4096 if on_cuda else 512)


def _batches(config: Config) -> list[int]:
    top = config.scheduler.max_num_seqs
    return [b for b in DECODE_BATCHES if b <= top] + ([top] if top not in DECODE_BATCHES and top < 64 else [])


def _timing_config(config: Config, name: str) -> Config:
    """``config`` on ``name`` alone, with a scheduler and pool that suit the timing rounds."""
    sec = _auto_section(config)
    n, batches = _prefill_tokens(config), _batches(config)
    bs = config.cache.block_size
    blocks = sum(batches) * -(-(CONTEXT + DECODE_STEPS + 2) // bs) + 2 * -(-(n + 2) // bs) + 8
    options = _passed_on(sec)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, max_model_len=None),   # the pool's, as it is
        backend=section(name, sec.device, options),
        scheduler=SchedulerConfig(policy="prefill-first", max_num_seqs=max(batches),
                                  max_num_batched_tokens=max(n, max(batches) + 1)),
        cache=CacheConfig(block_size=bs, num_blocks=blocks, prefix_caching=True),
        speculative=SpeculativeConfig())


def calibrate(config: Config, names: list[str], make_engine: EngineFactory) -> dict[str, Any]:
    """Tokens/s of each backend, timed through an engine ``make_engine`` builds for it alone:
    prefill of the token budget, decode at each batch size (the median over ``ROUNDS`` rounds,
    interleaved)."""
    from tqdm import tqdm

    from twophase.measure.phase_timing import decode_round, prefill_round

    n, batches = _prefill_tokens(config), _batches(config)
    log.info("backend auto: timing %s on this machine (once; cached): each is loaded first (an "
             "export or a compile can take minutes on a first run), then %d timing runs with a "
             "progress bar", ", ".join(names), ROUNDS * len(names) * (1 + len(batches)))
    llms: dict[str, TimedEngine] = {}
    failed: dict[str, str] = {}
    before = machine.sample()
    try:
        for name in names:
            try:
                llms[name] = make_engine(_timing_config(config, name))
            except TwophaseError as exc:          # e.g. a dtype it refuses: not a candidate
                failed[name] = str(exc)
        if not llms:
            return {"version": VERSION, "prefill": {}, "decode": {}, "left_out": failed}
        shortest = min(llm.max_model_len for llm in llms.values())
        n, context = min(n, shortest - 1), max(1, min(CONTEXT, shortest - DECODE_STEPS - 2))
        names = list(llms)
        prefill: dict[str, list[float]] = {k: [] for k in names}
        decode: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in names}
        with tqdm(total=ROUNDS * len(names) * (1 + len(batches)), desc="timing backends", unit="run") as bar:
            for r in range(ROUNDS):
                for name, llm in llms.items():
                    prefill[name].append(prefill_round(llm, n, 0, salt=r))
                    bar.update(1)
                    for b in batches:
                        decode[name][b].append(decode_round(llm, b, context, DECODE_STEPS, salt=r))
                        bar.update(1)
    finally:
        for llm in llms.values():
            llm.close()
    return {"version": VERSION, "prefill_tokens": n, "context": context, "left_out": failed,
            "machine": machine.between(before, machine.sample()),
            "prefill": {k: n / statistics.median(v) for k, v in prefill.items()},
            "decode": {k: {str(b): b / statistics.median(t) for b, t in v.items()} for k, v in decode.items()}}


def choose(table: dict[str, Any], prefill: str | None = None, decode: str | None = None) -> Routing:
    """The routing a table implies (a phase already named stays where it is)."""
    prefill = prefill or max(table["prefill"], key=table["prefill"].get)
    if decode is not None:
        return Routing(prefill, decode, table=table)
    speeds: dict[str, dict[str, float]] = table["decode"]
    batches = sorted({int(b) for v in speeds.values() for b in v})
    winners = []
    for b in batches:
        at = {name: v[str(b)] for name, v in speeds.items() if str(b) in v}
        best = max(at, key=at.get)
        if prefill in at and at[best] < MARGIN * at[prefill]:
            best = prefill              # not worth a second copy of the weights
        winners.append((b, best))
    routes: list[tuple[int, str]] = []
    for (b, name), nxt in zip(winners, winners[1:] + [(None, None)]):
        if nxt[1] != name:
            routes.append((b, name))
    last = routes.pop()[1]
    return Routing(prefill, last, routes, table)


def apply(config: Config, routing: Routing) -> Config:
    """``config`` with its ``auto`` phases named: prefill and the largest batches' decode."""
    sec = _auto_section(config)
    options = _passed_on(sec)
    pcfg, dcfg = config.phases()

    def named(phase: BackendSection, name: str) -> BackendSection:
        if phase.name != AUTO:
            return phase
        return section(name, phase.device, options)

    p, d = named(pcfg, routing.prefill), named(dcfg, routing.decode)
    backend = dataclasses.replace(config.backend, name=p.name, device=p.device, options=p.options,
                                  prefill=None if (p.name, p.options) == (d.name, d.options) else p,
                                  decode=None if (p.name, p.options) == (d.name, d.options) else d)
    return dataclasses.replace(config, backend=backend)


def table_rows(routing: Routing) -> list[tuple[str, str, list[str]]]:
    """``(backend, prefill tok/s, decode tok/s per batch)`` rows for a table, and the header's
    batch sizes as the first row."""
    t = routing.table
    if "decode" not in t:
        return []
    batches = sorted({int(b) for v in t["decode"].values() for b in v})
    rows = [("backend", "prefill", [str(b) for b in batches])]
    for name in t["prefill"]:
        rows.append((name, f"{t['prefill'][name]:,.0f}",
                     [f"{t['decode'][name].get(str(b), 0):,.0f}" for b in batches]))
    return rows
