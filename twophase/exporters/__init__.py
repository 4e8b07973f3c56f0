"""Offline compilation paths (ONNX, TensorRT, MLIR); artefacts are cached on disk."""
