"""torch → MLIR → an IREE module (``.vmfb``) with two entry points, ``prefill`` and ``decode``.

Route: the project's torch model through ``iree.turbine.aot`` (``FxProgramsBuilder``), not the
ONNX export through ``iree-import-onnx``. One builder exports two programs over the same weights,
so the module carries one copy of them and two specialised functions; and the static-dataflow
attention (``twophase.models.graph_attention``) is traced with a group *absent* rather than
empty, so ``decode`` contains no chunk path and ``prefill`` no decode path. The attention is the
explicit-softmax one the ONNX graph uses: IREE's lowering of ``scaled_dot_product_attention``
ran about 5x slower than torch on this CPU.

Entry points (int64 indices, the pool ``[S, P, NB, KVH, BS, hd]``, its layers' blocks as
``graph.inputs.layer_blocks`` gives them, so a pool in groups is read as a plain one):

- ``prefill(input_ids [T], positions [T], kv_pool, chunk_index [C, Q], chunk_blocks [L, C, Wc],
  chunk_cached [C], chunk_lens [C], logits_index [N])``: chunks after cached tokens, padded to
  the longest (padding index = T); decodes in a mixed step ride along as one-token chunks.
- ``decode(input_ids [D], positions [D], kv_pool, dec_blocks [L, D, Wd], dec_cached [D])``: one
  token per sequence, logits for each. A model with state layers passes the decodes' states
  gathered at their slots after these (``state_J_I [D, *shape]``, ``signature.with_states``) and
  gets their new ones after the K/V; its module has no ``prefill`` (the chunked form is not
  traced: such a model prefills on another backend).

Both return ``logits [N, vocab]`` float32 and ``new_k``/``new_v [L, T, KVH, hd]``. Like the ONNX
graph, neither updates its pool argument: where the pool is the engine's (imported through
DLPack), the backend writes the new K/V at the batch's slots with torch. Two more entry points serve a pool
the module keeps in its own device memory (the backend's ``owned`` mode, for a runtime that
cannot import torch's memory):

- ``write_kv(kv_pool, new_k, new_v, rows [L, P, T, KVH])`` (``graph.inputs.kv_rows``) writes a
  step's K/V into the pool, so the K/V never leave the device (the argument is mutated, as
  shark-ai's paged models mutate ``cache_state``; IREE 3.13 does it by copying the whole pool);
- ``clear_kv(kv_pool)`` zeroes a freshly allocated pool in place (masked attention reads unused
  slots, and uninitialised memory could hold NaNs).

The pool's block size is compiled in (a static dimension lets IREE tile the per-block matmuls);
the manifest names it, so a config with another block size gets its own module.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from twophase.cache.layout import KVHeads
from twophase.contract import ModelSpec
from twophase.device import cpu_name
from twophase.exporters.cache import build_cached, cache_folder, weights_digest
from twophase.exporters.onnx import PagedStep, example_groups, quiet_exporter_logs
from twophase.graph.inputs import kv_rows, layer_blocks, write_rows
from twophase.graph.signature import DECODE, PREFILL
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.moe import traced_as
from twophase.models.q4_weights import cpu_model

FORMAT = "twophase-mlir/7"      # 3: write_kv and clear_kv entry points; 4: layers' block indices;
                                # 5: the decodes' states; 6: experts (top k without topk); 7: latent pools
log = logging.getLogger(__name__)


class PhaseSteps(nn.Module):
    """The two entry points as methods of one module (one copy of the weights)."""

    def __init__(self, model):
        super().__init__()
        self.step = PagedStep(model)

    def prefill(self, input_ids, positions, kv_pool, chunk_index, chunk_blocks, chunk_cached,
                chunk_lens, logits_index):
        meta = GraphMeta(None, None, None, chunk_index, chunk_blocks, chunk_cached, chunk_lens)
        return self.step.run(input_ids, positions, kv_pool, meta, logits_index)

    def decode(self, input_ids, positions, kv_pool, dec_blocks, dec_cached, states=()):
        index = torch.arange(input_ids.shape[0], device=input_ids.device)
        meta = GraphMeta(index, dec_blocks, dec_cached, None, None, None, None)
        return self.step.run(input_ids, positions, kv_pool, meta, index, states)

    def write_kv(self, kv_pool, new_k, new_v, rows):
        write_rows(kv_pool, new_k, new_v, rows)

    def clear_kv(self, kv_pool):
        kv_pool.zero_()


for _entry, _sig in ((PhaseSteps.prefill, PREFILL), (PhaseSteps.decode, DECODE)):
    assert list(inspect.signature(_entry).parameters)[1:len(_sig.names) + 1] == _sig.names, \
        f"{_entry} != its signature"


def iree_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("iree-base-compiler", "iree-base-runtime", "iree-turbine")}


def target_flags(device: str) -> list[str]:
    """Compiler flags for ``device``: the host CPU for ``cpu``; for ``cuda``, sm_80 code (IREE
    ships no sm_90 target; newer GPUs run it through the driver's PTX JIT)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host"]
    if kind == "cuda":
        return ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]
    raise ValueError(f"no IREE target for device {device!r}")


