"""What the traced-graph backends (onnxruntime, iree, tensorrt) compute: each runs one graph
traced from the decoder (``twophase.models.graph_attention``), so they claim one set."""

# every departure of the families from the Llama block that one traced graph computes on any
# runtime (experts need a form of their own: below). Named one by one, never derived from
# ``twophase.arch.FEATURES``: a feature added there is refused until the graph computes it and
# this list names it.
TRACED_FEATURES = frozenset({
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "post_norms", "gelu_tanh", "embed_scale",
    "attn_softcap", "final_softcap", "query_scale", "partial_rotary", "rope_per_layer", "sliding_window",
    "rope_yarn", "attn_sinks", "mla",
})

# the kinds of state layer whose one step the step graph traces (``models/layers/state.py``):
# decodes only, their prefill runs on another backend
STATE_DECODE = frozenset({"gated_deltanet", "short_conv", "mamba2"})
# experts traced in a static form (``models/layers/moe_graph.py``): ONNX Runtime's fused MoE
# operator, IREE's every-expert prefill and gathered decode, TensorRT's every-expert graph in
# standard operators (it parses no MoE operator)
MOE = frozenset({"moe", "moe_bias", "clamped_swiglu", "moe_routing"})
# what the onnxruntime and iree backends compute: the traced features, the state layers in
# decode, experts, and what the families that have them add (the decoder's own code, traced as the rest)
GRAPH_FEATURES = (TRACED_FEATURES | STATE_DECODE | MOE
                  | {"attn_output_gate", "no_rope", "residual_scale", "logit_divisor"})

# how each graph backend computes experts (``Capabilities.computes``), and at what cost against
# torch's routed loop: ``benchmarks/moe_graph.py``, docs/measurements.md
MOE_ONNXRUNTIME = ("ONNX Runtime's fused MoE operator: each expert on the tokens routed to it, the routed "
                   "loop's reads and FLOPs in one kernel (DeepSeek's routing computed in the graph and "
                   "handed to it as logits)")
MOE_TENSORRT = ("a static form in standard ONNX ops: every expert on every token, weighted by the routing "
                "(experts / top-k times the routed FLOPs; TensorRT has no MoE operator to parse)")
MOE_IREE = ("static forms: prefill runs every expert on every token (experts / top-k times the routed FLOPs), "
            "decode gathers each token's experts (top-k expert reads a token): far slower than torch's "
            "routed loop past a few tokens")
