"""torch → ONNX: the project's own decoder, traced with its static-dataflow paged attention.

One graph serves both phases and any mix: a batch of one-token decodes, prefill chunks after
cached tokens, or both at once (``twophase.models.graph_attention``). Every dimension is dynamic
(tokens, sequences, chunk length, block-table widths, pool size, block size), so one export
serves any batch and any pool. The dynamo exporter is used: the TorchScript one hard-coded the block-table
width and failed at run time.

Its inputs and outputs are ``twophase.graph.signature.STEP``: tokens, positions, the pool, the
seven ``GraphMeta`` tensors and the rows whose logits are wanted; ``logits [N, vocab]`` float32
and the step's ``new_k``/``new_v [L, T, KVH, hd]`` for the backend to write into the pool. A
model with state layers adds the decodes' states and returns their new ones
(``signature.with_states``): its graph computes decodes only, the one-step recurrence.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from twophase.cache.layout import KVHeads
from twophase.contract import KVGroups, ModelSpec
from twophase.exporters import decode_graph, onnx_moe
from twophase.exporters.cache import build_cached, cache_folder, weights_digest
from twophase.exporters.shared_weights import share_weights
from twophase.graph.inputs import layer_blocks
from twophase.graph.signature import STEP, GraphSignature, with_states
from twophase.models.decoder import Decoder
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.moe import traced_as
from twophase.models.q4_weights import (
    calibration_digest,
    calibration_ids,
    cpu_model,
    model_qweights,
    outlier_channels,
)

INPUTS = STEP.names
OUTPUTS = list(STEP.outputs)
log = logging.getLogger(__name__)


def signature(arch) -> GraphSignature:
    """The step graph's inputs and outputs for ``arch``: ``STEP``, and a model with state
    layers' states (``with_states``)."""
    return with_states(STEP, [s.mixer.state_shapes() for s in arch.layers if s.mixer is not None])


class PagedStep(nn.Module):
    """The function every graph backend runs: one step over packed tokens (its arguments are
    ``STEP``'s inputs, in order: checked below, then a model with state layers' states, each
    layer's tensors in turn)."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model
        # each state layer's count of tensors
        self.state_counts = [len(s.mixer.state_shapes()) for s in model.arch.layers if s.mixer is not None]

    def forward(self, input_ids, positions, kv_pool, dec_index, dec_blocks, dec_cached,
                chunk_index, chunk_blocks, chunk_cached, chunk_lens, logits_index, *states):
        meta = GraphMeta(dec_index, dec_blocks, dec_cached, chunk_index, chunk_blocks,
                         chunk_cached, chunk_lens)
        return self.run(input_ids, positions, kv_pool, meta, logits_index, states)

    def run(self, input_ids, positions, kv_pool, meta: GraphMeta, logits_index, states=()):
        per_layer, at = [], 0
        for n in self.state_counts:
            per_layer.append(tuple(states[at:at + n]))
            at += n
        hidden = self.model(input_ids, positions, kv_pool, meta, states=tuple(per_layer))
        logits = self.model.logits(hidden.index_select(0, logits_index))
        new_k = torch.stack([k for k, _ in meta.new_kv])
        new_v = torch.stack([v for _, v in meta.new_kv])
        return (logits, new_k, new_v, *(t for layer in meta.new_states for t in layer))


assert list(inspect.signature(PagedStep.forward).parameters)[1:-1] == INPUTS, "forward != STEP"


def run_eager(step: PagedStep, pool: torch.Tensor, inputs: dict[str, torch.Tensor]):
    """The graph's function run by torch itself (the reference an export must match)."""
    with torch.inference_mode():
        return step(*(pool if n == "kv_pool" else inputs[n] for n in signature(step.model.arch).names))


