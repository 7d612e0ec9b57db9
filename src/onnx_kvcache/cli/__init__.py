"""The ``onnx-kvcache`` command: the executable (``_entry``), the parser and dispatcher (``commands``)
and one module per command. This ``__init__`` imports nothing: the console script runs it before
the entry point's first line."""
