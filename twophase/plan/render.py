"""A plan as people read it: a table of what eats the memory and the figures that follow, a
stacked bar of the same items, and concurrency against context."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from twophase.models import param_counts
from twophase.plan.budget import GiB, MiB, Plan

COLORS = {"weights": "#4c72b0", "kv cache": "#55a868", "activations": "#c44e52", "logits": "#dd8452",
          "cuda graphs": "#8172b3", "workspace": "#937860", "runtime": "#8c8c8c", "reserve": "#dddddd",
          "adapters": "#da8bc3"}


def human(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def table(p: Plan) -> Table:

    t = Table(title=f"{p.model.model_id} on {p.device.name} ({human(p.device.total_bytes)}: "
                    f"{p.device.source}); shapes from {p.model.source}")
    for col, justify in (("item", "left"), ("", "left"), ("bytes", "right"), ("share", "right"),
                         ("how", "left")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i in p.items:
        share = 100 * i.bytes / p.device.total_bytes if p.device.total_bytes else 0
        t.add_row(i.kind, i.name, human(i.bytes), f"{share:.1f}%", i.how)
    return t


def summary(p: Plan) -> list[str]:
    groups = p.pool.groups
    grouped = groups.num_groups > 1
    lines = [f"KV cache: {human(p.kv_bytes_per_token * 1024)} per 1k tokens in every layer "
             f"({p.kv_bytes_per_token:,} B a token); {p.num_blocks:,} blocks"
             + (f" of {groups.num_slots} layers: one sequence of up to {p.kv_tokens:,} tokens"
                if grouped else f" = {p.kv_tokens:,} tokens"),
             f"largest max_model_len one request can use: {min(p.kv_tokens, p.max_model_len):,}"
             + ("" if p.kv_tokens >= p.max_model_len else f" (the model's is {p.max_model_len:,})"),
             f"K/V of one sequence of {p.context:,} tokens: {human(p.sequence_kv_bytes(p.context))}"
             + _layers(p),
             f"max concurrency at {p.context:,} tokens: {p.concurrency(p.context):,}"]
    st = p.pool.state
    if st is not None:
        attending = len(p.pool.groups.group)
        lines[0] = lines[0].replace("in every layer", f"in the {attending} attention layers")
        lines += [f"state: {human(st.bytes_per_sequence())} a sequence in {st.num_layers} state layers, "
                  f"whatever its length; {p.pool.running_slots} running slots "
                  f"(scheduler.max_num_seqs) and {p.pool.state_snapshots} prefix snapshots "
                  f"(cache.state_snapshots) = {human(p.pool.state_bytes)}",
                  f"a full-attention model of the same width ({p.model.arch.num_layers} layers of K/V) "
                  f"would hold {p.full_attention_concurrency(p.context):,} at {p.context:,} tokens in the same memory"]
    lines += _active(p) + _latent(p)
    if p.users is not None:
        conc = p.concurrency(p.context)
        lines.append(f"{p.users} users at {p.context:,} tokens: " + (
            "all fit" if p.users <= conc else
            f"{conc} run at once; {p.users - conc} wait in the queue (or, admitted while the others "
            f"grow, are preempted and recomputed)"))
    return lines + [f"note: {n}" for n in p.notes]


def _latent(p: Plan) -> list[str]:
    """Multi-head latent attention's cache beside the per-head K and V it stands for."""
    arch = p.model.arch
    m = arch.mla
    if m is None:
        return []
    per_head = len(arch.attention_layers) * arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    value_bytes = p.kv_bytes_per_token / (len(arch.attention_layers) * m.latent_dim)
    return [f"latent cache: {m.latent_dim} values a token a layer (kv_lora_rank {m.kv_lora_rank} + rotary key "
            f"{m.qk_rope_head_dim}) shared by {arch.num_heads} heads: {p.kv_bytes_per_token:,} B a token, where "
            f"each head's K and V would take {int(per_head * value_bytes):,} B "
            f"(x{per_head / (len(arch.attention_layers) * m.latent_dim):.0f})"]


def _active(p: Plan) -> list[str]:
    """A mixture of experts' weights a token reads against those it holds."""
    active = p.active_weights()
    if active is None:
        return []
    read, held = active
    arch = p.model.arch
    moe = [s.mlp for s in arch.layers if s.mlp.num_experts]
    n_active, n_total = sum(param_counts.active_group_params(arch).values()), param_counts.num_params(arch)
    return [f"active weights: {human(read)} of {human(held)} a token reads ({100 * read / held:.1f}%): "
            f"{moe[0].top_k} of {moe[0].num_experts} experts in {len(moe)} layers, attention, norms and the "
            f"head whole, the embedding's one row; {n_active / 1e9:.2f}B of {n_total / 1e9:.2f}B parameters"]


def _layers(p: Plan) -> str:
    """How the pool counts the layers: windows where sliding layers give back blocks."""
    g = p.pool.groups
    if all(w is None for w in g.windows):
        return ""
    full = sum(1 for i in g.group if g.windows[i] is None)
    slide = len(g.group) - full
    w = max(x for x in g.windows if x is not None)
    return (f" ({full} full-attention layers at every token, {slide} sliding at their {w:,}-token "
            f"window; in {g.num_groups} groups of {g.num_slots} layers)" if full else
            f" (every layer slides: a {w:,}-token window)")


def contexts(p: Plan) -> list[int]:
    """Powers of two from 256 up to the longest context a request may have."""
    top = max(256, min(p.max_model_len, p.kv_tokens) or 256)
    out, c = [], 256
    while c < top:
        out.append(c)
        c *= 2
    return out + [top]


def plot(p: Plan, path: Path) -> Path:
    """The budget as one stacked bar, beside concurrency against context (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (bar, curve) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1, 2]})
    bottom = 0.0
    for i in p.items:
        gib = i.bytes / GiB
        bar.bar(0, gib, bottom=bottom, color=COLORS.get(i.kind, "#cccccc"), edgecolor="white", width=0.6)
        if gib > 0.03 * p.device.total_bytes / GiB:
            bar.text(0, bottom + gib / 2, f"{i.kind}: {i.name}\n{human(i.bytes)}", ha="center",
                     va="center", fontsize=7)
        bottom += gib
    bar.axhline(p.device.total_bytes / GiB, color="black", linestyle="--", linewidth=1)
    bar.text(0.32, p.device.total_bytes / GiB, f" {p.device.name}", va="bottom", fontsize=8)
    bar.set_xticks([])
    bar.set_ylabel("GiB")
    bar.set_title("what eats the memory")
    xs = contexts(p)
    ys = [max(p.concurrency(c), 0) for c in xs]
    curve.plot(xs, ys, marker="o")
    curve.set_xscale("log", base=2)
    curve.set_yscale("symlog")
    plain = FuncFormatter(lambda v, _pos: f"{v:,.0f}")
    curve.xaxis.set_major_formatter(plain)
    curve.yaxis.set_major_formatter(plain)
    curve.set_xlabel("context per request (tokens)")
    curve.set_ylabel("requests at once")
    curve.set_title(f"concurrency: {p.kv_tokens:,} KV tokens")
    curve.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{p.model.model_id} on {p.device.name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
