"""``quantization = "gguf"``: every tensor as the GGUF file stores it, for ``gguf_blocks.h``.

Each projection is its parts (q, k and v; gate and up; an expert layer's router and its
experts' stacked gate, up and down) in their own block types, their rows the file's bytes, only
reordered where llama.cpp permuted the Q/K rows for its RoPE (whole rows move, so the blocks
stay exact); the head likewise. Norms, RoPE frequencies and the embedding (looked up, never
multiplied) are float32, read from the file by the family's name table. A tensor type
``gguf_blocks.h`` cannot run is refused by name: nothing is converted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from twophase.backends.native.packed import float_arrays
from twophase.contract import ModelSpec
from twophase.errors import ConfigError
from twophase.formats import by_ggml_type
from twophase.models.q4_weights import PROJECTIONS

# the tensor types gguf_blocks.h runs
RUNS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
FORMAT = "twophase-native-stored/2"     # 2: the families' arrays


# an expert MLP's projections in place of the dense gate-and-up and down (the experts' rows
# stacked: expert e's are the e-th of each part's equal shares)
EXPERT_PROJECTIONS = ("mlp.router", "mlp.experts_gate_up", "mlp.experts_down")


def projections(experts: bool) -> tuple[str, ...]:
    return (*PROJECTIONS[:2], *EXPERT_PROJECTIONS) if experts else PROJECTIONS


def gguf_of(spec: ModelSpec) -> Path:
    path = spec.source.gguf
    if path is None:
        raise ConfigError("model.quantization", f'"gguf" runs the tensors of a GGUF file as it stores '
                          f"them; {spec.model_id} was not loaded from one (use \"q4\" to quantise it)")
    return path


def stored_tensors(spec: ModelSpec) -> dict[str, list[tuple[str, np.ndarray]]]:
    """``{"layers.{i}.{projection}": [(type, rows), ...], "lm_head": [...]}``: each part's type
    name and its rows' bytes ``[n, bytes a row]``, Q/K rows un-permuted."""
    from twophase.models.families import family
    from twophase.models.gguf import unpermute_rope
    from twophase.models.gguf_file import GGUFFile

    path, arch = gguf_of(spec), spec.arch
    header = GGUFFile(path)
    fam = family(arch.family)

    def tensor(name: str, heads: int | None = None) -> tuple[str, np.ndarray]:
        t = header.tensors[name]
        fmt = by_ggml_type(t.ggml_type)
        kind = fmt.name if fmt else f"GGML type {t.ggml_type}"
        if kind not in RUNS:
            raise ConfigError("model.quantization", f"{path.name}: {name} is stored as {kind}, which the "
                              f"native backend does not run (it runs {', '.join(RUNS)}); nothing is "
                              f'converted under "gguf": use "q4" to convert it to Q4_1')
        rows = header.rows(name)
        if heads is not None and fam.gguf_rope_permuted:
            rows = rows[unpermute_rope(np.arange(len(rows)), heads)]
        return kind, rows

    rope_heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}
    # a GGUF name "a+b": one of our matrices that llama.cpp stores as two tensors, a part each
    out = {f"layers.{i}.{ours}": [tensor(f"blk.{i}.{g}.weight", rope_heads.get(g))
                                  for part in fam.layer_names[ours][1] for g in part.split("+")]
           for i, layer in enumerate(arch.layers) for ours in projections(layer.mlp.num_experts > 0)}
    out["lm_head"] = [tensor("output.weight" if "output.weight" in header.tensors else "token_embd.weight")]
    return out


def pack(spec: ModelSpec, folder: Path) -> None:
    """Each part's rows to ``{key}.{j}.npy``, their types to ``types.json``, and the float
    arrays."""
    types = {}
    for key, parts in stored_tensors(spec).items():
        types[key] = [t for t, _ in parts]
        for j, (_, rows) in enumerate(parts):
            np.save(folder / f"{key}.{j}.npy", np.ascontiguousarray(rows))
    (folder / "types.json").write_text(json.dumps(types))
    for name, a in float_arrays(spec).items():
        np.save(folder / f"{name}.npy", np.ascontiguousarray(a, dtype=np.float32))
