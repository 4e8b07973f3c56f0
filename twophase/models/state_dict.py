"""Building a family's ``Decoder`` on a device from HF-named safetensors or random numbers.

The model is built on the meta device and its parameters assigned or initialised in place, so
nothing is allocated twice and a 16 GB random model never touches host memory on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path

import torch

from twophase.arch import DeltaNetSpec, LayerSpec, ModelArch
from twophase.contract import ModelSpec
from twophase.errors import ModelError
from twophase.models.decoder import Decoder, rope_inv_freq
from twophase.models.families import family
from twophase.models.families.family import BARE, LANGUAGE_MODEL
from twophase.models.lazy_tensors import LazyTensors, lazily
from twophase.models.meta import no_init

log = logging.getLogger(__name__)


def part_rows(ours: str, arch: ModelArch, parts: int, spec: LayerSpec) -> list[int] | None:
    """How a fused matrix's rows split into the checkpoint's parts (None: one part)."""
    if parts == 1:
        return None
    if ours == "attn.qkv":
        kv = arch.num_kv_heads * arch.head_dim
        return [arch.num_heads * arch.head_dim * (2 if arch.attn_output_gate else 1), kv, kv]
    if ours == "mixer.in_proj" and isinstance(spec.mixer, DeltaNetSpec):
        m = spec.mixer
        qk, vd, hv = m.num_k_heads * m.k_head_dim, m.num_v_heads * m.v_head_dim, m.num_v_heads
        return [2 * qk + 2 * vd, 2 * hv] if parts == 2 else [2 * qk + vd, vd, hv, hv]
    if ours.startswith("mlp.shared."):
        return [spec.mlp.shared_intermediate_size] * parts
    return [spec.mlp.intermediate_size] * parts


def kinds(ours: str) -> tuple[str, ...]:
    """The suffixes a parameter of ours has in both namings: ``weight`` and ``bias``, or none
    for one stored bare (a Gated DeltaNet's ``A_log`` and ``dt_bias``, a Mamba-2 layer's ``D`` too)."""
    return ("",) if ours.rsplit(".", 1)[-1] in BARE else ("weight", "bias")


def dotted(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF names → ours, by the family's table; parts of a fused matrix concatenated."""
    out: dict[str, torch.Tensor] = {}
    fam = family(arch.family)
    for ours, name in fam.hf_top_names.items():
        if f"{name}.weight" in hf and not (ours == "lm_head" and arch.tie_word_embeddings):
            out[f"{ours}.weight"] = hf[f"{name}.weight"]
    for i, spec in enumerate(arch.layers):
        for ours, (parts, _) in fam.layer_names.items():
            for kind in kinds(ours):
                if "{e}" not in parts[0]:
                    t = _fused(hf, [dotted(f"model.layers.{i}.{p}", kind) for p in parts])
                else:                         # one tensor an expert: stacked, [E, out, in]
                    each = [_fused(hf, [dotted(f"model.layers.{i}.{p.format(e=e)}", kind) for p in parts])
                            for e in range(spec.mlp.num_experts)]
                    t = torch.stack(each) if each and all(x is not None for x in each) else None
                if t is not None:
                    layout = fam.hf_layouts.get(dotted(ours, kind))
                    out[dotted(f"layers.{i}.{ours}", kind)] = layout[0](t) if layout else t
    return out


def text_model_names(names: Iterable[str], arch: ModelArch, folder: Path) -> dict[str, str]:
    """A checkpoint's tensor names → the HF names ``from_hf_state_dict`` reads. A family's
    multimodal checkpoint holds its text model under ``LANGUAGE_MODEL`` (and ``lm_head``): those
    are renamed as the text model's own (``model.language_model.norm`` → ``model.norm``), the rest
    (the images part) left out, which the log says. A base model's checkpoint (``Qwen3Model``, as
    embedding models ship: ``layers.0...``, no ``model.``) gets the prefix; any other checkpoint's
    names are kept as they are."""
    names = list(names)
    # then a name the family's checkpoints store otherwise than its table (``Family.hf_stored_names``)
    return {n: _table_name(hf, arch) for n, hf in _checkpoint_names(names, arch, folder).items()}


