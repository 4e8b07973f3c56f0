"""4-bit weights side by side with llama.cpp on the same GGUF file, in one run.

twophase runs the default model's GGUF blocks as they are (``quantization = "q4"``): on the
native backend (one C function a step), in ONNX Runtime (MatMulNBits), and with prefill there
and decode on native; for reference, the dequantised fp32 model in onnxruntime. Each engine runs
in a process of its own (two OpenMP runtimes in one process spin against each other).
Where ``llama-cpp-python`` is installed (``pip install 'twophase[llama-cpp]'``: it compiles
llama.cpp, about 20 minutes on two cores), llama.cpp runs the same file with the same threads:
pp512 (one 512-token prompt), tg128 (128 tokens at batch 1) and, through its batch API as
llama-batched-bench does, 32 sequences of 128 tokens decoding together; flash attention on and off.
Rounds are interleaved; medians are printed with the ratios. Quality, for twophase's q4 and for
llama.cpp on the same text: perplexity's difference from the fp32 model, the mean KL divergence
from it, and how often the top token agrees with it.

    python benchmarks/quantized.py [--threads 2] [--rounds 3] [--gguf FILE] [--lines native-gguf,...]
                                   [--isa avx2] [--llama-cpp DIR] [--kv-dtype float16] [--no-quality]

``--gguf`` runs another file, e.g. a Q4_K_M one; ``"gguf"`` runs its tensors as stored (the
native backend), ``"q4"`` converts those not Q4_1 or Q8_0 to Q4_1. ``--isa avx2`` runs the
native kernels a Zen 3 runs (no AVX-512, no VNNI) on a newer CPU; beside it, ``--llama-cpp DIR``
takes llama-cpp-python from DIR (``pip install --target DIR``), e.g. a build with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"``.
``--kv-dtype float16`` gives the native lines llama.cpp's default K/V format (the model's float32
otherwise: twice the bytes a decode step's attention reads).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.backends.native.kernel import ISA_FLAGS
from twophase.bench import sweeps
from twophase.measure.quality import all_logits, shipped_text
from twophase.models import hub

MODEL = "smollm2-135m-instruct"
LINES = ("native-gguf", "native-gguf-int8", "native-q4", "onnxruntime-q4", "onnxruntime-native-q4", "onnxruntime-fp32")


def twophase_line(backend: str | dict, quantization: str, gguf: str | None = None, kv_dtype: str = "auto") -> LLM:
    model = {"path": gguf} if gguf else {"name": MODEL}
    return LLM.from_config({"model": {**model, "quantization": quantization},
                            "backend": {"name": backend} if isinstance(backend, str) else backend,
                            "scheduler": {"policy": "prefill-first", "max_num_batched_tokens": 512,
                                          "max_num_seqs": 32},
                            # 32 x 640 tokens, any grouping; the pool's pages backed at the start, as
                            # llama.cpp's reused cells are after its warm-up (a page's first write
                            # costs a fault: 4% of a pp512 step on a VM)
                            "cache": {"num_blocks": "auto", "memory_gb": 1.5, "prefault": True,
                                      "dtype": kv_dtype}})


class LlamaCpp:
    def __init__(self, path: str, threads: int, flash: bool):
        from llama_cpp import Llama

        self.flash = flash
        self.llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads,
                         flash_attn=flash, verbose=False)

    def all_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``ids`` (a fresh context that keeps them all)."""
        import numpy as np
        from llama_cpp import Llama

        llm = Llama(model_path=self.llm.model_path, n_ctx=len(ids) + 16, n_batch=512,
                    n_threads=self.llm.n_threads, flash_attn=self.flash, logits_all=True, verbose=False)
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))

    def pp(self, n: int, salt: int) -> float:
        tokens = [100 + (i * 7 + salt) % 40000 for i in range(n)]
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(tokens)
        return n / (time.perf_counter() - t)

    def tg(self, n: int, salt: int) -> float:
        """As llama-bench's tg: one token a step, fed without sampling (twophase's lines sample
        greedily, so this favours llama.cpp by the sampling time)."""
        self.llm.reset()
        self.llm.eval([100 + salt])
        t = time.perf_counter()
        for i in range(n):
            self.llm.eval([100 + (salt + 13 * i) % 40000])
        return n / (time.perf_counter() - t)


    def tg_batched(self, batch: int, context: int, steps: int) -> float:
        """As llama-batched-bench: ``batch`` sequences of ``context`` tokens in one context, then
        ``steps`` decode steps of one token each, fed without sampling; tokens/s of those steps."""
        import llama_cpp as lc

        params = lc.llama_context_default_params()
        params.n_ctx = batch * (context + steps + 8)
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = batch
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.llm.n_threads
        params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash
                                  else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        ctx = lc.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp: no context for the batched line")
        b = lc.llama_batch_init(512, 0, 1)
        try:
            def run(items: list[tuple[int, int, int, bool]]) -> None:
                for start in range(0, len(items), 512):
                    chunk = items[start:start + 512]
                    b.n_tokens = len(chunk)
                    for i, (tok, pos, seq, out) in enumerate(chunk):
                        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
                        b.seq_id[i][0] = seq
                    if lc.llama_decode(ctx, b) != 0:
                        raise RuntimeError("llama.cpp: llama_decode failed")
                lc.llama_synchronize(ctx)

            run([(100 + (s * 131 + p * 7) % 40000, p, s, p == context - 1)
                 for s in range(batch) for p in range(context)])
            t = time.perf_counter()
            for k in range(steps):
                run([(100 + (s * 13 + k) % 40000, context + k, s, True) for s in range(batch)])
            return batch * steps / (time.perf_counter() - t)
        finally:
            lc.llama_batch_free(b)
            lc.llama_free(ctx)


