"""One mixture-of-experts layer on each engine that runs it: torch's routed loop (the eager
path), ONNX Runtime's fused ``MoE`` operator (what the onnxruntime backend's graph calls), and
IREE's two static forms (every expert on every token, its prefill; each token's experts
gathered, its decode). Tokens/s a step of N tokens, each engine in a process of its own,
rounds interleaved, the median of the rounds.

    python benchmarks/moe_graph.py [--shape qwen3|gpt-oss|deepseek] [--tokens 1,8,64,256] [--rounds 3]

The shapes keep their models' ratio of experts to chosen ones and their gate, at a hidden size
of 1024 so a layer's weights stay near 200 MB: ``qwen3`` 64 experts of 256, top 4 (SiLU);
``gpt-oss`` 32 experts of 512, top 4, biased, the clamped SwiGLU; ``deepseek`` 64 experts of 256,
top 6, V3's routing (sigmoid scores, a choosing bias, the best 4 of 8 groups, renormalised,
scaled by 2.5: ONNX Runtime's operator gets it as logits) and a shared expert of 512.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"qwen3": dict(hidden=1024, f=256, experts=64, top_k=4, act="silu", bias=False),
          "gpt-oss": dict(hidden=1024, f=512, experts=32, top_k=4, act="clamped_swiglu", bias=True),
          "deepseek": dict(hidden=1024, f=256, experts=64, top_k=6, act="silu", bias=False,
                           routing=dict(scoring="sigmoid", score_bias=True, groups=8, topk_groups=4,
                                        group_score="top2", routed_scale=2.5, shared_intermediate_size=512))}
ENGINES = ("torch", "onnxruntime", "iree-dense", "iree-gathered")


def layer(shape: dict):
    import torch

    from twophase.arch import MLPSpec
    from twophase.models.layers.mlp import Glu
    from twophase.models.layers.moe import MoE

    torch.manual_seed(0)
    m = MoE(shape["hidden"], MLPSpec(shape["f"], shape["experts"], shape["top_k"], True, **shape.get("routing", {})),
            Glu(shape["act"]), shape["bias"]).eval().requires_grad_(False)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    return m


def runner(engine: str, shape: dict, cache: Path):
    """A function of a ``[T, hidden]`` float32 array, built (or loaded from ``cache``) once."""
    import numpy as np
    import torch

    from twophase.models.layers.moe import traced_as

    m = layer(shape)
    x = torch.randn(8, shape["hidden"])
    dim = {0: torch.export.Dim("T", min=1, max=4096)}
    if engine == "torch":
        return lambda a: m(torch.from_numpy(a))
    if engine == "onnxruntime":
        import onnxruntime as ort

        from twophase.exporters import onnx_moe

        path = cache / "moe.onnx"
        if not path.exists():
            with traced_as(m, "op"):
                torch.onnx.export(m, (x,), str(path), dynamo=True, dynamic_shapes=(dim,), external_data=True,
                                  custom_translation_table=onnx_moe.translations(), optimize=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return lambda a: sess.run(None, {name: a})[0]
    import iree.runtime as rt
    from iree.turbine import aot

    from twophase.exporters.mlir import target_flags

    form = engine.removeprefix("iree-")
    path = cache / f"moe-{form}.vmfb"
    if not path.exists():
        with torch.inference_mode(), traced_as(m, form):
            out = aot.export(m, args=(x,), dynamic_shapes={"x": dim})
        out.session.set_flags(*target_flags("cpu"))
        out.compile(save_to=str(path))
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, path.read_bytes()))
    fn = ctx.modules.module["main"]
    return lambda a: np.asarray(fn(a).to_host())


def worker(args) -> dict:
    import numpy as np

    run = runner(args.worker, SHAPES[args.shape], Path(args.cache))
    out = {}
    for n in args.tokens:
        a = np.random.default_rng(n).standard_normal((n, SHAPES[args.shape]["hidden"])).astype(np.float32)
        run(a)                                               # warm
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            run(a)
            times.append(time.perf_counter() - t)
        out[n] = n / statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="qwen3")
    ap.add_argument("--tokens", default="1,8,64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        rounds: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for e in engines:
                cache = Path(tmp) / e
                cache.mkdir(exist_ok=True)
                cmd = [sys.executable, __file__, "--worker", e, "--cache", str(cache), "--shape", args.shape,
                       "--tokens", ",".join(map(str, args.tokens)), "--reps", str(args.reps)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{e} failed:\n{done.stderr[-2000:]}")
                rounds[e].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}: {e} done", file=sys.stderr)
    s = SHAPES[args.shape]
    print(f"\none MoE layer, {args.shape} shape (hidden {s['hidden']}, {s['experts']} experts of {s['f']}, "
          f"top {s['top_k']}), tokens/s, median of {args.rounds} rounds; x = against torch's routed loop")
    print(f"{'engine':<15}" + "".join(f"{f'T={n}':>18}" for n in args.tokens))
    base = {n: statistics.median(r[str(n)] for r in rounds["torch"]) for n in args.tokens} if "torch" in rounds else {}
    for e in engines:
        cells = []
        for n in args.tokens:
            v = statistics.median(r[str(n)] for r in rounds[e])
            cells.append(f"{v:>10.0f}" + (f" (x{v / base[n]:.2f})" if base else ""))
        print(f"{e:<15}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
