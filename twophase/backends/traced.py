"""What the traced-graph backends (onnxruntime, iree, tensorrt) compute: each runs one graph
traced from the decoder (``twophase.models.graph_attention``), so they claim one set."""

# every departure of the families from the Llama block but routing to experts, which is not a
# static graph. Named one by one, never derived from ``twophase.arch.FEATURES``: a feature added
# there is refused until the graph computes it and this list names it.
TRACED_FEATURES = frozenset({
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "post_norms", "gelu_tanh", "embed_scale",
    "attn_softcap", "final_softcap", "query_scale", "partial_rotary", "rope_per_layer", "sliding_window",
})
