"""What every graph backend (ONNX Runtime, TensorRT, IREE) shares: the step graph's signature,
spelled once, and the runtime helpers that feed a batch to a graph and write back its K/V.

Exporters derive their inputs, dynamic dimensions and optimisation profiles from
``signature``; backends build inputs with ``inputs``. Neither imports the other for these.
"""