def _checkpoint_names(names: list[str], arch: ModelArch, folder: Path) -> dict[str, str]:
    if any(n.startswith("layers.") for n in names) and not any(n.startswith("model.") for n in names):
        return {n: n if n.startswith("lm_head.") else "model." + n for n in names}
    if not family(arch.family).hf_multimodal_type or not any(n.startswith(LANGUAGE_MODEL) for n in names):
        return {n: n for n in names}
    kept = {n: "model." + n.removeprefix(LANGUAGE_MODEL) for n in names if n.startswith(LANGUAGE_MODEL)}
    kept.update({n: n for n in names if n.startswith("lm_head.")})
    left = sorted({".".join(n.split(".")[:2]) for n in names if n not in kept})
    log.info("%s holds a multimodal %s model: its text model is loaded, its images part is not "
             "(%d tensors under %s)", folder, arch.family, len(names) - len(kept), ", ".join(left) or "-")
    return kept


def _table_name(name: str, arch: ModelArch) -> str:
    """A layer's tensor as the family's table names it where its checkpoints store it under
    another name (gpt-oss: ``model.layers.3.mlp.experts.down_proj_bias`` is ``...down_proj.bias``)."""
    stored = {theirs: table for table, theirs in family(arch.family).hf_stored_names.items()}
    if not stored:
        return name
    model, layers, i, rest = (name.split(".", 3) + ["", "", ""])[:4]
    return f"{model}.{layers}.{i}.{stored[rest]}" if layers == "layers" and rest in stored else name


def _fused(hf: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The parts concatenated along rows (None unless all are there)."""
    if not all(n in hf for n in names):
        return None
    return hf[names[0]] if len(names) == 1 else torch.cat([hf[n] for n in names])


def to_hf_state_dict(sd: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Ours → HF names: the inverse of ``from_hf_state_dict`` (fused matrices split; names and
    layouts as the family's checkpoints store them)."""
    fam = family(arch.family)
    out = {f"{name}.weight": sd[f"{ours}.weight"] for ours, name in fam.hf_top_names.items()
           if not (ours == "lm_head" and arch.tie_word_embeddings)}
    for i, spec in enumerate(arch.layers):
        for ours, (parts, _) in fam.layer_names.items():
            for kind in kinds(ours):
                t = sd.get(dotted(f"layers.{i}.{ours}", kind))
                if t is None:
                    continue
                layout = fam.hf_layouts.get(dotted(ours, kind))
                if layout:
                    t = layout[1](t)
                rows = part_rows(ours, arch, len(parts), spec)
                stacked = "{e}" in parts[0]
                for e, te in enumerate(t if stacked else [t]):
                    for name, piece in zip(parts, torch.split(te, rows) if rows else [te]):
                        table = dotted(name.format(e=e) if stacked else name, kind)
                        out[f"model.layers.{i}.{fam.hf_stored_names.get(table, table)}"] = piece
    return out


def hf_names(arch: ModelArch, ours: Callable[[str], bool]) -> set[str]:
    """The HF names of the tensors whose own names (``layers.0.attn_norm.weight``) pass
    ``ours``, by the family's table: all the parts of a fused one, each expert's."""
    out = {f"{name}.weight" for o, name in family(arch.family).hf_top_names.items() if ours(f"{o}.weight")}
    for i, spec in enumerate(arch.layers):
        experts = range(max(1, spec.mlp.num_experts))
        for o, (parts, _) in family(arch.family).layer_names.items():
            for kind in kinds(o):
                if ours(dotted(f"layers.{i}.{o}", kind)):
                    out.update(dotted(f"model.layers.{i}.{p.format(e=e)}", kind) for p in parts for e in experts)
    return out


def float_weights(spec: ModelSpec, ours: Callable[[str], bool],
                  model: Decoder | None = None) -> dict[str, torch.Tensor]:
    """The CPU tensors whose own names pass ``ours``, in float32, read by the family's table from
    where ``spec.source`` says, without building the model: only those tensors of a GGUF,
    dequantised as its float cache holds them (``gguf.hf_tensors``), or of an HF folder. Random
    weights are the model's own draws, so they come from ``model`` (built here if not given)."""
    source, arch = spec.source, spec.arch
    if source.kind == "random":
        if model is None:
            model = build_model(arch, spec.dtype, torch.device("cpu"), None, source.seed)
        return {k: v.float() for k, v in model.state_dict().items() if ours(k)}
    with torch.device("meta"), no_init():
        held = set(Decoder(arch).state_dict())    # the model's own names (nothing allocated)
    names = hf_names(arch, lambda k: k in held and ours(k))
    hf: dict[str, torch.Tensor] = {}
    if source.kind == "gguf":
        from twophase.models.gguf import hf_name, hf_tensors, in_trunk
        from twophase.models.gguf_file import GGUFFile

        assert source.path is not None
        header = GGUFFile(source.path)
        fam = family(arch.family)
        for name in header.tensors:
            if in_trunk(name, arch.num_layers) and hf_name(name, fam).format(e=0) in names:
                hf.update({k: torch.from_numpy(v) for k, v in
                           hf_tensors(header, name, fam, arch.num_heads, arch.num_kv_heads).items()})
    else:
        from safetensors import safe_open

        assert source.path is not None
        where: dict[str, Path] = {}
        for f in sorted(source.path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                where.update({k: f for k in st.keys()})
        # each tensor read (and unpacked) only if asked for
        stored: Mapping[str, torch.Tensor] = LazyTensors({k: partial(_read_tensor, f, k) for k, f in where.items()})
        unpack = family(arch.family).hf_unpack
        if unpack is not None:
            stored = unpack(stored)
        renamed = text_model_names(stored, arch, source.path)
        hf = {renamed[k]: stored[k] for k in stored if renamed.get(k) in names}
    # rounded to the model's dtype, as the model built from them holds them
    return {k: v.to(spec.dtype).float() for k, v in from_hf_state_dict(hf, arch).items()
            if k in held and ours(k)}


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as st:
        return st.get_tensor(name)


def hf_weights(arch: ModelArch, folder: Path | None, seed: int) -> dict[str, torch.Tensor]:
    """The model's float32 CPU weights under HF names, exactly as the torch backend holds them
    (random ones drawn from ``seed`` by ``build_model``): what ``ModelSpec.state_dict`` gives
    a backend."""
    model = build_model(arch, torch.float32, torch.device("cpu"), folder, seed)
    return {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), arch).items()}




