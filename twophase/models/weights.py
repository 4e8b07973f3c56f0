"""Building a ``Llama`` on a device from HF-named safetensors or random numbers.

The model is built on the meta device and its parameters assigned or initialised in place, so
nothing is allocated twice and a 16 GB random model never touches host memory on CUDA.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from twophase.models.llama import Llama, rope_inv_freq
from twophase.models.shapes import LlamaArch

_RENAMES = [
    (r"model\.embed_tokens\.", "embed."),
    (r"model\.norm\.", "norm."),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attn.o."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.mlp.down."),
]
_FUSED = {"qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"], "attn"),
          "gate_up": ("mlp", ["gate_proj", "up_proj"], "mlp")}


def from_hf_state_dict(hf: dict[str, torch.Tensor], arch: LlamaArch) -> dict[str, torch.Tensor]:
    """HF Llama names → ours; q/k/v and gate/up concatenated into one matrix each."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        for pat, rep in _RENAMES:
            if re.fullmatch(pat + r"(weight|bias)", name):
                out[re.sub(pat, rep, name)] = t
                break
    if "lm_head.weight" in hf and not arch.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        for ours, (group, parts, mod) in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{group}.{p}.{kind}" for p in parts]
                if all(n in hf for n in names):
                    out[f"layers.{i}.{mod}.{ours}.{kind}"] = torch.cat([hf[n] for n in names])
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], arch: LlamaArch) -> dict[str, torch.Tensor]:
    """Ours → HF Llama names: the inverse of ``from_hf_state_dict`` (fused matrices split)."""
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    q, kv, ffn = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    # ours -> (HF group, HF parts, rows of each part)
    parts = {"attn.qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
             "attn.o": ("self_attn", ("o_proj",), None),
             "mlp.gate_up": ("mlp", ("gate_proj", "up_proj"), [ffn, ffn]),
             "mlp.down": ("mlp", ("down_proj",), None)}
    for i in range(arch.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[ours + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[ours + "mlp_norm.weight"]
        for mod, (group, names, rows) in parts.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"{ours}{mod}.{kind}")
                if t is not None:
                    for name, piece in zip(names, torch.split(t, rows) if rows else [t]):
                        out[f"{hf}{group}.{name}.{kind}"] = piece
    return out


def hf_weights(arch: LlamaArch, folder: Path | None, seed: int) -> dict[str, torch.Tensor]:
    """The model's float32 CPU weights under HF names, exactly as the torch backend holds them
    (random ones drawn from ``seed`` by ``build_model``): what ``ModelSpec.state_dict`` gives
    a backend."""
    model = build_model(arch, torch.float32, torch.device("cpu"), folder, seed)
    return {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), arch).items()}


@contextmanager
def _no_init() -> Iterator[None]:
    """Modules built without their default initialisation: on the meta device it computes
    nothing, yet its first call imports ``torch._dynamo`` (3-11 s of a load on a Zen 3 core);
    every parameter is assigned or drawn below anyway."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_model(arch: LlamaArch, dtype: torch.dtype, device: torch.device,
                folder: Path | None = None, seed: int = 0) -> Llama:
    with torch.device("meta"), _no_init():
        model = Llama(arch)
    if folder is not None:
        from safetensors.torch import load_file

        hf: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            hf.update(load_file(str(f)))
        # copies of what is still a view of the file's mapping (it would keep the whole mapping
        # resident, the unfused sources of q/k/v and gate/up with it: ~16% over the weights'
        # bytes); the fused tensors are fresh already, and a second copy of them cost ~1 s a GiB
        # of page faults in a VM
        mapped = {t.untyped_storage().data_ptr() for t in hf.values()}
        sd = {k: v.to(device=device, dtype=dtype, copy=v.untyped_storage().data_ptr() in mapped)
              for k, v in from_hf_state_dict(hf, arch).items()}
        del hf
        missing = set(model.state_dict()) - set(sd) - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"weights in {folder} lack {sorted(missing)[:5]}")
        model.load_state_dict(sd, strict=False, assign=True)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
    else:
        model = model.to(dtype).to_empty(device=device)      # allocate once, in the final dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(arch).to(device)      # float32 whatever the model's dtype
    return model.eval().requires_grad_(False)
