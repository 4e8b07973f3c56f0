"""The phase report as a terminal table."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from twophase.builder.stage_times import load_line


def _f(v: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v * scale)


def phase_table(r: dict[str, Any]) -> Table:
    b = r["backend"]
    t = Table(title=f"phase report ({b['prefill']} prefill, {b['decode']} decode, {b['device']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests / output tokens", f"{r['requests']} / {r['output_tokens']}"),
        ("wall time", f"{r['wall_s']:.2f} s"),
        ("output tokens/s", _f(r["output_tokens_per_s"])),
        ("prefill tokens / tokens/s*", f"{r['prefill_tokens']} / {_f(r['prefill_tokens_per_s'])}"),
        ("decode tokens / tokens/s*", f"{r['decode_tokens']} / {_f(r['decode_tokens_per_s'])}"),
        ("TTFT p50 / p99 (ms)", f"{_f(r['ttft_s']['p50'], 1e3)} / {_f(r['ttft_s']['p99'], 1e3)}"),
        ("TPOT p50 / p99 (ms)", f"{_f(r['tpot_s']['p50'], 1e3)} / {_f(r['tpot_s']['p99'], 1e3)}"),
    ]
    for mix in ("prefill", "decode", "mixed"):
        m = r["steps_by_mix"].get(mix)
        if m:
            rows.append((f"{mix} steps", f"{m['steps']} ({m['seconds']:.2f} s)"))
    rows += [
        ("peak KV blocks used", f"{r['peak_kv_blocks']} of {r['kv_blocks_total']}"),
        ("prefix-cache hit rate", f"{100 * r['prefix_cache_hit_rate']:.1f}%"),
        ("preemptions (computed tokens thrown away)", f"{r['preemptions']} ({r['recomputed_tokens']})"),
    ]
    sp = r.get("speculative")
    draft = b.get("draft")
    if draft:
        rows.append(("draft model", f"{draft['model']} ({draft['quantization']}; {draft['prefill']} "
                                    f"prefill, {draft['decode']} decode)"))
    if sp:
        rows.append(("drafts kept / verified (mean accepted length)",
                     f"{sp['accepted_tokens']} / {sp['draft_tokens']} ({sp['mean_accepted_length']:.2f})"))
        rows.append(("time drafting / in verify steps",
                     f"{sp['propose_s'] * 1e3:.1f} ms / {sp['verify_s']:.2f} s"))
    rows.append(("model load time", load_line(r)))
    for k, v in rows:
        t.add_row(k, v)
    t.caption = "* rates over steps that ran that phase alone; mixed steps are counted apart"
    return t

