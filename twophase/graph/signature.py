"""The step graph's inputs and outputs with their symbolic dimensions, in one place.

Dimension names: ``T`` packed tokens, ``N`` logits rows, ``D`` one-token (decode) sequences and
``Wd`` their block-table width, ``C`` chunks padded to ``Q`` tokens with block tables ``Wc``
wide; the pool is ``[S, P, NB, KVH, BS, hd]``, ``P`` planes (K and V, or one latent: MLA's
``[S, 1, NB, 1, BS, latent]``, ``cache.layout.KVHeads``), ``S`` slots of layers (``L`` in a plain pool, fewer
in groups: ``KVGroups``), and graphs index it through each layer's block indices ``[L, ...]``.
``L``, ``P``, ``KVH`` and ``hd`` are fixed by the model; every other name is dynamic in an export and
ranges over a TensorRT profile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Dim = str | int
MODEL_DIMS = frozenset({"L", "P", "KVH", "hd"})          # fixed once the model is known
POOL: tuple[Dim, ...] = ("S", "P", "NB", "KVH", "BS", "hd")


@dataclass(frozen=True)
class GraphSignature:
    inputs: tuple[tuple[str, tuple[Dim, ...]], ...]     # (name, dims) in call order
    outputs: tuple[str, ...] = ("logits", "new_k", "new_v")

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.inputs]

    def dims(self, name: str) -> tuple[Dim, ...]:
        return dict(self.inputs)[name]

    def only(self, names: list[str]) -> GraphSignature:
        """The inputs ``names`` (an entry point that takes some of the step's inputs)."""
        return GraphSignature(tuple((n, self.dims(n)) for n in names), self.outputs)

    def shape(self, name: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """``name``'s concrete shape, given a size for each of its symbolic dimensions."""
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims(name))

    def partial_shape(self, name: str, sizes: Mapping[str, int]) -> list[int | str]:
        """``name``'s shape with the sizes given and the other dimensions left as names (an
        ONNX value info's shape)."""
        return [d if isinstance(d, int) else sizes.get(d, d) for d in self.dims(name)]

    def dynamic_axes(self, make: Callable[[str], Any]) -> dict[str, dict[int, Any]]:
        """For each input, ``{axis: make(dim name)}`` over its dynamic axes (what
        ``torch.onnx.export(dynamic_shapes=...)`` takes, with ``make = torch.export.Dim``);
        one object per name, so axes that share a name share a size."""
        made: dict[str, Any] = {}
        out: dict[str, dict[int, Any]] = {}
        for name, dims in self.inputs:
            out[name] = {i: made.setdefault(d, make(d)) for i, d in enumerate(dims)
                         if isinstance(d, str) and d not in MODEL_DIMS}
        return out


# The step graph (``exporters/onnx.py`` traces it): decodes and prefill chunks in one call.
STEP = GraphSignature((
    ("input_ids", ("T",)),
    ("positions", ("T",)),
    ("kv_pool", POOL),
    ("dec_index", ("D",)),            # token index of each one-token sequence
    ("dec_blocks", ("L", "D", "Wd")),  # each layer's K blocks of each (graph.inputs.layer_blocks)
    ("dec_cached", ("D",)),           # tokens cached before it
    ("chunk_index", ("C", "Q")),      # token index of each padded query slot (padding = T)
    ("chunk_blocks", ("L", "C", "Wc")),
    ("chunk_cached", ("C",)),
    ("chunk_lens", ("C",)),
    ("logits_index", ("N",)),         # rows of the packed tokens whose logits are wanted
))



def with_states(sig: GraphSignature, shapes: Sequence[Sequence[tuple[int, ...]]]) -> GraphSignature:
    """``sig`` for a model with state layers (``shapes``: each state layer's tensors' shapes,
    ``StateLayerSpec.state_shapes``): the decodes' states gathered at their slots, ``state_J_I
    [D, *shape]`` (the ``I``-th tensor of the ``J``-th state layer), as inputs after ``sig``'s,
    and their new values ``new_state_J_I`` as outputs after its. No state layers: ``sig``."""
    names = [f"{j}_{i}" for j, layer in enumerate(shapes) for i in range(len(layer))]
    dims: list[tuple[Dim, ...]] = [("D", *shape) for layer in shapes for shape in layer]
    return GraphSignature(sig.inputs + tuple((f"state_{n}", d) for n, d in zip(names, dims)),
                          sig.outputs + tuple(f"new_state_{n}" for n in names))


# IREE's two entry points (``exporters/mlir.py``): the step graph split by phase.
PREFILL = STEP.only(["input_ids", "positions", "kv_pool", "chunk_index", "chunk_blocks",
                     "chunk_cached", "chunk_lens", "logits_index"])
DECODE = STEP.only(["input_ids", "positions", "kv_pool", "dec_blocks", "dec_cached"])

# The hand-built decode-only ONNX graph (``exporters/decode_graph.py``): ``B`` sequences,
# ``blocks`` each layer's K then V blocks as indices of the pool's ``S * 2 * NB`` blocks, and
# ``mask`` 0 or -inf over the ``P1 = W * BS + 1`` keys (cache, then the new token).
DECODE_GRAPH = GraphSignature((
    ("input_ids", ("B",)),
    ("positions", ("B", 1)),
    ("kv_pool", POOL),
    ("blocks", ("2L", "B", "W")),
    ("mask", ("B", 1, 1, "P1")),
))

# The same graph for short chunks (a decode and its drafts): ``B`` sequences of ``Q`` tokens each
# (padded), ``input_ids`` sequence by sequence, and ``mask`` over the ``PQ = W * BS + Q`` keys
# for each query row ``q * G + g`` (``G`` query heads a KV head): the cache, then causally the
# sequence's own new tokens.
VERIFY_GRAPH = GraphSignature((
    ("input_ids", ("BQ",)),
    ("positions", ("B", "Q")),
    ("kv_pool", POOL),
    ("blocks", ("2L", "B", "W")),
    ("mask", ("B", 1, "QG", "PQ")),
))
