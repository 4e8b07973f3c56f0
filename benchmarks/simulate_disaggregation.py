"""Where disaggregation pays: colocated replicas against prefill/decode workers on the same GPUs,
simulated with ``twophase simulate``'s fleet (the engine's own scheduler in each worker, the
frontend's routing, the K/V handoff over NVLink), to test DistServe's finding (OSDI 2024):
splitting prefill from decode raises goodput, the request rate at which 90% of requests meet
both a TTFT and a TPOT SLO, under tight TPOT SLOs, and does not raise raw throughput.

    python benchmarks/simulate_disaggregation.py [--device h100-80gb] [--model llama3-8b]
        [--requests 300] [--json FILE] [--plot FILE]

For each deployment (two GPUs: 2 replicas or 1 prefill + 1 decode worker; three: 3 replicas or
2 prefill + 1 decode, DistServe's choice for OPT-13B) and each SLO, it sweeps the Poisson rate
and reports attainment per rate, goodput per GPU (the highest rate per GPU swept at which 90% of
requests meet the SLO) and raw throughput (every request at once).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from twophase.bench.serving import synthetic
from twophase.config import load_config
from twophase.simulate import fleet
from twophase.simulate.devices import device_spec
from twophase.simulate.report import SLO, goodput

DEPLOYMENTS = {  # name: ([cluster] section, GPUs)
    "2 replicas": ({"replicas": 2}, 2),
    "1 prefill + 1 decode": ({"prefill_workers": 1, "decode_workers": 1}, 2),
    "3 replicas": ({"replicas": 3}, 3),
    "2 prefill + 1 decode": ({"prefill_workers": 2, "decode_workers": 1}, 3),
}
SLOS = {"tight TPOT (ttft 1 s, tpot 15 ms)": SLO(ttft_s=1.0, tpot_s=0.015),
        "loose TPOT (ttft 1 s, tpot 50 ms)": SLO(ttft_s=1.0, tpot_s=0.05)}
RATES_PER_GPU = [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0]
PROMPTS, OUTPUTS = [1000, 3000], [100, 300]      # long prompts, as in summarising or RAG


def run(model: str, device: str, cluster: dict[str, Any], n: int, rate: float | None) -> dict[str, Any]:
    """One simulated run: output throughput, p90 latencies and each SLO's attainment."""
    cfg = load_config({"model": {"name": model, "weights": "random", "dtype": "bfloat16"},
                       "backend": {"name": "torch"}, "scheduler": {"max_num_seqs": 256}, "cluster": cluster})
    f = fleet.Fleet(cfg, device_spec(device, "bfloat16"))
    done = fleet.drive(f, synthetic(n, rate, PROMPTS, OUTPUTS, 32000, seed=0))
    r = f.report(done.outputs)
    return {"attainment": {name: goodput(done.outputs, r["wall_s"], slo)["attainment"] for name, slo in SLOS.items()},
            "output_tok_s": r["output_tokens_per_s"],
            "ttft_p90_s": r["ttft_s"]["p90"], "tpot_p90_s": r["tpot_s"]["p90"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="h100-80gb")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE", help="a PNG: attainment against rate per GPU")
    args = p.parse_args()
    console = Console()
    results: dict[str, Any] = {}
    for name, (cluster, gpus) in DEPLOYMENTS.items():
        sweep = {r: run(args.model, args.device, cluster, args.requests, r * gpus) for r in RATES_PER_GPU}
        raw = run(args.model, args.device, cluster, args.requests, None)["output_tok_s"]
        for slo_name in SLOS:
            ok = [r for r, x in sweep.items() if (x["attainment"][slo_name] or 0) >= 0.9]
            results.setdefault(slo_name, {})[name] = {
                "gpus": gpus, "goodput_per_gpu_rps": max(ok, default=0.0), "raw_output_tok_s": raw,
                "raw_per_gpu": raw / gpus,
                "sweep": {r: {**x, "attainment": x["attainment"][slo_name]} for r, x in sweep.items()}}
    for slo_name, rows in results.items():
        t = Table(title=f"{args.model} on {args.device}, prompts {PROMPTS[0]}-{PROMPTS[1]}, outputs "
                        f"{OUTPUTS[0]}-{OUTPUTS[1]}: {slo_name}")
        for col in ("deployment", "GPUs", *(f"{r:g}/GPU" for r in RATES_PER_GPU), "goodput/GPU",
                    "raw tok/s per GPU"):
            t.add_column(col, justify="right")
        for name, x in rows.items():
            shares = [f"{100 * (x['sweep'][r]['attainment'] or 0):.0f}%" for r in RATES_PER_GPU]
            t.add_row(name, str(x["gpus"]), *shares, f"{x['goodput_per_gpu_rps']:g}", f"{x['raw_per_gpu']:.0f}")
        console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        console.print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
        for ax, (slo_name, rows) in zip(axes[0], results.items()):
            for name, x in rows.items():
                ax.plot(RATES_PER_GPU, [100 * (x["sweep"][r]["attainment"] or 0) for r in RATES_PER_GPU],
                        marker="o", linestyle="--" if "replicas" in name else "-", label=name)
            ax.axhline(90, color="grey", linewidth=0.8)
            ax.set_xlabel("requests/s per GPU")
            ax.set_ylabel("requests meeting the SLO (%)")
            ax.set_title(slo_name)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"{args.model} on {args.device} (simulated): colocated against disaggregated")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        console.print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
