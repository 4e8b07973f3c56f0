"""Graphs built from the same weights keep one copy of them on disk, and read the same numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twophase.exporters.shared_weights import share_weights

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _graph(path: Path, weights: dict[str, np.ndarray]) -> None:
    from onnx import TensorProto, helper, numpy_helper

    names = list(weights)
    nodes = [helper.make_node("MatMul", ["x", names[0]], ["h"]), helper.make_node("MatMul", ["h", names[1]], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, n) for n, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_later_graphs_weights_point_into_the_earlier_file(tmp_path):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    _graph(tmp_path / "first.onnx", {"w1": a, "w2": b})
    _graph(tmp_path / "second.onnx", {"u": b, "v": a})          # the same tensors, other names and order
    _graph(tmp_path / "third.onnx", {"w1": a, "w3": c})         # one shared, one its own
    x = rng.standard_normal((1, 64)).astype(np.float32)
    want = {n: _run(tmp_path / n, x) for n in ("first.onnx", "second.onnx", "third.onnx")}
    freed = share_weights([tmp_path / n for n in ("first.onnx", "second.onnx", "third.onnx")])
    assert not (tmp_path / "second.onnx.data").exists() and (tmp_path / "third.onnx.data").exists()
    assert freed == 2 * 64 * 64 * 4
    for n, y in want.items():
        assert np.array_equal(_run(tmp_path / n, x), y), n
