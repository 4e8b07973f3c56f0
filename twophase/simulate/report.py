"""What a simulated run reports: ``LLM.report``'s phase report (the keys ``twophase run --json``
writes, so simulated and measured runs compare key by key), and beside it goodput against SLOs,
KV occupancy and preemptions over time, each phase's share of the device's compute and
bandwidth, and how much faster than real time the simulation ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from twophase.core.metrics import StepRecord
from twophase.core.outputs import RequestOutput
from twophase.core.request import RequestTimes
from twophase.errors import ConfigError
from twophase.simulate.backend import Call
from twophase.simulate.devices import DeviceSpec
from twophase.simulate.driver import Run

MAX_POINTS = 2000              # timeline points kept in the JSON


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, t: RequestTimes) -> bool:
        """Every SLO that is set holds for this request (a request of one token has no TPOT)."""
        for limit, value in ((self.ttft_s, t.ttft), (self.tpot_s, t.tpot), (self.e2e_s, t.e2e)):
            if limit is not None and value is not None and value > limit:
                return False
        return t.ttft is not None

    def describe(self) -> str:
        parts = [f"{k.removesuffix('_s')} <= {v:g} s" for k, v in asdict(self).items() if v is not None]
        return ", ".join(parts) or "none"


def parse_slo(text: str | None) -> SLO:
    """``"ttft=2,tpot=0.1"`` (seconds; keys ttft, tpot, e2e)."""
    if not text:
        return SLO()
    out: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in ("ttft", "tpot", "e2e"):
            raise ConfigError("--slo", f"unknown SLO {key!r}; give ttft=S,tpot=S,e2e=S")
        try:
            out[f"{key}_s"] = float(value)
        except ValueError:
            raise ConfigError("--slo", f"{key}: expected seconds, got {value!r}") from None
    return SLO(**out)


def goodput(outputs: list[RequestOutput], wall_s: float, slo: SLO) -> dict[str, Any]:
    """DistServe's goodput: requests a second that meet every SLO, and the share that do."""
    served = [o.times for o in outputs if o.times is not None]
    ok = sum(slo.met(t) for t in served)
    return {"slo": {k: v for k, v in asdict(slo).items() if v is not None},
            "requests_meeting_slo": ok, "attainment": ok / len(served) if served else None,
            "goodput_rps": ok / wall_s if wall_s else None,
            "request_rate_rps": len(served) / wall_s if wall_s else None}


def utilization(calls: list[Call], wall_s: float, device: DeviceSpec, engines: int = 1,
                tp: int = 1) -> dict[str, dict[str, float]]:
    """Each phase's FLOPs and bytes over the run, as shares of what the devices' (``engines`` of
    ``tp`` each) peak compute and bandwidth could have done in the run's time; the engines'
    busy and all-reduce shares of it, and which bound their steps."""
    out: dict[str, dict[str, float]] = {}
    room = wall_s * engines * tp
    for phase in ("prefill", "decode"):
        flops = sum(getattr(c.cost, f"{phase}_flops") for c in calls)
        moved = sum(getattr(c.cost, f"{phase}_bytes") for c in calls)
        out[phase] = {"flops": flops, "bytes": moved,
                      "compute_share": flops / (device.peak_flops * room) if room else 0.0,
                      "bandwidth_share": moved / (device.bandwidth * room) if room else 0.0}
    busy = sum(c.cost.seconds for c in calls)
    comm = sum(c.cost.comm_s for c in calls)
    out["device"] = {"busy_share": busy / (wall_s * engines) if wall_s else 0.0,
                     "all_reduce_share": comm / (wall_s * engines) if wall_s else 0.0,
                     "compute_bound_steps": sum(c.cost.bound == "compute" for c in calls),
                     "memory_bound_steps": sum(c.cost.bound == "memory" for c in calls)}
    return out


