"""``step.c`` compiled once per machine (``$TWOPHASE_CACHE/native``) and bound with ctypes: the
C structs mirrored (each checked against the compiled layout at load), and the checks that it can
be built and run here."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from ctypes import POINTER, c_char_p, c_float, c_int, c_long, c_size_t, c_void_p
from importlib.resources import files
from pathlib import Path

from twophase.contract import BackendUnavailable
from twophase.device import cpu_flags, cpu_signature
from twophase.paths import build_lock, cache_dir

log = logging.getLogger(__name__)

# -ffp-contract=off: the compiler may not fuse a*b + c on its own, so results do not depend on
# where it chose to (with int8 activations, one ulp can flip a rounding: such a choice moved the
# default model's perplexity from -0.3% to +0.75% of the float model's, at no cost in speed)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = ("avx2", "fma", "f16c")


class ProjQ4(ctypes.Structure):
    _fields_ = [("n", c_int), ("k", c_int), ("n_out", c_int), ("w", c_void_p), ("out_idx", c_void_p),
                ("out_w", c_void_p)]


class ProjQ8(ctypes.Structure):
    _fields_ = [("n", c_int), ("k", c_int), ("w", c_void_p)]


class Part(ctypes.Structure):
    _fields_ = [("type", c_int), ("n", c_int), ("w", c_void_p)]


class ProjStored(ctypes.Structure):
    """A projection's rows as the GGUF stores them: up to 3 parts (q, k, v), each of one type."""
    _fields_ = [("n", c_int), ("k", c_int), ("parts", c_int), ("part", Part * 3)]


# step.c's model_t, field by field in its order: its one declaration on this side (``Model`` is
# built from it, ``weights.py`` fills it by name), checked against the compiled struct at load
MODEL_FIELDS: tuple[tuple[str, type], ...] = (
    ("layers", c_int), ("dim", c_int), ("heads", c_int), ("kv_heads", c_int), ("head_dim", c_int),
    ("ffn", c_int), ("vocab", c_int), ("eps", c_float),
    ("embed", c_void_p), ("attn_norm", c_void_p), ("mlp_norm", c_void_p), ("final_norm", c_void_p),
    ("inv_freq", c_void_p),
    ("qkv", POINTER(ProjQ4)), ("o", POINTER(ProjQ4)), ("gate_up", POINTER(ProjQ4)), ("down", POINTER(ProjQ4)),
    ("head", ProjQ8),
    ("stored", c_int), ("s_qkv", POINTER(ProjStored)), ("s_o", POINTER(ProjStored)),
    ("s_gate_up", POINTER(ProjStored)), ("s_down", POINTER(ProjStored)), ("s_head", POINTER(ProjStored)),
    ("rot_dim", c_int), ("scale", c_float), ("embed_scale", c_float), ("attn_cap", c_float),
    ("final_cap", c_float), ("act", c_int),
    ("q_norm", c_void_p), ("k_norm", c_void_p), ("post_attn_norm", c_void_p), ("post_mlp_norm", c_void_p),
    ("qkv_bias", c_void_p), ("o_bias", c_void_p), ("gate_up_bias", c_void_p), ("down_bias", c_void_p),
    ("window", c_void_p), ("slot", c_void_p), ("group", c_void_p),
    ("experts", c_int), ("top_k", c_int), ("norm_topk", c_int), ("s_router", POINTER(ProjStored)),
    ("s_exp_gu", POINTER(ProjStored)), ("s_exp_dn", POINTER(ProjStored)),
    ("sinks", c_void_p), ("router_bias", c_void_p), ("exp_gu_bias", c_void_p), ("exp_dn_bias", c_void_p),
    ("glu_alpha", c_float), ("glu_limit", c_float),
)


class Model(ctypes.Structure):
    _fields_ = list(MODEL_FIELDS)


