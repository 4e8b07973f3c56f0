"""GGUF → HF folder: dequantise every tensor once with the ``gguf`` package and write
``model.safetensors`` (fp32, HF names), ``config.json`` and the tokenizer files: the float cache
of a model loaded from a GGUF (``WeightSource.float_cache``), so the loaders that need floats
read plain safetensors in seconds instead of re-parsing and dequantising the GGUF. The loaders
that keep the file's blocks read the GGUF itself."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from twophase.errors import ModelError
from twophase.models.families import by_gguf_architecture
from twophase.models.families.family import BARE, Family
from twophase.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

def hf_name(gguf_name: str, fam: Family) -> str:
    """A GGUF tensor's HF name, by the family's weight-name table; a stacked expert tensor
    (``blk.N.ffn_gate_exps``) names its experts' HF tensors with ``{e}`` for the expert. A
    parameter stored bare (``A_log``, ``dt_bias``) has no ``.weight``/``.bias`` in HF's name."""
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?", gguf_name)
    if m:
        for hf_parts, gguf_parts in fam.layer_names.values():
            for hf, parts in zip(hf_parts, gguf_parts):
                if m[2] in parts.split("+"):
                    kind = "" if hf.rsplit(".", 1)[-1] in BARE else m[3]
                    return ".".join(p for p in (f"model.layers.{m[1]}.{hf}", kind) if p)
        if m[2].endswith("_exps"):
            raise ModelError(f"GGUF tensor {gguf_name!r}: stacked experts in a {fam.name} file, a family "
                             f"without them (the MoE files that load: qwen3moe, and llama stating "
                             f"llama.expert_count, Mixtral's)")
        raise ModelError(f"GGUF tensor {gguf_name!r} has no place in a {fam.name} model")
    base, kind = gguf_name.rsplit(".", 1)
    for ours, gguf_base in fam.gguf_top_names.items():
        if base == gguf_base:
            return f"{fam.hf_top_names[ours]}.{kind}"
    raise ModelError(f"GGUF tensor {gguf_name!r} has no place in a {fam.name} model")


def in_trunk(gguf_name: str, num_layers: int) -> bool:
    """Whether a GGUF tensor belongs to the model's own blocks (not to a next-token-prediction
    block after them, ``blk.{num_layers}`` and on)."""
    m = re.match(r"blk\.(\d+)\.", gguf_name)
    return m is None or int(m[1]) < num_layers


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved RoPE pairs → HF's rotate-half)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# tensors llama.cpp writes for RoPE scalings we do not implement: refused by name, not ignored
_ROPE_FACTORS = {"rope_freqs.weight": "Llama 3.1's RoPE scaling as per-frequency factors",
                 "rope_factors_long.weight": "Phi-3's long-context RoPE (longrope)"}


def gguf_family(header: GGUFFile) -> Family:
    """The family of a GGUF (by ``general.architecture``, and ``expert_count`` where a dense and
    a mixture-of-experts family share one)."""
    arch = header.get("general.architecture")
    return by_gguf_architecture(arch, str(header.path), experts=bool(header.get(f"{arch}.expert_count")))


