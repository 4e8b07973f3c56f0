"""``twophase::moe`` (``models/layers/moe_graph.py``) written as ONNX Runtime's fused
``com.microsoft::MoE``, for the dynamo exporter's ``custom_translation_table``.

onnxscript builds a node only for an operator whose schema ``onnx`` knows, and ``onnx`` knows
no ONNX Runtime contrib operator: the schema is declared here once, with the inputs and the
attributes this project sets (the operator takes more; ONNX Runtime reads the node, not this).
"""

from __future__ import annotations

from typing import Any

import torch

_NAME, _DOMAIN = "MoE", "com.microsoft"
_INPUTS = ("input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
           "fc2_experts_bias")
_ATTRS = {"k": "INT", "activation_type": "STRING", "swiglu_fusion": "INT", "normalize_routing_weights": "INT",
          "activation_alpha": "FLOAT", "activation_beta": "FLOAT", "swiglu_limit": "FLOAT"}


def _declare() -> None:
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(_NAME, _DOMAIN):
        return
    kind = OpSchema.AttrType
    onnx.defs.register_schema(OpSchema(
        _NAME, _DOMAIN, 1, inputs=[OpSchema.FormalParameter(n, "T") for n in _INPUTS],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(n, getattr(kind, t), "") for n, t in _ATTRS.items()]))


def _moe(x, logits, w1, b1, w2, b2, k: int, normalize: bool, alpha: float, beta: float, limit: float):
    import onnxscript

    msft = onnxscript.values.Opset(_DOMAIN, 1)
    return msft.MoE(x, logits, w1, b1, w2, b2, k=k, activation_type="swiglu", swiglu_fusion=1,
                    normalize_routing_weights=int(normalize), activation_alpha=alpha, activation_beta=beta,
                    swiglu_limit=limit)


def translations() -> dict[Any, Any]:
    """The table ``torch.onnx.export`` takes (the schema declared first)."""
    import twophase.models.layers.moe_graph  # noqa: F401  (registers twophase::moe)

    _declare()
    return {torch.ops.twophase.moe.default: _moe}