# -- export, cached by manifest ---------------------------------------------------------------
OPSET = 18
Q4_FORMAT = 3                   # 2: a float model's head at 8 bits; 3: centred zero points, outlier channels
# 2: dynamic block size; 3: no onnxscript pass; 4: flat pool gather; 5: K and V gathered apart;
# 6: masks built once a step, slices for splits; 7: decode.onnx beside it; 9: it gathers whole
# blocks; 13: new K/V joined once at the end; 15: verify.onnx; 16: each layer's block indices, a
# pool of any slot count; 17: latent pools (one plane) and DeepSeek's routing (10 to 12, 14: unreleased trials)
FORMAT = "twophase-onnx/17"


def manifest_for(model: ModelSpec, moe_form: str = "op") -> dict[str, Any]:
    """What the export is a function of; ``moe_form``: the static form experts are traced in
    (``moe_graph.FORMS``: ONNX Runtime's fused operator, or standard ops for another runtime),
    named only for a model that has experts."""
    import onnx

    experts = {"moe_form": moe_form} if "moe" in model.arch.features() else {}
    return {"format": FORMAT, **experts, "model_id": model.model_id, "arch": model.arch.to_dict(),
            "dtype": str(model.dtype).removeprefix("torch."), "opset": OPSET,
            "exporter": f"torch {torch.__version__}", "onnx": onnx.__version__,
            "weights_sha256": weights_digest(model), "inputs": signature(model.arch).names,
            "outputs": list(signature(model.arch).outputs),
            "quantization": model.quantization,
            "accuracy_level": model.accuracy_level if model.quantization != "none" else None,
            "quant_format": Q4_FORMAT if model.quantization == "q4" else None,
            "outlier_channels": model.outlier_channels if model.quantization == "q4" else None,
            "calibration_sha256": calibration_digest() if model.quantization == "q4" else None}


def export_dir(manifest: dict[str, Any]) -> Path:
    return cache_folder("onnx", manifest)


def export(model: ModelSpec, out_dir: Path | None = None, force: bool = False, moe_form: str = "op") -> Path:
    """The ONNX graph for ``model`` (``model.onnx`` + external weights + ``manifest.json``, and
    for float32 models ``decode.onnx`` and ``verify.onnx``, the hand-built graphs for decodes
    and for short chunks), exported now unless an up-to-date one is already in ``out_dir``
    (default: the cache)."""
    manifest = manifest_for(model, moe_form)
    folder = Path(out_dir) if out_dir else export_dir(manifest)
    if model.quantization == "q4":           # rewritten from the (cached) float export
        build = lambda tmp: _quantize_to(model, export(replace(model, quantization="none")), tmp)  # noqa: E731
    else:
        build = lambda tmp: _export_to(model, tmp, moe_form)  # noqa: E731
    build_cached(folder, manifest, build, force, "ONNX export")
    return folder / "model.onnx"


def _export_to(model: ModelSpec, folder: Path, moe_form: str = "op") -> None:
    """``model.onnx``, the step graph (torch's trace), and for float32 models the hand-built
    graphs for all-decode steps and short chunks (``twophase.exporters.decode_graph``)."""
    step = PagedStep(cpu_model(model)).eval()
    args, dynamic = _example(step.model.arch, model.dtype)
    sig = signature(step.model.arch)
    log.info("tracing the step graph (model.onnx)")
    with quiet_exporter_logs(), warnings.catch_warnings(), traced_as(step, moe_form):
        warnings.simplefilter("ignore")
        torch.onnx.export(step, args, str(folder / "model.onnx"), dynamo=True,
                          custom_translation_table=onnx_moe.translations(),
                          input_names=sig.names, output_names=list(sig.outputs), dynamic_shapes=dynamic,
                          opset_version=OPSET, external_data=True, verbose=False,
                          optimize=False)   # ORT optimises at load; onnxscript's pass took minutes
    if model.dtype == torch.float32 and decode_graph.supported(step.model.arch):
        for name, verify in (("decode.onnx", False), ("verify.onnx", True)):
            log.info("building %s (the graph for %s)", name, "short chunks" if verify else "decode steps")
            decode_graph.build(step.model, folder / name, verify=verify)
        share_weights([folder / "model.onnx", folder / "decode.onnx", folder / "verify.onnx"])


