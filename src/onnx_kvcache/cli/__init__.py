"""The ``onnx-kvcache`` command (standard library only here: the command parses before heavy imports).

``onnx_kvcache.cli.main``, the 0.x module's one public name, still works for one release
(it is :func:`onnx_kvcache.cli.commands.main`, with a ``DeprecationWarning``).
"""

from __future__ import annotations


def __getattr__(name: str) -> object:
    if name == "main":
        from onnx_kvcache._moved import announce

        announce("onnx_kvcache.cli.main", "onnx_kvcache.cli.commands.main", stacklevel=2)
        from onnx_kvcache.cli.commands import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