def manifest_for(model: ModelSpec, device: str, block_size: int) -> dict[str, Any]:
    return {"format": FORMAT, "model_id": model.model_id, "arch": model.arch.to_dict(),
            "dtype": str(model.dtype).removeprefix("torch."), "block_size": block_size,
            "target": target_flags(device), "host_cpu": cpu_name() if device == "cpu" else None,
            "exporter": f"torch {torch.__version__}", **iree_versions(),
            "weights_sha256": weights_digest(model)}


def export(model: ModelSpec, device: str = "cpu", block_size: int = 16,
           out_dir: Path | None = None, force: bool = False) -> Path:
    """The compiled module for ``model`` (``model.vmfb`` + ``manifest.json``), built now unless
    an up-to-date one is already in ``out_dir`` (default: the cache)."""
    manifest = manifest_for(model, device, block_size)
    folder = Path(out_dir) if out_dir else cache_folder("mlir", manifest)
    build_cached(folder, manifest, lambda tmp: _compile_to(model, device, block_size, tmp),
                 force, "IREE module")
    return folder / "model.vmfb"


def _compile_to(model: ModelSpec, device: str, block_size: int, folder: Path) -> None:
    from iree.turbine import aot
    from torch.export import Dim
    from tqdm import tqdm

    stages = tqdm(total=4, desc=f"IREE module for {model.model_id}", unit="stage")
    with quiet_exporter_logs(), warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        steps = PhaseSteps(cpu_model(model)).eval()
        arch = steps.step.model.arch
        pre_args, pre_dyn, dec_args, dec_dyn = _examples(arch, model.dtype, block_size)
        fxb = aot.FxProgramsBuilder(steps)
        stages.set_postfix_str("tracing prefill")

        # turbine inspects these functions' signatures: the arguments must be spelled out
        # experts: every one on every token in prefill, each token's own gathered in decode
        # (``models/layers/moe_graph.py``)
        if not arch.state_layers:                 # state layers: decode only
            with traced_as(steps, "dense"):
                @fxb.export_program(name="prefill", args=pre_args, dynamic_shapes=pre_dyn, strict=False)
                def prefill(module, input_ids, positions, kv_pool, chunk_index, chunk_blocks,
                            chunk_cached, chunk_lens, logits_index):
                    return module.prefill(input_ids, positions, kv_pool, chunk_index, chunk_blocks,
                                          chunk_cached, chunk_lens, logits_index)

        stages.update()
        stages.set_postfix_str("tracing decode")

        # ``states``: a model with state layers' decodes' states (a tuple, flattened by the export)
        with traced_as(steps, "gathered"):
            @fxb.export_program(name="decode", args=dec_args, dynamic_shapes=dec_dyn, strict=False)
            def decode(module, input_ids, positions, kv_pool, dec_blocks, dec_cached, states):
                return module.decode(input_ids, positions, kv_pool, dec_blocks, dec_cached, states)

        pool, new_k, new_v, rows = _pool_examples(steps.step.model.arch, model.dtype, block_size)
        t, nb, sl = Dim("T"), Dim("NB"), Dim("S")

        @fxb.export_program(name="write_kv", args=(pool, new_k, new_v, rows), strict=False,
                            dynamic_shapes=({0: sl, 2: nb}, {1: t}, {1: t}, {2: t}))
        def write_kv(module, kv_pool, new_k, new_v, rows):
            module.write_kv(kv_pool, new_k, new_v, rows)
            return ()                             # turbine imports no `None` result

        @fxb.export_program(name="clear_kv", args=(pool,), dynamic_shapes=({0: sl, 2: nb},), strict=False)
        def clear_kv(module, kv_pool):
            module.clear_kv(kv_pool)
            return ()

        stages.update()
        stages.set_postfix_str("importing to MLIR")
        out = aot.export(fxb)
        stages.update()
        stages.set_postfix_str("compiling")
        out.session.set_flags(*target_flags(device))
        out.compile(save_to=str(folder / "model.vmfb"), target_backends=None)
        stages.update()
    stages.close()


