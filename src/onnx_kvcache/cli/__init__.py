"""The ``onnx-kvcache`` command (standard library only here: the command parses before heavy imports)."""
