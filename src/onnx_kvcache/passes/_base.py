"""What every pass of the library shares: it takes an ``onnx_ir`` model, and says so."""

from __future__ import annotations

__all__ = ["InPlacePass"]

import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError


class InPlacePass(ir.passes.InPlacePass):
    """An ``onnx_ir`` in-place pass that names what it was given when it is not an ``ir.Model``."""

    def __call__(self, model_or_result: ir.Model | ir.passes.PassResult, /) -> ir.passes.PassResult:
        if not isinstance(model_or_result, (ir.Model, ir.passes.PassResult)):
            raise KvCacheError(
                f"{type(self).__name__} takes an onnx_ir.Model, got {type(model_or_result).__name__}: "
                "load one with onnx_ir.load(path) or onnx_ir.from_proto(model_proto)."
            )
        return super().__call__(model_or_result)