class Step(ctypes.Structure):
    _fields_ = [("rows", c_int), ("tokens", c_void_p), ("positions", c_void_p), ("slots", c_void_p),
                ("tables", c_void_p), ("width", c_int), ("seqs", c_int), ("seq", c_void_p), ("ctx", c_void_p),
                ("n_logits", c_int), ("logit_rows", c_void_p), ("pool", c_void_p),
                ("num_blocks", c_int), ("block_size", c_int), ("kv_type", c_int), ("logits", c_void_p),
                ("scratch", c_void_p), ("max_ctx", c_int), ("threads", c_int),
                ("team", c_int), ("amx", c_int)]


# each C struct kernel.py passes, by its name in step.c, and its mirror here
MIRRORS: dict[str, type[ctypes.Structure]] = {"model_t": Model, "step_t": Step, "proj_q4": ProjQ4,
                                              "proj_q8": ProjQ8, "part_t": Part, "proj_g": ProjStored}


def check_layout(so: ctypes.CDLL, c_name: str, struct: type[ctypes.Structure]) -> None:
    """Raise ``BackendUnavailable`` unless ``struct`` lays out the fields of step.c's ``c_name``
    as the compiler did (``tp_field``, ``tp_sizeof``): names, offsets and sizes, so a field
    added, dropped or moved on one side only is named here, before a step reads the wrong bytes."""
    c, offset, size = {}, c_size_t(), c_size_t()
    while (name := so.tp_field(c_name.encode(), len(c), ctypes.byref(offset), ctypes.byref(size))) is not None:
        c[name.decode()] = (offset.value, size.value)
    ours = {name: (getattr(struct, name).offset, getattr(struct, name).size) for name, *_ in struct._fields_}
    where = f"kernel.py's {struct.__name__}"
    wrong = [f"{c_name}.{name} is at offset {c[name][0]} ({c[name][1]} bytes) in step.c but at {at} ({n} bytes) "
             f"in {where}" for name, (at, n) in ours.items() if name in c and c[name] != (at, n)]
    wrong += [f"{c_name}.{name} is in {where} but not in step.c" for name in ours if name not in c]
    wrong += [f"{c_name}.{name} is in step.c but not in {where}" for name in c if name not in ours]
    if not wrong and so.tp_sizeof(c_name.encode()) != ctypes.sizeof(struct):
        wrong.append(f"{c_name} is {so.tp_sizeof(c_name.encode())} bytes in step.c but {ctypes.sizeof(struct)} "
                     f"in {where}")
    if wrong:
        raise BackendUnavailable("the native kernels' structs do not match their declarations in kernel.py: "
                                 + "; ".join(wrong))


def compiler() -> str | None:
    """``$CC`` where it names a program found, else cc or gcc on the PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc")


def check_machine() -> None:
    """Raise ``BackendUnavailable`` unless this is an x86-64 Linux CPU with AVX2, FMA and F16C
    and a C compiler with OpenMP."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise BackendUnavailable(f"the native backend runs on x86-64 Linux, not "
                                 f"{platform.system()} {platform.machine()}")
    flags = cpu_flags()
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        raise BackendUnavailable(f"the native backend's kernels need {', '.join(CPU_FLAGS)}; this "
                                 f"CPU lacks {', '.join(missing)}")
    if compiler() is None:
        cc = os.environ.get("CC")
        raise BackendUnavailable("the native backend compiles its kernels at first use and found "
                                 + (f"no compiler CC={cc!r}" if cc else "no C compiler (cc or gcc; or set CC)"))


# a flag switching off an instruction set, and the /proc/cpuinfo flag of that set
_SWITCHES_OFF = {"-mno-avx512f": "avx512f", "-mno-avxvnni": "avx_vnni"}

# the kernels' paths (``[backend.options] isa``), each built for this CPU with what it may not
# use switched off: 512-bit VNNI (16 lanes a vector, where the CPU has it), 256-bit VNNI, AVX2
# without VNNI (8 lanes: what an AMD Zen 3 runs). A switch for a set this CPU lacks changes
# nothing and is dropped: the path is then the native build.
ISA_FLAGS = {"native": (), "avx-vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni")}
# what a build's kernel_isa() says it runs
ISA_NAMES = ("AVX2 (no VNNI)", "AVX-VNNI (256-bit)", "AVX-512 VNNI")