class Isolated:
    """One engine in a process of its own (two OpenMP runtimes in one process spin against each
    other): ``kind`` "twophase" (a config dict) or "llama.cpp" (path, threads, flash)."""

    def __init__(self, kind: str, *args):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, args), daemon=True)
        self.proc.start()
        self.call("ready")

    def call(self, what: str, *args):
        self.conn.send((what, args))
        while not self.conn.poll(1.0):      # a crashed engine would otherwise hang the run
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine's process died (exit code {self.proc.exitcode})")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self.conn.send(("stop", ()))
        self.proc.join(timeout=30)


def _serve(conn, kind: str, args) -> None:
    try:
        if kind == "llama.cpp":
            eng = LlamaCpp(*args)
            calls = {"pp512": lambda k: eng.pp(512, k), "tg batch 1": lambda k: eng.tg(128, k),
                     "tg batch 32": lambda k: eng.tg_batched(32, 128, 8)}
        else:
            llm = twophase_line(*args)
            calls = {"pp512": lambda k: 512 / sweeps.prefill_round(llm, 512, 0, k),
                     "tg batch 1": lambda k: 1 / sweeps.decode_round(llm, 1, 128, 16, k),
                     "tg batch 32": lambda k: 32 / sweeps.decode_round(llm, 32, 128, 8, k)}
        calls["ready"] = lambda: [calls[c](99) for c in calls if c != "ready"] and None   # warm
    except Exception as exc:
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    while True:
        what, a = conn.recv()
        if what == "stop":
            return
        try:
            conn.send((True, calls[what](*a) if what in calls else None))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def llama_engines(console: Console, gguf: str, threads: int) -> dict:
    """llama.cpp on ``gguf``, flash attention on and off, each in its own process, where
    llama-cpp-python is installed."""
    try:
        import llama_cpp
    except ImportError:
        console.print("[yellow]llama-cpp-python is not installed: llama.cpp lines skipped "
                      "(pip install 'twophase\\[llama-cpp]'; it compiles for ~20 minutes)")
        return {}
    console.print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__} from {llama_cpp.__file__}")
    return {f"llama.cpp (flash attention {'on' if flash else 'off'})": Isolated("llama.cpp", gguf, threads, flash)
            for flash in (True, False)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf", help="a GGUF file (default: the default model's); e.g. a Q4_K_M file")
    ap.add_argument("--lines", default=",".join(LINES),
                    help="twophase's lines to run, of those names")
    ap.add_argument("--isa", default="native", choices=tuple(ISA_FLAGS),
                    help="the native kernels' instruction set (avx2: what a Zen 3 runs)")
    ap.add_argument("--llama-cpp", metavar="DIR", help="take llama-cpp-python from DIR (pip install --target DIR)")
    ap.add_argument("--no-quality", action="store_true", help="the speed table only")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "float16", "int8"),
                    help="twophase's K/V format (auto: the model's float32; llama.cpp's default is float16)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    unknown = set(args.lines.split(",")) - set(LINES)
    if unknown:
        ap.error(f"--lines: no line {', '.join(sorted(unknown))}; the lines are {', '.join(LINES)}")
    if args.llama_cpp:
        if not (Path(args.llama_cpp) / "llama_cpp").is_dir():
            ap.error(f"--llama-cpp {args.llama_cpp}: no llama_cpp package there (pip install --target DIR)")
        sys.path.insert(0, args.llama_cpp)          # spawned engines start with this sys.path too
    return args


def main() -> None:
    args = parse_args()
    console = Console()
    g = args.gguf
    native = {"name": "native", "options": {"isa": args.isa}}
    kv = args.kv_dtype
    int8 = {"name": "native", "options": {"isa": args.isa, "amx": False}}      # no AMX tiles in prefill
    every = {"native-gguf": ("twophase gguf (native)", (native, "gguf", g, kv)),
             "native-gguf-int8": ("twophase gguf (native, int8 prefill)", (int8, "gguf", g, kv)),
             "native-q4": ("twophase q4 (native)", (native, "q4", g, kv)),
             "onnxruntime-q4": ("twophase q4 (onnxruntime)", ("onnxruntime", "q4", g)),
             "onnxruntime-native-q4": ("twophase q4 (onnxruntime → native)", (
                 {"prefill": {"name": "onnxruntime"}, "decode": native}, "q4", g)),
             "onnxruntime-fp32": ("twophase fp32 (onnxruntime)", ("onnxruntime", "none", g))}
    lines = dict(every[n] for n in args.lines.split(","))
    cases = ("pp512", "tg batch 1", "tg batch 32")
    engines = {name: Isolated("twophase", *line) for name, line in lines.items()}
    engines.update(llama_engines(console, g or str(hub.gguf_path(MODEL)), args.threads))
    rates: dict[str, dict[str, list[float]]] = {name: {c: [] for c in cases} for name in engines}
    with console.status("measuring") as status:
        for k in range(args.rounds):
            for case in cases:
                for name, eng in engines.items():
                    status.update(f"round {k + 1}/{args.rounds}: {case} on {name}")
                    time.sleep(1.0)     # the last engine's work out of /proc/stat: a governed
                    rates[name][case].append(eng.call(case, k))   # engine would take it for a neighbour
    for eng in engines.values():
        eng.close()
    first = next(iter(engines))
    table = Table(title=f"{g or MODEL}, CPU, {args.threads} threads, native kernels: {args.isa}, K/V: {kv}, "
                        f"each engine in its own process: "
                        f"tokens/s, median of {args.rounds} interleaved rounds (ratio to {first})")
    table.add_column("engine")
    for case in cases:
        table.add_column(case, justify="right")
    base = {c: statistics.median(rates[first][c]) for c in cases}
    for name in engines:
        cells = []
        for c in cases:
            v = rates[name][c]
            cells.append(f"{statistics.median(v):.1f} (x{statistics.median(v) / base[c]:.2f})" if v else "-")
        table.add_row(name, *cells)
    console.print(table)
    if args.no_quality:
        return
    graded: dict = {name: twophase_line(*line) for name, line in lines.items() if line[1] != "none"}
    if any(n.startswith("llama.cpp") for n in engines):
        graded["llama.cpp"] = LlamaCpp(g or str(hub.gguf_path(MODEL)), args.threads, True)
    quality(console, twophase_line("torch", "none", g), graded)


def quality(console: Console, reference: LLM, engines: dict) -> None:
    """Each engine's next-token distributions on the shipped text against the fp32 model's."""
    import math

    ids = reference.tokenizer.encode(shipped_text())
    ref = torch.log_softmax(torch.cat([lg for _, lg in all_logits(reference, ids)]), dim=-1)
    targets = torch.tensor(ids[1:])

    def nll(lp: torch.Tensor) -> float:
        return -float(lp[:-1][torch.arange(len(targets)), targets].mean())

    table = Table(title=f"quality on the shipped text ({len(ids)} tokens), against fp32")
    for col in ("engine", "perplexity", "vs fp32", "mean KL (nats)", "top-1 agreement"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    table.add_row("twophase fp32 (torch)", f"{math.exp(nll(ref)):.3f}", "-", "-", "-")
    for name, eng in engines.items():
        logits = eng.all_logits(ids) if isinstance(eng, LlamaCpp) else \
            torch.cat([lg for _, lg in all_logits(eng, ids)])
        lp = torch.log_softmax(logits, dim=-1)
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        top1 = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
        table.add_row(name, f"{math.exp(nll(lp)):.3f}", f"{100 * (math.exp(nll(lp) - nll(ref)) - 1):+.2f}%",
                      f"{kl:.4f}", f"{100 * top1:.1f}%")
    console.print(table)


if __name__ == "__main__":
    main()