def timeline(steps: list[StepRecord], run: Run, num_blocks: int) -> list[dict[str, float]]:
    """After each step (the steps of every engine, by start): KV blocks in use over the
    deployment (and as a share of its pools), preemptions so far, requests waiting and running;
    at most ``MAX_POINTS`` evenly spaced steps."""
    every = max(1, -(-len(steps) // MAX_POINTS))
    out, preempted = [], 0
    for i, s in enumerate(steps):
        preempted += s.preemptions
        if i % every and i != len(steps) - 1:
            continue
        t, waiting, running, used = run.queue[i] if i < len(run.queue) else (
            s.start + s.duration, 0, 0, s.kv_blocks_used)
        out.append({"t_s": t - run.start, "kv_blocks_used": used,
                    "kv_occupancy": used / num_blocks if num_blocks else 0.0,
                    "preemptions": preempted, "waiting": waiting, "running": running})
    return out


def simulation_report(fleet: Any, run: Run, slo: SLO) -> dict[str, Any]:
    """``{"report": LLM.report's keys, "simulation": the simulator's own figures}`` for a
    ``Fleet`` (one engine, replicas, or prefill and decode workers)."""
    report = fleet.report(run.outputs)
    names = report["backend"]
    report["backend"] = {**names, "prefill": f"{names['prefill']} (simulated)",
                         "decode": f"{names['decode']} (simulated)", "device": fleet.device.name}
    steps = fleet.steps
    wall = report["wall_s"]
    calls = [c for b in fleet.backends for c in b.calls]
    first = fleet.members[0].llm
    good = goodput(run.outputs, wall, slo)
    good["goodput_per_device_rps"] = (good["goodput_rps"] or 0.0) / fleet.devices
    return {"report": report, "simulation": {
        "device": asdict(fleet.device), "model": fleet.model.model_id,
        "tp": fleet.tp, "devices": fleet.devices,
        "engines": [{"name": m.name, "role": m.role, "num_blocks": m.llm.num_blocks,
                     "steps": m.llm.engine.stats().num_steps,
                     "busy_s": sum(c.cost.seconds for b in m.llm.backends for c in b.calls)}
                    for m in fleet.members],
        "num_blocks": fleet.num_blocks, "block_size": fleet.config.cache.block_size,
        "max_num_seqs": first.engine.limits.max_num_seqs,
        "max_num_batched_tokens": first.engine.limits.max_num_batched_tokens,
        "simulated_s": wall, "host_s": run.host_s,
        "speedup_vs_real_time": wall / run.host_s if run.host_s else None,
        "rejected": len(run.rejected),
        "goodput": good,
        "utilization": utilization(calls, wall, fleet.device, len(fleet.members), fleet.tp),
        "kv_transfers": _transfers(fleet),
        "timeline": timeline(steps, run, fleet.num_blocks),
        "ttft_values": [o.times.ttft for o in run.outputs if o.times and o.times.ttft is not None],
        "tpot_values": [o.times.tpot for o in run.outputs if o.times and o.times.tpot is not None]}}


def _transfers(fleet: Any) -> dict[str, float] | None:
    """Prompts' K/V pulled by decode workers: how many, their bytes and the pulls' times."""
    pulls = [t for m in fleet.by_role("decode") for t in m.connector.transfers]
    if not pulls:
        return None
    seconds = sorted(s for _, _, s in pulls)
    return {"pulls": len(pulls), "bytes": sum(b for _, b, _ in pulls),
            "p50_s": seconds[len(seconds) // 2], "max_s": seconds[-1]}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def simulation_table(sim: dict[str, Any]) -> Table:
    d, g, u = sim["device"], sim["goodput"], sim["utilization"]
    t = Table(title=f"simulation: {sim['model']} on {d['name']} ({d['source']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("device peak / bandwidth", f"{d['peak_flops'] / 1e12:.3g} TFLOP/s / {d['bandwidth'] / 1e9:.4g} GB/s"),
        ("efficiency compute / bandwidth, overhead a step",
         f"{d['compute_efficiency']:.2f} / {d['bandwidth_efficiency']:.2f}, {d['step_overhead_s'] * 1e3:.2f} ms"
         + (f" + {d['seq_overhead_s'] * 1e3:.2f} ms a sequence + {d['kv_byte_s'] * 1e9:.2f} ms a MB of K/V"
            if d["seq_overhead_s"] or d["kv_byte_s"] else "")),
        ("KV pool", f"{sim['num_blocks']} blocks × {sim['block_size']} tokens"),
        ("max_num_seqs / token budget", f"{sim['max_num_seqs']} / {sim['max_num_batched_tokens']}"),
        ("SLO", ", ".join(f"{k.removesuffix('_s')} <= {v:g} s" for k, v in g["slo"].items()) or "none"),
        ("goodput (req/s meeting SLO) / attainment",
         f"{g['goodput_rps'] or 0:.3f} / {100 * (g['attainment'] or 0):.1f}%"),
        ("request rate served", f"{g['request_rate_rps'] or 0:.3f} req/s"),
        ("prefill: share of compute / bandwidth",
         f"{100 * u['prefill']['compute_share']:.1f}% / {100 * u['prefill']['bandwidth_share']:.1f}%"),
        ("decode: share of compute / bandwidth",
         f"{100 * u['decode']['compute_share']:.1f}% / {100 * u['decode']['bandwidth_share']:.1f}%"),
        ("steps compute / memory bound",
         f"{u['device']['compute_bound_steps']} / {u['device']['memory_bound_steps']}"),
        ("peak KV occupancy", f"{100 * max((p['kv_occupancy'] for p in sim['timeline']), default=0):.1f}%"),
        ("simulated / host time", f"{sim['simulated_s']:.2f} s / {sim['host_s']:.3f} s "
                                  f"({sim['speedup_vs_real_time'] or 0:.0f}x real time)"),
    ]
    if sim["rejected"]:
        rows.append(("rejected requests", str(sim["rejected"])))
    for k, v in rows:
        t.add_row(k, v)
    return t


def plot(result: dict[str, Any], path: Path) -> Path:
    """Latency CDFs (TTFT, TPOT) and KV occupancy and preemptions over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = result["simulation"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft_values", "TTFT"), (axes[1], "tpot_values", "TPOT")):
        v = sorted(sim[key])
        if v:
            ax.step([x * 1e3 for x in v], [(i + 1) / len(v) for i in range(len(v))], where="post")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    limit = sim["goodput"]["slo"]
    for ax, key in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
        if key in limit:
            ax.axvline(limit[key] * 1e3, color="red", linestyle="--", label="SLO")
            ax.legend()
    tl = sim["timeline"]
    ax = axes[2]
    ax.plot([p["t_s"] for p in tl], [100 * p["kv_occupancy"] for p in tl], label="KV occupancy")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_title("KV occupancy and preemptions")
    twin = ax.twinx()
    twin.plot([p["t_s"] for p in tl], [p["preemptions"] for p in tl], color="tab:red", label="preemptions")
    twin.set_ylabel("preemptions so far")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{sim['model']} on {sim['device']['name']} (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
