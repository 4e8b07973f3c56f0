"""What the traced-graph backends (onnxruntime, iree, tensorrt) compute: each runs one graph
traced from the decoder (``twophase.models.graph_attention``), so they claim one set."""

# every departure of the families from the Llama block but routing to experts, which is not a
# static graph. Named one by one, never derived from ``twophase.arch.FEATURES``: a feature added
# there is refused until the graph computes it and this list names it.
TRACED_FEATURES = frozenset({
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "post_norms", "gelu_tanh", "embed_scale",
    "attn_softcap", "final_softcap", "query_scale", "partial_rotary", "rope_per_layer", "sliding_window",
    "rope_yarn",
})

# the kinds of state layer whose one step the step graph traces (``models/layers/state.py``):
# decodes only, their prefill runs on another backend
STATE_DECODE = frozenset({"gated_deltanet", "short_conv", "mamba2"})
# what the onnxruntime and iree backends compute: the traced features, the state layers in
# decode, and what the families that have them add (the decoder's own code, traced as the rest)
GRAPH_FEATURES = TRACED_FEATURES | STATE_DECODE | {"attn_output_gate", "no_rope", "residual_scale", "logit_divisor"}
