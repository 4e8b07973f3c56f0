"""One copy of the weights on disk for graphs that hold the same tensors.

The decode and verify graphs are built from the same weights, and ONNX writes each graph's
initializers to a data file of its own: three copies of a model's weights in one export. Here each
later graph's initializers that are byte for byte in an earlier graph's data file point into that
file instead (ONNX external data: a location, an offset and a length), and a data file no graph
reads any more is deleted."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def share_weights(graphs: list[Path]) -> int:
    """Point each graph's external initializers at the first data file already holding the same
    bytes; returns the bytes the folder no longer holds."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    seen: dict[tuple[str, int], tuple[str, int, int]] = {}     # (sha256, length) -> where it lies
    freed = 0
    for graph in graphs:
        folder = graph.parent
        model = onnx.load(str(graph), load_external_data=False)
        files = set()
        moved = False
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = ExternalDataInfo(t)
            with open(folder / info.location, "rb") as f:
                f.seek(info.offset or 0)
                data = f.read(info.length) if info.length else f.read()
            key = (hashlib.sha256(data).hexdigest(), len(data))
            where = seen.setdefault(key, (info.location, info.offset or 0, len(data)))
            files.add(info.location)
            if where[0] != info.location:
                del t.external_data[:]
                for k, v in (("location", where[0]), ("offset", str(where[1])), ("length", str(where[2]))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
                moved = True
        if moved:
            onnx.save(model, str(graph))
            still = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
            for name in files - still:
                freed += (folder / name).stat().st_size
                (folder / name).unlink()
    if freed:
        log.info("the graphs share their weights on disk: %.0f MB less", freed / 1e6)
    return freed