def build_model(arch: ModelArch, dtype: torch.dtype, device: torch.device,
                folder: Path | None = None, seed: int = 0) -> Decoder:
    with torch.device("meta"), no_init():
        model = Decoder(arch)
    if folder is not None:
        from safetensors.torch import load_file

        raw: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            raw.update(load_file(str(f)))
        # copies of what is still a view of the file's mapping (it would keep the whole mapping
        # resident, the unfused sources of q/k/v and gate/up with it: ~16% over the weights'
        # bytes); the fused tensors are fresh already, and a second copy of them costs page
        # faults (docs/measurements.md)
        mapped = {t.untyped_storage().data_ptr() for t in raw.values()}
        unpack = family(arch.family).hf_unpack
        stored = lazily(raw) if unpack is None else unpack(raw)       # packed tensors unpacked as read
        hf = stored.renamed(text_model_names(stored, arch, folder))
        sd = {k: v.to(device=device, dtype=dtype, copy=v.untyped_storage().data_ptr() in mapped)
              for k, v in from_hf_state_dict(hf, arch).items()}
        del hf, stored, raw
        missing = set(model.state_dict()) - set(sd) - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
        if missing:
            raise ModelError(f"weights in {folder} lack {', '.join(sorted(missing)[:5])}"
                             f"{' and more' if len(missing) > 5 else ''}: not a complete {arch.family} checkpoint")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        wrong = [f"{k} is {tuple(v.shape)}, the config makes it {shapes[k]}" for k, v in sd.items()
                 if k in shapes and tuple(v.shape) != shapes[k]]
        if wrong:
            raise ModelError(f"weights in {folder} disagree with its config.json: {'; '.join(wrong[:3])}"
                             f"{' and more' if len(wrong) > 3 else ''}")
        model.load_state_dict(sd, strict=False, assign=True)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
    else:
        model = model.to(dtype).to_empty(device=device)      # allocate once, in the final dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            offsets = {f"{n}.weight": getattr(m, "offset", arch.norm_offset) for n, m in model.named_modules()}
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0 - offsets[name])     # an effective scale of 1
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(arch).to(device)      # float32 whatever the model's dtype
    return model.eval().requires_grad_(False)
