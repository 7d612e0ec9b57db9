"""What every pass of the library shares: it takes an ``onnx_ir`` model, says so, and
reports a refusal as the library's own error; what the two rotation passes share."""

from __future__ import annotations

__all__ = ["InPlacePass", "RotationPass", "preconditions"]

import contextlib
from collections.abc import Iterator

import onnx_ir as ir

from onnx_kvcache.cache.rotation import DEFAULT_MATRIX, Rotation, RotationMatrix, get_matrix, get_rotation
from onnx_kvcache.errors import KvCacheError, KvCachePreconditionError, KvCacheTypeError


class InPlacePass(ir.passes.InPlacePass):
    """An ``onnx_ir`` in-place pass that names what it was given when it is not an ``ir.Model``."""

    def __call__(self, model_or_result: ir.Model | ir.passes.PassResult, /) -> ir.passes.PassResult:
        if not isinstance(model_or_result, (ir.Model, ir.passes.PassResult)):
            raise KvCacheTypeError(
                f"{type(self).__name__} takes an onnx_ir.Model, got {type(model_or_result).__name__}: "
                "load one with onnx_ir.load(path) or onnx_ir.from_proto(model_proto)."
            )
        return super().__call__(model_or_result)


@contextlib.contextmanager
def preconditions() -> Iterator[None]:
    """Raise a :class:`KvCacheError` found while checking (in ``requires()``) as a
    :class:`KvCachePreconditionError`, with its message and traceback: one error, not two.

    onnx-ir passes a ``PreconditionError`` through and hides any other exception of
    ``requires()`` behind its own, so a user sees our message and type.
    """
    try:
        yield
    except KvCachePreconditionError:
        raise
    except KvCacheError as e:
        raise KvCachePreconditionError(str(e)).with_traceback(e.__traceback__) from None


class RotationPass(InPlacePass):
    """A pass turning caches by ``H``: its rotation and matrix, every refusal raised by
    :meth:`_check` before the model changes.

    Args:
        rotation: A row of :data:`~onnx_kvcache.cache.rotation.ROTATIONS`: ``keys_and_values``
            (default) or ``keys``; ``none`` leaves the model as it is.
        matrix: A row of :data:`~onnx_kvcache.cache.rotation.MATRICES`: ``hadamard`` (default)
            or ``walsh_dct`` (the ``H`` of scales calibrated before ``hadamard``).
    """

    def __init__(
        self, rotation: str | Rotation = "keys_and_values", matrix: str | RotationMatrix = DEFAULT_MATRIX
    ) -> None:
        super().__init__()
        self.rotation = get_rotation(rotation)
        self.matrix = get_matrix(matrix)

    def requires(self, model: ir.Model) -> None:
        """Every refusal is raised here, before the model changes (the rules)."""
        with preconditions():
            self._check(model)

    def _check(self, model: ir.Model) -> list:
        raise NotImplementedError
