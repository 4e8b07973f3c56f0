"""An HF model written as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it, in F32:
its metadata keys (``gguf.GGUFWriter``'s own ``add_*``), its tensor names (the ``gguf`` package's
``TensorNameMap``, which is llama.cpp's table), Q/K rows permuted for the Llama converter family
(Llama, Mistral, Mixtral: weights and biases), ``1 + w`` for Gemma's norms, experts stacked
``[experts, out, in]``, and a byte-level BPE vocabulary that transformers' GGUF tokenizer
conversion accepts; the state layers' tensors as its Qwen3-Next, Qwen3.5, LFM2 and Granite
hybrid classes change them. Written from the converter's description, independent of our reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# HF model_type -> (llama.cpp architecture, the converter's permutation of q/k, norm shift)
ARCHS = {
    "llama": (gguf.MODEL_ARCH.LLAMA, True, 0.0),
    "mistral": (gguf.MODEL_ARCH.LLAMA, True, 0.0),
    "mixtral": (gguf.MODEL_ARCH.LLAMA, True, 0.0),
    "qwen2": (gguf.MODEL_ARCH.QWEN2, False, 0.0),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, False, 0.0),
    "qwen3_moe": (gguf.MODEL_ARCH.QWEN3MOE, False, 0.0),
    "gemma2": (gguf.MODEL_ARCH.GEMMA2, False, 1.0),
    "gemma3_text": (gguf.MODEL_ARCH.GEMMA3, False, 1.0),
    "phi3": (gguf.MODEL_ARCH.PHI3, False, 0.0),
    "qwen3_next": (gguf.MODEL_ARCH.QWEN3NEXT, False, 1.0),      # all norms but the DeltaNet's own
    "qwen3_5_text": (gguf.MODEL_ARCH.QWEN35, False, 1.0),
    "lfm2": (gguf.MODEL_ARCH.LFM2, False, 0.0),
    "granitemoehybrid": (gguf.MODEL_ARCH.GRANITE_HYBRID, True, 0.0),
    "gpt_oss": (gguf.MODEL_ARCH.GPT_OSS, False, 0.0),
}
DELTANET = ("qwen3_next", "qwen3_5_text")
SPECIALS = ["<pad>", "<s>", "</s>"]          # ids 0, 1, 2: pad, bos, eos in the tiny configs


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: rotate-half RoPE rows into interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(config, layer_type: str = "full_attention") -> float:
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(layer_type, params)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _lfm2_ff(c) -> int:
    """LFM2Model's feed_forward_length: the MLP width as HF derives it."""
    f = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        f = int(2 * f / 3)
        if c.block_ffn_dim_multiplier is not None:
            f = int(c.block_ffn_dim_multiplier * f)
        f = c.block_multiple_of * ((f + c.block_multiple_of - 1) // c.block_multiple_of)
    return f


def _metadata(w: gguf.GGUFWriter, model_type: str, c) -> None:
    """What each converter class's ``set_gguf_parameters`` writes."""
    n_layers, heads = c.num_hidden_layers, c.num_attention_heads
    w.add_name(model_type)
    w.add_block_count(n_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(_lfm2_ff(c) if model_type == "lfm2" else c.intermediate_size)
    w.add_head_count(heads)
    if model_type == "lfm2":                  # LFM2Model: a count a layer, 0 for a convolution layer
        w.add_head_count_kv([0 if t == "conv" else c.num_key_value_heads for t in c.layer_types])
        w.add_layer_norm_rms_eps(c.norm_eps)
        w.add_vocab_size(c.vocab_size)
        w.add_shortconv_l_cache(c.conv_L_cache)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if model_type == "granitemoehybrid":
        _granite_metadata(w, c)
        return
    head_dim = getattr(c, "head_dim", None)
    if model_type == "phi3":                  # Phi3Model: no key_length, the rotary width instead
        factor = (c.rope_parameters or {}).get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(factor * c.hidden_size) // heads)
        w.add_rope_freq_base(_rope_theta(c))
        w.add_sliding_window(c.sliding_window or 0)
        return
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if model_type == "gemma2":                # Gemma2Model: no RoPE base (llama.cpp's 10,000)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        return
    w.add_rope_freq_base(_rope_theta(c))
    if model_type == "gemma3_text":
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if model_type in ("llama", "mistral", "mixtral"):
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim or c.hidden_size // heads)
    if model_type == "mixtral":               # the base class's num_local_experts / num_experts_per_tok
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if model_type in ("qwen3_moe", "qwen3_next"):   # Qwen2MoeModel
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if model_type in DELTANET:
        _deltanet_metadata(w, model_type, c, head_dim or c.hidden_size // heads)
    (_gpt_oss_metadata if model_type == "gpt_oss" else lambda w, c: None)(w, c)


def _gpt_oss_metadata(w: gguf.GGUFWriter, c) -> None:
    """GptOssModel's keys: the experts, the window, YaRN."""
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _deltanet_metadata(w: gguf.GGUFWriter, model_type: str, c, head_dim: int) -> None:
    """Qwen3NextModel's keys, which Qwen3.5's converter extends with MRoPE sections."""
    if model_type == "qwen3_next":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(getattr(c, "full_attention_interval", 4))
    factor = (c.rope_parameters or {}).get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(head_dim * factor))
    if model_type == "qwen3_5_text":          # interleaved MRoPE sections, the default where unstated
        w.add_rope_dimension_sections((c.rope_parameters or {}).get("mrope_section", [11, 11, 10, 0]))


def _granite_metadata(w: gguf.GGUFWriter, c) -> None:
    """GraniteHybridModel's keys after the base class's: Llama's vocabulary size and rotary
    width (Granite's converter drops ``head_dim``: no key_length), the experts, the multipliers
    as ``scale`` keys and the shared MLP's width where set, the Mamba-2 shapes as ``ssm`` keys
    (heads as ``time_step_rank``), the key-value heads a layer (0 for a Mamba-2 layer), and RoPE
    off (``rope.scaling.finetuned`` false, a context of 2**20) for a model with Mamba-2 layers."""
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    for value, add in ((c.attention_multiplier, w.add_attention_scale), (c.embedding_multiplier, w.add_embedding_scale),
                       (c.residual_multiplier, w.add_residual_scale), (c.logits_scaling, w.add_logit_scale),
                       (c.shared_intermediate_size, w.add_expert_shared_feed_forward_length)):
        if value:
            add(value)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    # Granite 4's own config.json says "attention" and "mamba", which transformers saves as
    # "full_attention" and "linear_attention": either spelling of an attention layer
    attention = [t in ("attention", "full_attention") for t in c.layer_types]
    w.add_head_count_kv([c.num_key_value_heads if a else 0 for a in attention])
    use_rope = all(attention)
    w.add_rope_scaling_finetuned(use_rope)
    if not use_rope:
        w.add_context_length(2**20)


def _granite(name: str, t: np.ndarray, c) -> dict[str, np.ndarray]:
    """GraniteHybridModel's changes: each gate-then-up matrix (the experts' input_linear, the
    shared MLP's) split in halves, under the experts', the shared expert's or, without experts,
    the dense MLP's names; in a Mamba-2 layer dt_bias renamed dt_proj.bias, A_log stored as
    -exp(A_log) and D, both as columns [heads, 1], the convolution squeezed and the gated norm
    as [groups, channels / groups]."""
    layer = name.rsplit(".", 2)[0].rsplit(".", 1)[0]
    if name.endswith("input_linear.weight"):
        half = t.shape[-2] // 2
        mlp = ("mlp.experts" if "block_sparse_moe" in name else
               "mlp.shared_expert" if c.num_local_experts else "mlp")
        return {f"{layer}.{mlp}.gate_proj.weight": t[..., :half, :], f"{layer}.{mlp}.up_proj.weight": t[..., half:, :]}
    if name.endswith("shared_mlp.output_linear.weight") and not c.num_local_experts:
        return {f"{layer}.mlp.down_proj.weight": t}
    if name.endswith(".dt_bias"):
        return {name.removesuffix(".dt_bias") + ".dt_proj.bias": t}
    if name.endswith((".A_log", ".D")):
        return {name: (-np.exp(t) if name.endswith(".A_log") else t)[:, None]}
    if "mamba.conv1d" in name:
        return {name: t.squeeze()}
    if name.endswith("mamba.norm.weight"):
        return {name: t.reshape(c.mamba_n_groups, -1)}
    return {name: t}


def _gpt_oss(name: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """GptOssModel's changes: the experts' interleaved gate-and-up split into gate's and up's,
    each (and down) transposed to ``[experts, out, in]``, their biases split alike; the sinks
    stored as a weight."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("mlp.experts.gate_up_proj"):
        return {f"{base}.gate_proj.weight": np.swapaxes(t[..., 0::2], -1, -2),
                f"{base}.up_proj.weight": np.swapaxes(t[..., 1::2], -1, -2)}
    if name.endswith("mlp.experts.gate_up_proj_bias"):
        return {f"{base}.gate_proj.bias": t[..., 0::2], f"{base}.up_proj.bias": t[..., 1::2]}
    if name.endswith("mlp.experts.down_proj"):
        return {f"{base}.down_proj.weight": np.swapaxes(t, -1, -2)}
    if name.endswith("mlp.experts.down_proj_bias"):
        return {f"{base}.down_proj.bias": t}
    if name.endswith("self_attn.sinks"):
        return {name + ".weight": t}
    return {name: t}


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tokenizer(w: gguf.GGUFWriter, c) -> None:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens: three specials, the 256 byte
    symbols, then merges of pairs of printable ones."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    letters = [s for s in symbols if s.isalpha() and s.isascii()]
    merges = [f"{a} {b}" for a in letters for b in letters][: c.vocab_size - len(SPECIALS) - len(symbols)]
    tokens = SPECIALS + symbols + [m.replace(" ", "") for m in merges]
    assert len(tokens) == c.vocab_size, len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_add_bos_token(c.model_type.startswith("gemma"))      # as llama.cpp's Gemma converter does
    w.add_eos_token_id(c.eos_token_id if isinstance(c.eos_token_id, int) else c.eos_token_id[0])
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)


def _tiled(t: np.ndarray, axis: int, nk: int, head: int) -> np.ndarray:
    """Qwen3.5's converter: V heads from HF's order, grouped by key head, to tiled order
    (``[v0 of each key head, v1 of each, ...]``) along ``axis``."""
    t = np.moveaxis(t, axis, 0)
    n = t.shape[0]
    t = t.reshape(nk, n // (nk * head), head, *t.shape[1:]).swapaxes(0, 1).reshape(n, *t.shape[1:])
    return np.moveaxis(t, 0, axis)


def _deltanet(name: str, t: np.ndarray, c) -> dict[str, np.ndarray]:
    """Qwen3NextModel's changes to a DeltaNet layer's tensors (A_log stored as -exp(A_log),
    dt_bias renamed dt_proj.bias, the convolution squeezed, in_proj_qkvz split into all q, k, v
    rows and all z rows), then, for Qwen3.5 with more value heads than key heads, the value
    heads tiled."""
    nk, nv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    if name.endswith(".A_log"):
        t = -np.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    if name.endswith("in_proj_qkvz.weight"):
        per_head = t.reshape(nk, -1, t.shape[-1])
        q, k, v, z = np.split(per_head, np.cumsum([dk, dk, nv // nk * dv])[:3], axis=1)
        base = name.removesuffix("in_proj_qkvz.weight")
        return {base + "in_proj_qkv.weight": np.concatenate([x.reshape(-1, t.shape[-1]) for x in (q, k, v)]),
                base + "in_proj_z.weight": z.reshape(-1, t.shape[-1])}
    if c.model_type == "qwen3_5_text" and nk != nv:
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = np.concatenate([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, dv)])
        elif name.endswith("in_proj_z.weight"):
            t = _tiled(t, 0, nk, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", "dt_proj.bias")):
            t = _tiled(t, 0, nk, 1)
        elif name.endswith("out_proj.weight"):
            t = _tiled(t, 1, nk, dv)
    return {name: t}


def _tensors(folder: Path, c) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as the converter reads them (the safetensors files), HF names
    (experts stacked under the name without the expert index) -> F32 arrays, with its changes:
    q/k permuted, norms shifted, lm_head dropped for Gemma 2, the state layers' tensors
    changed as above, LFM2's convolution squeezed, Granite's as ``_granite`` says."""
    from safetensors.numpy import load_file

    model_type = c.model_type
    arch, permuted, shift = ARCHS[model_type]
    sd: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    if model_type == "gemma2":
        sd.pop("lm_head.weight", None)         # Gemma2Model skips it: its files are tied
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in sd.items():
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, c.num_attention_heads, c.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, c.num_attention_heads, c.num_key_value_heads)
        if shift and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + shift
        if model_type == "lfm2" and "conv.conv" in name:
            t = t.squeeze(1)
        if model_type in DELTANET and ".linear_attn." in name:
            out.update(_deltanet(name, t, c))
            continue
        if model_type in ("granitemoehybrid", "gpt_oss"):
            out.update(_granite(name, t, c) if model_type == "granitemoehybrid" else _gpt_oss(name, t))
            continue
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(stacked, {})[int(parts[i + 1])] = t
            continue
        out[name] = t
    for stacked, each in experts.items():
        out[stacked] = np.stack([each[e] for e in sorted(each)])
    return out


def encoded(t: np.ndarray, name: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A float tensor in the GGUF type ``name``: the ``gguf`` package's quantisers, ours
    (``helpers.kquants``) for the K-quants it only reads."""
    from helpers import kquants

    qtype = gguf.GGMLQuantizationType[name]
    t = np.ascontiguousarray(t, dtype=np.float32)
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        return kquants.quantize(t.reshape(-1, t.shape[-1]), name).reshape(*t.shape[:-1], -1), qtype
    return gguf.quants.quantize(t, qtype), qtype


def write_gguf(folder: Path, path: Path, types: dict[str, str] | None = None) -> Path:
    """The HF checkpoint in ``folder`` (config.json, safetensors) as llama.cpp's converter
    writes it at ``path``: F32, or the GGUF type ``types`` names for a tensor (by its GGUF name,
    e.g. ``{"blk.0.attn_v.weight": "Q6_K"}``)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    model_type = c.model_type
    arch = ARCHS[model_type][0]
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, model_type, c)
    _tokenizer(w, c)
    for name, t in _tensors(Path(folder), c).items():
        # a parameter stored bare (A_log) keeps no suffix
        base, suffix = name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, "")
        new = names.get_name(base)
        if new is None:
            raise ValueError(f"llama.cpp's table maps no {name!r} for {arch.name}")
        if new not in [gguf.TENSOR_NAMES[k].format(bid=base.split(".")[2] if ".layers." in base else 0)
                       for k in gguf.MODEL_TENSORS[arch]]:
            raise ValueError(f"{new!r} is not a tensor of llama.cpp's {arch.name}")
        new = f"{new}.{suffix}" if suffix else new
        kind = (types or {}).get(new, "F32")
        if kind in ("F32", "F16"):
            w.add_tensor(new, np.ascontiguousarray(t, dtype=np.float32 if kind == "F32" else np.float16))
        else:
            data, qtype = encoded(t, kind)
            w.add_tensor(new, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