def hf_config(header: GGUFFile) -> dict:
    """The HF ``config.json`` a GGUF's header describes."""
    f = header.get
    arch = f("general.architecture")
    fam = gguf_family(header)
    p = f"{arch}."

    def need(key: str) -> int:
        value = f(p + key)
        if value is None:
            raise ModelError(f"{header.path}: the GGUF header lacks {p + key}")
        return int(value)

    heads, hidden = need("attention.head_count"), need("embedding_length")
    names = frozenset(header.tensors)
    for name, what in _ROPE_FACTORS.items():
        if name in names:
            raise ModelError(f"{header.path}: the file holds {name}, {what}: not implemented")
    extra = int(f(p + "nextn_predict_layers") or 0)
    if extra:
        log.info("%s: its %d next-token-prediction block(s) after the model's (%snextn_predict_layers) are "
                 "not loaded: they draft tokens, which this engine does with n-gram or a draft model",
                 header.path, extra, p)
    tokens = f("tokenizer.ggml.tokens") or []      # a LongArray: its length
    try:
        own = fam.gguf_config(f, p, names) if fam.gguf_config else {}
    except KeyError as exc:
        raise ModelError(f"{header.path}: the GGUF header lacks {exc.args[0]}") from None
    return {
        "architectures": [fam.hf_architecture],
        "model_type": fam.hf_model_types[0],
        "vocab_size": int(f(p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count") - extra,
        "num_attention_heads": heads,
        # a list a layer where state layers have none (LFM2's 0s): the attention layers' count
        "num_key_value_heads": int(max(kv) if isinstance(kv := f(p + "attention.head_count_kv", heads), list)
                                   else kv),
        "head_dim": int(f(p + "attention.key_length", f(p + "rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(f(p + "context_length", 4096)),
        "rope_theta": float(f(p + "rope.freq_base", 10000.0)),
        "rms_norm_eps": float(f(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names,
        "bos_token_id": f("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        **own,
    }


def dequantised(header: GGUFFile, name: str) -> np.ndarray:
    """The GGUF tensor ``name`` in float32, shaped as numpy orders it; a tensor the file lacks
    is a ModelError naming it."""
    import gguf

    t = header.tensors.get(name)
    if t is None:
        raise ModelError(f"{header.path}: the GGUF file lacks the tensor {name}")
    return gguf.quants.dequantize(header.data(t.name), t.ggml_type).astype(np.float32).reshape(t.shape)


def hf_tensors(header: GGUFFile, name: str, fam: Family, heads: int,
               kv_heads: int) -> dict[str, np.ndarray]:
    """The GGUF tensor ``name`` in float32 under its HF name, undone where llama.cpp changed it
    (Q/K rows permuted, ``1 + w`` norms, the family's own changes); stacked experts as one HF
    tensor an expert. What the converted folder holds, and what a loader reading a few tensors
    from the file takes, alike."""
    w = dequantised(header, name)
    hf = hf_name(name, fam)
    plain_norms = fam.layer_names.get("mixer.norm", ((), ()))[0]     # a state layer's own: no offset
    # llama.cpp permutes q and k, weights and biases, for the Llama family's interleaved RoPE
    if fam.gguf_rope_permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
        w = unpermute_rope(w, heads)
    elif fam.gguf_rope_permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
        w = unpermute_rope(w, kv_heads)
    elif fam.gguf_norm_offset and hf.endswith("norm.weight") and not hf.endswith(
            tuple(f".{p}.weight" for p in plain_norms)):
        w = w - fam.gguf_norm_offset
    found = (fam.gguf_tensors(name, hf, w, lambda n: dequantised(header, n), header.get)
             if fam.gguf_tensors else {hf: w})
    out = {}
    for k, v in found.items():
        if "{e}" in k:                        # [experts, out, in]: one HF tensor an expert
            out.update({k.format(e=e): np.ascontiguousarray(ve) for e, ve in enumerate(v)})
        else:
            out[k] = np.ascontiguousarray(v)
    return out


def check_complete(header: GGUFFile, fam: Family, config: dict) -> None:
    """Every tensor the model needs is in the file: one it lacks (a state layer's ``ssm_a``, say)
    is a ModelError naming it as the file would, before anything is written."""
    from twophase.models.families import arch_from_config
    from twophase.models.param_counts import shapes

    arch = arch_from_config(config, str(header.path))
    needed = set(shapes(arch))           # the model's parameters, built on the meta device
    held = set(header.tensors)
    lacking = []
    for key in sorted(needed):
        m = re.fullmatch(r"layers\.(\d+)\.(.+?)(?:\.(weight|bias))?", key)
        if m and m[2] in fam.layer_names:
            kinds = (f".{m[3]}",) if m[3] else ("", ".weight", ".bias")
            bases = [f"blk.{m[1]}.{g}" for part in fam.layer_names[m[2]][1] for g in part.split("+")]
        elif key.rsplit(".", 1)[0] in fam.gguf_top_names and not (key == "lm_head.weight" and arch.tie_word_embeddings):
            kinds, bases = (".weight",), [fam.gguf_top_names[key.rsplit(".", 1)[0]]]
        else:
            continue
        lacking += [b + kinds[0] for b in bases if not any(b + k in held for k in kinds)]
    if lacking:
        raise ModelError(f"{header.path}: the GGUF file lacks the tensor{'s' if len(lacking) > 1 else ''} "
                         f"{', '.join(lacking[:5])}{' and more' if len(lacking) > 5 else ''}, which its "
                         f"{fam.name} model needs")


CONVERSION = 2          # of the folder convert writes (2: the file's add_bos_token kept)


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF folder for ``gguf_path`` into ``out_dir`` (atomically: a temp folder renamed)."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    header = GGUFFile(gguf_path)
    config = hf_config(header)
    fam = gguf_family(header)
    check_complete(header, fam, config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    for t in tqdm(header.tensors.values(), desc=f"dequantising {gguf_path.name}", unit="tensor"):
        if in_trunk(t.name, config["num_hidden_layers"]):
            tensors.update(hf_tensors(header, t.name, fam, *heads))
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers' own GGUF tokenizer conversion, run once, saved as ``tokenizer.json``: the
    same tokenizer that transformers builds when it loads the GGUF itself."""
    log.info("converting the GGUF tokenizer (once)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ValueError) and "is not supported" not in str(exc):
            raise
        # an architecture transformers does not read (qwen3next), or whose header its GGUF
        # config reader trips on (gpt-oss: a TypeError): its tokenizer from the file's
        # tokenizer keys alone, as transformers converts them for every architecture
        log.info("transformers does not read %s's architecture (%s): its tokenizer from the file's "
                 "tokenizer keys alone", gguf_path.name, type(exc).__name__)
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    # whether a prompt starts with BOS is the file's to say (Gemma's must: without it the model
    # writes nonsense); the saved config does not carry it
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg["add_bos_token"] = bool(GGUFFile(gguf_path).metadata.get("tokenizer.ggml.add_bos_token", False))
    path.write_text(json.dumps(cfg, indent=2))