def _examples(arch, dtype: torch.dtype, bs: int):
    from torch.export import Dim

    L, heads = len(arch.attention_layers), KVHeads.of(arch)
    pool = torch.zeros(2, heads.planes, 16, heads.num_kv_heads, bs, heads.head_dim, dtype=dtype)
    groups = example_groups(L)
    T = 6                                         # chunks of 2 and 4 tokens after cached ones
    pre = (torch.arange(T) % arch.vocab_size, torch.tensor([3, 4, 5, 6, 7, 8]), pool,
           torch.tensor([[0, 1, T, T], [2, 3, 4, 5]]),
           layer_blocks(torch.tensor([[[0, 1], [2, 3]]] * 2), pool.shape, groups),
           torch.tensor([3, 5]), torch.tensor([2, 4]), torch.tensor([1, 5]))
    t, sl, nb, c, q, wc, n = (Dim(x) for x in ("T", "S", "NB", "C", "Q", "Wc", "N"))
    pre_dyn = ({0: t}, {0: t}, {0: sl, 2: nb}, {0: c, 1: q}, {1: c, 2: wc}, {0: c}, {0: c}, {0: n})
    D = 3
    dec = (torch.arange(D) % arch.vocab_size, torch.tensor([5, 9, 2]), pool,
           layer_blocks(torch.tensor([[[0, 1, 0], [2, 3, 4], [5, 0, 0]]] * 2), pool.shape, groups),
           torch.tensor([5, 9, 2]))
    shapes = [shape for s in arch.layers if s.mixer is not None for shape in s.mixer.state_shapes()]
    states = tuple(torch.zeros(D, *shape) for shape in shapes)          # float32, as KVCache.states
    dec = (*dec, states)
    d, wd, sl2, nb2 = Dim("D"), Dim("Wd"), Dim("S"), Dim("NB")
    dec_dyn = ({0: d}, {0: d}, {0: sl2, 2: nb2}, {1: d, 2: wd}, {0: d}, tuple({0: d} for _ in states))
    return pre, pre_dyn, dec, dec_dyn


def _pool_examples(arch, dtype: torch.dtype, bs: int):
    L, heads, T = len(arch.attention_layers), KVHeads.of(arch), 3
    kvh, hd = heads.num_kv_heads, heads.head_dim
    pool = torch.zeros(2, heads.planes, 16, kvh, bs, hd, dtype=dtype)
    rows = kv_rows(tuple(pool.shape), torch.tensor([[0, 5, 17]] * 2), example_groups(L))
    return (pool, torch.ones(L, T, kvh, hd, dtype=dtype), torch.ones(L, T, kvh, hd, dtype=dtype), rows)
