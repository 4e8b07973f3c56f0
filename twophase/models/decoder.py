"""The decoder-only transformer every family builds: embedding, blocks, final norm, head,
composed from the layers kit by a ``ModelArch`` (one block per ``LayerSpec``), with attention
that reads and writes core's paged KV pool.

Tokens arrive packed (``[T]``); the q/k/v, o and MLP projections run once over all of them,
whatever mix of prefill chunks and decodes the step holds: one read of the weights a step.
A family whose block differs from this one (another residual order, parallel attention and
MLP) defines its block in its own file and builds it here by ``arch.family``.
"""

from __future__ import annotations

import torch
from torch import nn

from twophase.arch import LayerSpec, ModelArch
from twophase.contract import KVGroups
from twophase.errors import ModelError
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.attention import Attention, AttnMeta
from twophase.models.layers.deltanet import GatedDeltaNet
from twophase.models.layers.mamba2 import Mamba2
from twophase.models.layers.mla import LatentAttention
from twophase.models.layers.mlp import GatedMLP, Glu
from twophase.models.layers.moe import MoE
from twophase.models.layers.norm import RMSNorm
from twophase.models.layers.rotary import attention_factor, cos_sin, inv_freq
from twophase.models.layers.short_conv import ShortConv
from twophase.models.layers.state import StateMeta

__all__ = ["AttnMeta", "Block", "Decoder", "StateMeta", "rope_inv_freq"]

# each kind of state layer (``StateLayerSpec.kind``) and its module
STATE_LAYERS: dict[str, type[nn.Module]] = {"gated_deltanet": GatedDeltaNet, "short_conv": ShortConv,
                                            "mamba2": Mamba2}


def rope_thetas(arch: ModelArch) -> list[float]:
    """The distinct RoPE bases, in order of first use (one for most families)."""
    return list(dict.fromkeys(s.attention.rope_theta for s in arch.layers))


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """``[bases, rotary_dim / 2]``: each RoPE base's frequencies (float32, on the CPU)."""
    rot = arch.rotary_dim or arch.head_dim
    if attention_factor(arch.rope_scaling) != 1.0 and rot != arch.head_dim:
        raise ModelError(f"YaRN's attention factor with partial rotary ({rot} of {arch.head_dim} dimensions) "
                         f"is not implemented (it is folded into the query scale, which every dimension takes)")
    return torch.stack([inv_freq(rot, t, arch.rope_scaling) for t in rope_thetas(arch)])


class Block(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        h, eps, off = arch.hidden_size, arch.rms_norm_eps, arch.norm_offset
        self.attn_norm = RMSNorm(h, eps, off)
        self.attends = spec.mixer is None
        if spec.mixer is None:
            self.attn = LatentAttention(arch) if arch.mla else Attention(arch, spec.attention)
        else:                                  # a state layer in the attention's place
            self.mixer = STATE_LAYERS[spec.mixer.kind](arch, spec.mixer)
        self.mlp_norm = RMSNorm(h, eps, off)
        glu = Glu.of(arch)
        self.mlp: nn.Module = (MoE(h, spec.mlp, glu, arch.mlp_bias) if spec.mlp.num_experts else
                               GatedMLP(h, spec.mlp.intermediate_size, arch.mlp_bias, glu))
        self.post_norms = arch.post_norms
        self.residual_scale = arch.residual_scale
        if arch.post_norms:
            self.post_attn_norm = RMSNorm(h, eps, off)
            self.post_mlp_norm = RMSNorm(h, eps, off)

    def forward(self, x, cos, sin, cache, meta):
        """``cache``/``meta``: the layer's K/V pool and ``AttnMeta``, or in a state layer its
        state tensors and ``StateMeta``."""
        h = self.attn_norm(x)
        a = self.attn(h, cos, sin, cache, meta) if self.attends else self.mixer(h, cache, meta)
        x = x + self.scaled(self.post_attn_norm(a) if self.post_norms else a)
        m = self.mlp(self.mlp_norm(x))
        return x + self.scaled(self.post_mlp_norm(m) if self.post_norms else m)

    def scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A residual branch as it is added (Granite scales both)."""
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale


class Decoder(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Block(arch, spec) for spec in arch.layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_offset)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # each layer's index among those of its kind: its K/V slot, or its state
        self.cache_index = [(arch.attention_layers if s.attends else arch.state_layers).index(i)
                            for i, s in enumerate(arch.layers)]
        thetas = rope_thetas(arch)
        self.rope_index = [thetas.index(s.attention.rope_theta) for s in arch.layers]
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                meta: AttnMeta | GraphMeta | list[AttnMeta], groups: KVGroups | None = None,
                states: tuple[tuple[torch.Tensor, ...], ...] = (), state_meta: StateMeta | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; writes K/V into ``kv_pool``. In a
        pool of ``groups``, ``meta`` is one ``AttnMeta`` a group and the ``j``-th attention
        layer reads slot ``groups.slot[j]`` with its group's. The ``j``-th state layer reads
        and updates ``states[j]`` at the slots ``state_meta`` names (a ``GraphMeta``: reads the
        decodes' states ``states[j]`` and appends their new ones to ``meta.new_states``)."""
        x = self.embed(token_ids)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        rope = [cos_sin(positions, self.inv_freq[j]) for j in range(self.inv_freq.shape[0])]
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.rope_index[i]]
            j = self.cache_index[i]
            if not layer.attends:      # in a graph, the decodes' states gathered (see layers/state.py)
                x = layer(x, cos, sin, states[j], meta if isinstance(meta, GraphMeta) else state_meta)
            elif isinstance(meta, GraphMeta):     # graphs index the whole pool (see pool_gather)
                meta.layer = j
                x = layer(x, cos, sin, kv_pool, meta)
            elif isinstance(meta, list):
                assert groups is not None
                x = layer(x, cos, sin, kv_pool[groups.slot[j]], meta[groups.group[j]])
            else:
                x = layer(x, cos, sin, kv_pool[j], meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden).float()
        if self.arch.logit_divisor != 1.0:
            out = out / self.arch.logit_divisor
        cap = self.arch.final_softcap
        return out if cap is None else cap * torch.tanh(out / cap)
