"""The static forms experts are traced in (``models/layers/moe_graph.py``) against the eager
routed loop: each in torch, with the plain routing and DeepSeek's, ONNX Runtime's fused operator
as the exporter writes it (DeepSeek's routing handed to it as logits), and IREE's two forms
compiled over two layers (a second layer routes by its own router, not the first's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twophase.arch import MLPSpec
from twophase.models.layers.mlp import Glu
from twophase.models.layers.moe import MoE, traced_as

GATES = {"silu": (Glu(), False), "clamped_swiglu": (Glu("clamped_swiglu", 1.702, 7.0), True)}


# DeepSeek's routings (``MoE.choose``): V2's softmax, its best 2 of 4 groups by their best
# score, scaled and not renormalised; V3's sigmoid with a choosing bias, groups by their best
# two, renormalised and scaled
ROUTINGS = {"v2": {"groups": 4, "topk_groups": 2, "routed_scale": 16.0},
            "v3": {"scoring": "sigmoid", "score_bias": True, "groups": 4, "topk_groups": 2,
                   "group_score": "top2", "routed_scale": 2.5}}


def _moe(gate: str, shared: int = 0, seed: int = 0, routing: str | None = None) -> MoE:
    glu, bias = GATES[gate]
    torch.manual_seed(seed)
    how = ROUTINGS[routing] if routing else {}
    spec = MLPSpec(16, 8 if routing else 6, 3 if routing else 2, routing == "v3" or (gate == "silu" and not routing),
                   shared_intermediate_size=shared, **how)
    m = MoE(32, spec, glu, bias)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)      # large enough that the clamp bites
    return m.eval().requires_grad_(False)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", ["op", "dense", "gathered"])
def test_each_static_form_equals_the_routed_loop(gate, form):
    m = _moe(gate, shared=8 if gate == "silu" else 0)
    x = torch.randn(9, 32)
    want = m(x)
    with traced_as(m, form):
        assert _rel(m(x), want) < 1e-5
    assert m.graph_form is None


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("form", ["op", "dense", "gathered"])
def test_deepseek_s_routing_in_each_static_form_equals_the_routed_loop(routing, form):
    m = _moe("silu", shared=8, routing=routing)
    x = torch.randn(9, 32)
    want = m(x)
    with traced_as(m, form):
        assert _rel(m(x), want) < 1e-5
    # the routing matters: plain softmax routing over the same weights gives another answer
    m.spec = MLPSpec(16, 8, 3, True)
    assert _rel(m(x), want) > 1e-2


@pytest.mark.parametrize("routing, dtype", [(None, torch.float32), ("v3", torch.float32),
                                            ("v3", torch.float16)])
def test_onnxruntime_s_fused_operator_equals_the_routed_loop(tmp_path, routing, dtype):
    """In float16 too (a CUDA model's): the logits DeepSeek's routing hands the operator are in
    the input's dtype, as its schema binds them (ONNX Runtime refuses the graph otherwise)."""
    ort = pytest.importorskip("onnxruntime")
    from twophase.exporters import onnx_moe

    m = _moe("clamped_swiglu", routing=routing).to(dtype)
    x = torch.randn(9, 32, dtype=dtype)
    with traced_as(m, "op"):
        torch.onnx.export(m, (x,), str(tmp_path / "m.onnx"), dynamo=True, optimize=False,
                          dynamic_shapes=({0: torch.export.Dim("T")},),
                          custom_translation_table=onnx_moe.translations())
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [n.op_type for n in __import__("onnx").load(str(tmp_path / "m.onnx")).graph.node].count("MoE") == 1
    for T in (1, 5):
        a = torch.randn(T, 32, dtype=dtype)
        want = m.float()(a.float()) if dtype != torch.float32 else m(a)
        within = 1e-5 if dtype == torch.float32 else 2e-3
        assert _rel(sess.run(None, {sess.get_inputs()[0].name: a.numpy()})[0], want) < within


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _moe("silu", seed=1), _moe("clamped_swiglu", seed=2)

    def dense(self, x):
        return self.b(x + self.a(x))

    def gathered(self, x):
        return self.b(x + self.a(x))


@pytest.mark.exhaustive        # a compile; the families' IREE runs (exhaustive too) route through both forms
def test_iree_s_dense_and_gathered_forms_route_each_layer_by_its_own_router(tmp_path):
    pytest.importorskip("iree.turbine")
    import iree.runtime as rt
    from iree.turbine import aot

    from twophase.exporters.mlir import target_flags

    two = _TwoLayers().eval()
    x = torch.randn(7, 32)
    want = two.dense(x)
    with torch.inference_mode():
        fxb = aot.FxProgramsBuilder(two)
        for form in ("dense", "gathered"):
            with traced_as(two, form):
                fxb.export_program(lambda module, x, f=form: getattr(module, f)(x), name=form, args=(x,),
                                   dynamic_shapes={"x": {0: torch.export.Dim("T")}}, strict=False)
        out = aot.export(fxb)
    out.session.set_flags(*target_flags("cpu"))
    out.compile(save_to=str(tmp_path / "m.vmfb"))
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, (tmp_path / "m.vmfb").read_bytes()))
    for form in ("dense", "gathered"):
        assert _rel(ctx.modules.module[form](x.numpy()).to_host(), want) < 1e-5, form