def _quantize_to(model: ModelSpec, float_graph: Path, folder: Path) -> None:
    """The float graph with its projections and head on block-quantised weights: the GGUF's own
    blocks where the model came from one, else the float weights quantised to 4 bits."""
    from twophase.exporters import q4

    # the float model, even for a GGUF's blocks: the graph's other weights, the calibration
    # text's activations (outlier channels) and the decode graphs are built from it
    torch_model = cpu_model(model)
    weights = model_qweights(torch_model, model.arch, model.source.gguf)
    outliers = outlier_channels(torch_model, calibration_ids(model), model.outlier_channels)
    n = q4.quantize_graph(float_graph, folder / "model.onnx", weights, model.accuracy_level,
                          outliers)
    if model.dtype == torch.float32 and decode_graph.supported(torch_model.arch):
        for name, verify in (("decode.onnx", False), ("verify.onnx", True)):
            decode_graph.build(torch_model, folder / name, weights, outliers, model.accuracy_level,
                               verify=verify)
        share_weights([folder / "model.onnx", folder / "decode.onnx", folder / "verify.onnx"])
    log.info("%d matmuls run on quantised weights (MatMulNBits, accuracy level %d, %d outlier "
             "channels each in float32)", n, model.accuracy_level, model.outlier_channels)


@contextmanager
def quiet_exporter_logs():
    """The exporters' passes log every node at INFO."""
    loggers = [logging.getLogger(n) for n in ("onnxscript", "onnx_ir", "torch.onnx", "torch.export",
                                              "iree.turbine")]
    # torch's op registry warns, at each export, that torchvision (never used here) is missing
    loggers.append(logging.getLogger("torch.onnx._internal.exporter._registration"))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR if lg is loggers[-1] else logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def example_groups(num_layers: int) -> KVGroups:
    """A pool of 2 slots in 2 groups, layers alternating: the traced example's layout (any
    layout traces the same graph; this one keeps the slot count apart from the layer count)."""
    return KVGroups((None, None), tuple(i % 2 for i in range(num_layers)),
                    tuple(i % 2 for i in range(num_layers)))


def _example(arch, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], dict[str, dict[int, Any]]]:
    """A small mixed batch (2 decodes, 2 chunks after cached tokens) and every dim dynamic;
    for a model with state layers, the decodes' states (``*states``)."""
    from torch.export import Dim

    L, heads = len(arch.attention_layers), KVHeads.of(arch)
    bs, nb = 4, 16
    pool = torch.zeros(2, heads.planes, nb, heads.num_kv_heads, bs, heads.head_dim, dtype=dtype)
    groups = example_groups(L)
    T = 8                                      # 2 decode tokens + chunks of 3 and 3
    ex = {
        "input_ids": torch.arange(T) % arch.vocab_size,
        "positions": torch.tensor([5, 9, 2, 3, 4, 6, 7, 8]),
        "kv_pool": pool,
        "dec_index": torch.tensor([0, 1]),
        "dec_blocks": layer_blocks(torch.tensor([[[0, 1, 0], [2, 3, 4]]] * 2), pool.shape, groups),
        "dec_cached": torch.tensor([5, 9]),
        "chunk_index": torch.tensor([[2, 3, 4], [5, 6, 7]]),
        "chunk_blocks": layer_blocks(torch.tensor([[[5, 0], [6, 7]]] * 2), pool.shape, groups),
        "chunk_cached": torch.tensor([2, 6]),
        "chunk_lens": torch.tensor([3, 3]),
        "logits_index": torch.tensor([0, 1, 4, 7]),
    }
    dynamic = STEP.dynamic_axes(Dim)
    shapes = [shape for s in arch.layers if s.mixer is not None for shape in s.mixer.state_shapes()]
    states = tuple(torch.zeros(2, *shape) for shape in shapes)           # float32, as KVCache.states
    if states:
        dynamic["states"] = tuple({0: dynamic["dec_index"][0]} for _ in states)
    return (*(ex[n] for n in INPUTS), *states), dynamic
