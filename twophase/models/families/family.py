"""What a family file declares: how its HF config reads as a ``ModelArch``, which HF
``model_type``s and GGUF architectures it loads, and its one table of weight names.

The table maps each of our parameters (``attn.qkv``, ``mlp.gate_up``, ...) to its HF and GGUF
names, several of them where we fuse a matrix the checkpoint stores in parts (a GGUF name
``a+b``: one HF tensor that llama.cpp's converter stores as two, ``a`` and ``b``); the HF loader,
the GGUF converter and the q4 loader all read it, so a name is spelled once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twophase.arch import AttentionSpec, LayerSpec, MLPSpec, ModelArch, uniform_layers
from twophase.models.layers.rotary import check_scaling

if TYPE_CHECKING:
    import torch

    from twophase.models.lazy_tensors import LazyTensors

# ours -> (HF names, GGUF names), per layer under "model.layers.{i}." / "blk.{i}."
LayerNames = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
GGUFTensors = Callable[[str, str, Any, Callable[[str], Any], Callable[..., Any]], dict[str, Any]]

TOP_NAMES = {"embed": ("model.embed_tokens", "token_embd"), "norm": ("model.norm", "output_norm"),
             "lm_head": ("lm_head", "output")}

# where transformers' ``*ForConditionalGeneration`` models hold their text model's weights
# (``model.language_model.layers.{i}.``, ``model.language_model.embed_tokens``; ``lm_head`` as it is)
LANGUAGE_MODEL = "model.language_model."

# our parameters stored without a ``.weight``/``.bias`` suffix, in both namings (state layers'
# own, attention sinks)
BARE = {"A_log", "dt_bias", "D", "sinks", "score_bias"}
# a tensor kept in another layout in a family's checkpoints than ours: (to ours, to theirs)
Layout = tuple[Callable[[Any], Any], Callable[[Any], Any]]

LLAMA_LAYER: LayerNames = {
    "attn_norm": (("input_layernorm",), ("attn_norm",)),
    "mlp_norm": (("post_attention_layernorm",), ("ffn_norm",)),
    "attn.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("attn_q", "attn_k", "attn_v")),
    "attn.o": (("self_attn.o_proj",), ("attn_output",)),
    "attn.q_norm": (("self_attn.q_norm",), ("attn_q_norm",)),
    "attn.k_norm": (("self_attn.k_norm",), ("attn_k_norm",)),
    "mlp.gate_up": (("mlp.gate_proj", "mlp.up_proj"), ("ffn_gate", "ffn_up")),
    "mlp.down": (("mlp.down_proj",), ("ffn_down",)),
}


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    arch_from_hf: Callable[[dict[str, Any]], ModelArch]
    layer_names: LayerNames
    # llama.cpp reorders Q/K rows (interleaved RoPE pairs) for this family's GGUF files
    gguf_rope_permuted: bool = False
    hf_architecture: str = ""            # written into a converted GGUF's config.json
    # what the family's GGUF keeps under its own keys, as config.json entries:
    # (get, prefix, tensor names) -> dict
    gguf_config: Callable[[Callable[..., Any], str, frozenset[str]], dict[str, Any]] | None = None
    gguf_norm_offset: float = 0.0        # llama.cpp stores (1 + w) norms as 1 + w: subtracted
    # a GGUF architecture shared with a dense family (Mixtral's files say ``llama``): this family
    # is the one for a file of that architecture that states ``{arch}.expert_count``
    gguf_experts: bool = False
    # the embedding, final norm and head under this family's HF names, where they differ from
    # Llama's (LFM2's final norm is ``model.embedding_norm``)
    hf_top_names: dict[str, str] = field(default_factory=lambda: {o: hf for o, (hf, _) in TOP_NAMES.items()},
                                         hash=False)
    # the same in its GGUF files (LFM2's final norm is ``token_embd_norm``)
    gguf_top_names: dict[str, str] = field(default_factory=lambda: {o: g for o, (_, g) in TOP_NAMES.items()},
                                           hash=False)
    # what llama.cpp's converter does to this family's tensors beyond renaming them, undone:
    # (GGUF name, HF name, the tensor as stored, read(GGUF name), get(header key)) -> HF tensors
    # (none for a tensor read along with another one)
    gguf_tensors: GGUFTensors | None = None
    # the HF ``model_type`` of the family's multimodal form (Qwen3.5's published checkpoints):
    # its config.json holds the text model's keys under ``text_config``, its weights hold the text
    # model's under ``LANGUAGE_MODEL``; it loads as its text model, the images part left out
    hf_multimodal_type: str | None = None
    # the table's HF names (``mlp.experts.gate_up_proj.bias``, under ``model.layers.{i}.``) that
    # this family's checkpoints store under another one (gpt-oss's ``..._bias``): table -> stored
    hf_stored_names: dict[str, str] = field(default_factory=dict, hash=False)
    # our tensors (``mlp.experts_gate_up.weight``) that its checkpoints hold in another layout
    # (gpt-oss's experts transposed, gate and up interleaved): how each converts both ways
    hf_layouts: dict[str, Layout] = field(default_factory=dict, hash=False)
    # a checkpoint's tensors stored packed (gpt-oss's MXFP4 experts: ``*_blocks`` and
    # ``*_scales``), given back unpacked under the names its float form stores them under
    hf_unpack: Callable[[Mapping[str, torch.Tensor]], LazyTensors] | None = None


def stated(get: Callable[..., Any], key: str) -> Any:
    """A GGUF header's value that a family's ``gguf_config`` cannot do without (a KeyError
    naming the key, which the converter reports as the header lacking it)."""
    value = get(key)
    if value is None:
        raise KeyError(key)
    return value


def common_fields(c: dict[str, Any], tie_default: bool = False) -> dict[str, Any]:
    """The ``ModelArch`` fields every family reads the same way from an HF ``config.json``
    (``tie_default``: the family's own default where the file leaves the key out)."""
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    params = c.get("rope_parameters") or {}
    return {
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "max_position_embeddings": c.get("max_position_embeddings", 8192),
        "rms_norm_eps": float(c.get("rms_norm_eps", 1e-5)),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", tie_default)),
        "rope_scaling": check_scaling(c.get("rope_scaling") or params, c.get("max_position_embeddings")),
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_ids": eos_ids,
    }


def rope_theta(c: dict[str, Any], default: float = 10000.0) -> float:
    return float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", default)))


def window_of(c: dict[str, Any]) -> int | None:
    """``sliding_window``, None where it is unset or covers the whole context anyway."""
    w = c.get("sliding_window")
    return w if w and w < c.get("max_position_embeddings", 1 << 62) else None


def layers_from_hf(c: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """Dense layers; sliding ones where ``layer_types`` says so, or every layer when only
    ``sliding_window`` is set (Mistral's and Phi-3's configs)."""
    n, f, theta, window = c["num_hidden_layers"], c["intermediate_size"], rope_theta(c), window_of(c)
    types = c.get("layer_types") or ["sliding_attention"] * n
    if not window:
        return uniform_layers(n, f, theta)
    return tuple(LayerSpec(AttentionSpec(window if t == "sliding_attention" else None, theta), MLPSpec(f))
                 for t in types[:n])


def qwen_layer_types(c: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3: a window only with ``use_sliding_window``, and then on the layers from
    ``max_window_layers`` on (where the file does not list ``layer_types`` itself)."""
    if not c.get("use_sliding_window"):
        return {**c, "sliding_window": None}
    if c.get("layer_types"):
        return c
    first = c.get("max_window_layers", 0)
    return {**c, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                 for i in range(c["num_hidden_layers"])]}
