"""Parameter counts and matrix shapes, read off the family's module built on the meta device,
so the planner, the roofline and the loaders never count a model differently from the model."""

from __future__ import annotations

import functools

import torch

from twophase.arch import ModelArch

GROUPS = ("embedding", "attention", "mlp", "norms", "head")


@functools.lru_cache(maxsize=32)
def shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by name (a tied head appears once, as the embedding)."""
    from twophase.models.decoder import Decoder
    from twophase.models.meta import no_init

    with torch.device("meta"), no_init():
        model = Decoder(arch)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def group(name: str) -> str:
    """Which of ``GROUPS`` a parameter counts in."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "head"
    if name.endswith("norm.weight"):
        return "norms"
    return "attention" if ".attn." in name or ".mixer." in name else "mlp"    # a state layer mixes tokens too


def stacked(name: str) -> bool:
    """A tensor of every expert's matrix (``[E, out, in]``)."""
    return ".experts_" in name


def num_params(arch: ModelArch) -> int:
    return sum(_numel(s) for s in shapes(arch).values())


def group_params(arch: ModelArch) -> dict[str, int]:
    out = dict.fromkeys(GROUPS, 0)
    for name, s in shapes(arch).items():
        out[group(name)] += _numel(s)
    return out


def matrices(arch: ModelArch) -> dict[str, list[tuple[int, int]]]:
    """The layers' weight matrices as (out, in), per group (``attention``, ``mlp``): what a
    block layout quantises. A stacked experts' tensor counts as one matrix an expert; a state
    layer's depthwise convolution is no matrix."""
    out: dict[str, list[tuple[int, int]]] = {"attention": [], "mlp": []}
    for name, s in shapes(arch).items():
        g = group(name)
        if g in out and not name.endswith(".bias") and (len(s) == 2 or stacked(name)):
            out[g] += [(s[-2], s[-1])] * (s[0] if stacked(name) else 1)
    return out


def biases(arch: ModelArch) -> dict[str, int]:
    """Bias elements per group (kept in float in every layout)."""
    out = {"attention": 0, "mlp": 0}
    for name, s in shapes(arch).items():
        if name.endswith(".bias"):
            out[group(name)] += _numel(s)
    return out


def read_by_a_token(arch: ModelArch, name: str, shape: tuple[int, ...]) -> float:
    """Elements of parameter ``name`` one token multiplies: a stacked experts' tensor's top k of
    its experts, the embedding's one row, any other whole."""
    if stacked(name):
        spec = arch.layers[int(name.split(".")[1])].mlp
        return _numel(shape) * spec.top_k / spec.num_experts
    return shape[-1] if name.startswith("embed.") else _numel(shape)


def active_layer_params(arch: ModelArch) -> float:
    """Matrix weights one token multiplies in an average layer (norms and biases left out): a
    MoE layer's routed experts only."""
    total = sum(read_by_a_token(arch, name, s) for name, s in shapes(arch).items()
                if name.startswith("layers.") and group(name) != "norms" and not name.endswith(".bias"))
    return total / arch.num_layers


def active_group_params(arch: ModelArch) -> dict[str, float]:
    """``group_params`` as one token reads them: a MoE layer's stacked experts at ``top_k /
    num_experts`` of their size, the embedding one row (the head whole)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for name, s in shapes(arch).items():
        out[group(name)] += read_by_a_token(arch, name, s)
    return out


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n