def effective_flags(extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    """``extra_flags`` less those that switch off what this CPU lacks: under -march=native they
    change no instruction, so the build (25 s on a Zen 3 core) is the plain one's."""
    have = cpu_flags()
    return tuple(f for f in extra_flags if f not in _SWITCHES_OFF or _SWITCHES_OFF[f] in have)


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled kernels, built on first use (``extra_flags``: for tests, e.g. the AVX2
    path on a CPU with VNNI)."""

    check_machine()
    extra_flags = effective_flags(extra_flags)
    here = files("twophase.backends.native")
    source = one_source(here)
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # -march=native: the build is this CPU's; a cache shared with another CPU must not reuse it
    build = " ".join([cc, version, *FLAGS, *extra_flags, cpu_signature()])
    key = hashlib.sha256(source + build.encode()).hexdigest()[:12]
    lib = cache_dir() / "native" / f"step-{key}.so"
    if not lib.exists():
        with build_lock(lib):                 # one compile for every process on this cache
            if not lib.exists():
                _compile(cc, extra_flags, source, lib)
    so = ctypes.CDLL(str(lib))
    so.step.argtypes = [POINTER(Model), POINTER(Step)]
    so.step.restype = None
    so.kernel_isa.argtypes = []
    so.kernel_isa.restype = c_int
    so.step_scratch_floats.argtypes = [POINTER(Model), c_int, c_int, c_int]
    so.step_scratch_floats.restype = c_long
    so.check_scratch_floats.argtypes = [c_int, c_int]
    so.check_scratch_floats.restype = c_long
    so.check_matmul.argtypes = [c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int]
    so.check_matmul.restype = None
    so.check_attention.argtypes = [POINTER(Model), POINTER(Step), c_void_p, c_void_p]
    so.check_attention.restype = None
    so.check_glu.argtypes = [POINTER(Model), c_void_p, c_void_p, c_void_p, c_int]
    so.check_glu.restype = None
    so.check_matmul_stored.argtypes = [POINTER(ProjStored), c_int, c_void_p, c_void_p, c_void_p, c_void_p,
                                       c_void_p, c_int]
    so.check_matmul_stored.restype = None
    so.run_matmul_stored.argtypes = [POINTER(ProjStored), c_int, c_void_p, c_void_p, c_void_p, c_int]
    so.run_matmul_stored.restype = None
    so.run_matmul_amx.argtypes = [POINTER(ProjStored), c_int, c_void_p, c_void_p, c_void_p, c_int]
    so.run_matmul_amx.restype = c_int
    so.check_matmul_amx.argtypes = [POINTER(ProjStored), c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int]
    so.check_matmul_amx.restype = c_int
    so.amx_request.argtypes = []
    so.amx_request.restype = c_int
    so.tp_sizeof.argtypes = [c_char_p]
    so.tp_sizeof.restype = c_size_t
    so.tp_field.argtypes = [c_char_p, c_int, POINTER(c_size_t), POINTER(c_size_t)]
    so.tp_field.restype = c_char_p
    for c_name, struct in MIRRORS.items():
        check_layout(so, c_name, struct)
    return so


HEADERS = ("gguf_blocks.h", "amx_tiles.h", "amx_attention.h")     # step.c's own, each included once, in this order


def one_source(here) -> bytes:
    """step.c with its headers in place of their #include lines: one file to compile and hash."""
    source = here.joinpath("step.c").read_bytes()
    for name in HEADERS:
        source = source.replace(f'#include "{name}"'.encode(), here.joinpath(name).read_bytes())
    return source


def _compile(cc: str, extra_flags: tuple[str, ...], source: bytes, lib: Path) -> None:
    log.info("compiling the native kernels for this CPU with %s (once; 20-30 s on a 2-core Zen 3)", cc)
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.with_name(f"{lib.stem}.{os.getpid()}.c")
    src.write_bytes(source)
    tmp = lib.with_name(lib.name + f".{os.getpid()}.tmp")
    done = subprocess.run([cc, *FLAGS, *extra_flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BackendUnavailable(f"compiling the native kernels with {cc} failed:\n{done.stderr[-2000:]}")
    tmp.replace(lib)
    src.unlink()
