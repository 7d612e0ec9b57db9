"""Rotate the KV cache of every GroupQueryAttention node: ``KvCacheRotationPass``.

Why: RoPE turns each key channel pair by an angle that grows with the position, so a slow pair's
energy moves between its two channels over the context and a scale fitted on short windows
misses where it goes; and a few channels carry outliers far above the rest, which a shared
scale must cover. An orthonormal ``H`` (:mod:`onnx_kvcache.cache.rotation`) spreads every
channel over all of them, so each stored channel holds a mix whose range changes little with
the position, without changing attention: ``(q H)(k H)^T = q k^T``.

Rules:

1. Every GroupQueryAttention node with a float cache is rewritten (a node already rotated as
   asked, by the same ``H``, is left: the pass runs once; by another ``H`` it is refused); a
   quantized cache is refused (its scales were measured on unrotated values: calibrate for the
   rotation, then quantize), as is a node inside a function (inline first) or a model whose
   opset is too old for the prologue.
2. What the kernel did to Q and K before attending moves out of the node, with its positions
   (:mod:`onnx_kvcache.passes._gqa_prologue`): packed QKV split, q/k RMS norms, RoPE
   (com.microsoft ``RotaryEmbedding``). The node loses ``do_rotary``, its cos/sin tables,
   ``position_ids`` and norm weights; every other input and attribute is kept.
3. The query and the key heads go side by side (``[B, S, (N + KV) * d]``: the packed QKV split
   in two, or the two concatenated), through one RotaryEmbedding (every head at the same
   positions), and are turned per head, ``Reshape(MatMul(Reshape(x, [0, 0, N + KV, d]), H),
   [0, 0, (N + KV) * d])``, then packed with the value; with ``keys_and_values`` the packed QKV is
   turned at once instead, and the node's output turned back by ``H^T`` the same way. The node
   takes the packed QKV (a few nodes a layer: a rotated decode step costs little more than an
   unrotated one, ``benchmarks/rotation_speed.py``). ``H`` is the pass's row of
   :data:`~onnx_kvcache.cache.rotation.MATRICES` (``hadamard`` unless named), one initializer per
   head size and dtype, shared by every layer (``kv_cache_rotation_<d>``; its transpose
   ``kv_cache_rotation_<d>_t`` when it is not symmetric), as are the shapes.
4. The presents hold the rotated K (and V): whatever reads them (onnxruntime-genai, the runner)
   reads them as caches, and quantizing them after this pass stores the rotated values.

PagedAttention nodes are refused: their kernels take RoPE and the cache layout otherwise, and
no rewrite of them is proven here.
"""

from __future__ import annotations

__all__ = ["KvCacheRotationPass"]

import logging

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import GqaInput, GqaOutput
from onnx_kvcache.cache.prompt_path import unwrap
from onnx_kvcache.cache.rotation import (
    Rotation,
    RotationMatrix,
    rotation_matrix,
    site_matrix,
    site_rotation,
)
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.model_io.reading import tensor_values
from onnx_kvcache.passes._base import RotationPass
from onnx_kvcache.passes._gqa_prologue import MOVED_ATTRS, MOVED_INPUTS, Prologue, Step, prologue_opset
from onnx_kvcache.passes._graph import Builder

logger = logging.getLogger(__name__)

_DOING = "rotate the cache of"


class _Constants:
    """The initializers every rewritten node of one graph shares: ``H`` (and ``H^T``) per head
    size and dtype, and the int64 shapes and split sizes."""

    def __init__(self, graph: ir.Graph, matrix: RotationMatrix) -> None:
        self.graph, self.rotation_matrix = graph, matrix
        self.made: dict[tuple, ir.Value] = {}

    def _initializer(self, key: tuple, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
        if key not in self.made:
            taken = self.graph.initializers.get(name)
            if taken is not None and (
                taken.const_value is None or not np.array_equal(tensor_values(taken.const_value), array)
            ):
                name = f"{name}_{len(self.graph.initializers)}"
            value = self.graph.initializers.get(name)
            if value is None:
                value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
                value.type, value.shape = ir.TensorType(dtype), ir.Shape(array.shape)
                self.graph.register_initializer(value)
            self.made[key] = value
        return self.made[key]

    def matrix(self, size: int, dtype: ir.DataType, transposed: bool = False) -> ir.Value:
        h = rotation_matrix(size, self.rotation_matrix)
        transposed = transposed and not np.array_equal(h, h.T)
        suffix = ("" if dtype == ir.DataType.FLOAT else f"_{dtype.name.lower()}") + (
            "_t" if transposed else ""
        )
        array = (h.T if transposed else h).astype(dtype.numpy())
        return self._initializer(
            ("H", size, dtype, transposed), f"kv_cache_rotation_{size}{suffix}", array, dtype
        )

    def ints(self, values: list[int]) -> ir.Value:
        name = "kv_cache_rotation_shape_" + "_".join(str(v).replace("-", "m") for v in values)
        return self._initializer(("ints", *values), name, np.array(values, np.int64), ir.DataType.INT64)

    def turned(
        self, b: Builder, x: ir.Value, h: ir.Value, heads: int, size: int, dtype: ir.DataType
    ) -> ir.Value:
        """``x`` ``[B, S, heads * size]`` turned per head by ``h``: ``Reshape(MatMul(Reshape(x,
        [0, 0, heads, size]), h), [0, 0, heads * size])``, its nodes on ``b``'s tape."""
        split = b.op("Reshape", [x, self.ints([0, 0, heads, size])], dtype=dtype)
        turned = b.op("MatMul", [split, h], dtype=dtype)
        return b.op("Reshape", [turned, self.ints([0, 0, heads * size])], dtype=dtype)


class _Rewrite:
    """The rotated replacement of one node: checks at construction, builds in :meth:`run`."""

    def __init__(self, site: CacheSite, rotation: Rotation, steps: dict[tuple, Step]) -> None:
        self.site, self.rotation = site, rotation
        dtype = site.query_dtype
        if dtype is None:
            raise KvCachePreconditionError(
                f"Cannot {_DOING} GroupQueryAttention node {site.name}: its query has no known dtype."
            )
        self.dtype = dtype
        self.b = Builder((site.node.name or f"gqa{site.layer_id}") + "/rotation")
        self.prologue = Prologue(site, self.b, dtype, steps, _DOING)
        self.head = self.prologue.head

    def _typed(self, x: ir.Value, heads: int) -> ir.Value:
        x.dtype = self.dtype
        shape = self.site.input(GqaInput.QUERY).shape  # type: ignore[union-attr]
        if shape is not None and len(shape) == 3:
            x.shape = ir.Shape([shape[0], shape[1], heads * self.head])
        return x

    def _turn(self, x: ir.Value, h: ir.Value, heads: int, k: _Constants) -> ir.Value:
        """``x`` ``[B, S, heads * d]`` turned per head by ``h``."""
        return self._typed(k.turned(self.b, x, h, heads, self.head, self.dtype), heads)

    def _query_and_key(self, k: _Constants) -> tuple[ir.Value, ir.Value]:
        """The query and key heads side by side ``[B, S, (N + KV) * d]``, after the node's norms
        and RoPE (one RotaryEmbedding: the same positions), and the value."""
        site, b, prologue = self.site, self.b, self.prologue
        n, kv, d = site.num_heads, site.kv_num_heads, self.head
        if site.packed_qkv and not prologue.has_norms:
            sizes = k.ints([(n + kv) * d, kv * d])
            qk, value = b.ops("Split", [site.input(GqaInput.QUERY), sizes], 2, axis=-1)
            value = self._typed(value, kv)
        else:  # the node's own value, or the packed QKV's third part
            query, key, value = prologue.inputs()
            query, key = prologue.norms(query, key)
            qk = b.op("Concat", [query, key], axis=-1)
        qk = self._typed(qk, n + kv)
        if prologue.rotary is not None:
            qk = self._typed(prologue.rope(qk, n + kv, prologue.step(qk)), n + kv)
        return qk, value

    def run(self, k: _Constants) -> None:
        site, b, rotation = self.site, self.b, self.rotation
        node = site.node
        n, kv = site.num_heads, site.kv_num_heads
        h = k.matrix(self.head, self.dtype)
        qk, value = self._query_and_key(k)
        if rotation.values:  # the packed QKV turned at once
            packed = self._turn(
                self._typed(b.op("Concat", [qk, value], axis=-1), n + 2 * kv), h, n + 2 * kv, k
            )
        else:
            packed = self._typed(b.op("Concat", [self._turn(qk, h, n + kv, k), value], axis=-1), n + 2 * kv)
        inputs: list[ir.Value | None] = list(node.inputs)
        inputs[GqaInput.QUERY], inputs[GqaInput.KEY], inputs[GqaInput.VALUE] = packed, None, None
        for slot in MOVED_INPUTS:
            if slot < len(inputs):
                inputs[slot] = None
        while inputs and inputs[-1] is None:
            inputs.pop()
        attrs = {name: attr for name, attr in node.attributes.items() if name not in MOVED_ATTRS}
        outputs = list(b.ops(node.op_type, inputs, len(node.outputs), node.domain, **attrs))
        if rotation.values:
            back = k.matrix(self.head, self.dtype, transposed=True)
            outputs[GqaOutput.OUTPUT] = self._turn(outputs[GqaOutput.OUTPUT], back, n, k)
        assert node.graph is not None
        ir.convenience.replace_nodes_and_values(
            node.graph, node, [node], b.nodes, list(node.outputs), outputs
        )


class KvCacheRotationPass(RotationPass):
    """Turn every GroupQueryAttention cache by ``H``; see the module (arguments: the base's)."""

    def _check(self, model: ir.Model) -> list[_Rewrite]:
        """The rewrites of ``model``'s nodes, every one checked; nothing changes."""
        if not self.rotation.rotates:
            return []
        rewrites = []
        steps: dict[tuple, Step] = {}
        for site in find_attention_sites(model):
            if site.op.op_type != "GroupQueryAttention":
                raise KvCachePreconditionError(
                    f"Cannot rotate the cache of {site.label}: rotation is proven for GroupQueryAttention "
                    "only; convert this model with rotation none."
                )
            if site.function is not None:
                raise KvCachePreconditionError(
                    f"Cannot {_DOING} {site.label}: inline the model's functions first "
                    "(onnx_ir.passes.common.InlinePass)."
                )
            have = site_rotation(site)
            if have == self.rotation and self._same_matrix(site):
                continue
            if have.rotates:
                raise KvCachePreconditionError(
                    f"{site.label} is already rotated ({have.name}); {self.rotation.name} was asked. "
                    "Rotate the original model."
                )
            if site.cache_format is not None:
                raise KvCachePreconditionError(
                    f"Cannot {_DOING} {site.label}: its cache is already {site.cache_format.name}, "
                    "with scales measured on unrotated values. Rotate the float model, then quantize "
                    "it with scales calibrated for the rotation."
                )
            need, why = prologue_opset(site)
            if model.opset_imports.get("", 1) < need:
                raise KvCachePreconditionError(
                    f"Rotating {site.name} needs opset >= {need} ({why}); the model imports opset "
                    f"{model.opset_imports.get('', 1)}. Convert the model to a newer opset first "
                    "(onnxscript.version_converter)."
                )
            rewrites.append(_Rewrite(site, self.rotation, steps))
        return rewrites

    def _same_matrix(self, site: CacheSite) -> bool:
        """Whether ``site``'s node, rotated as asked, is turned by the pass's ``H`` (refused when
        by another: its caches and scales are for that one)."""
        have = site_matrix(site)
        if have is None or have.same(self.matrix, site.head_size()):
            return True
        raise KvCachePreconditionError(
            f"{site.label} is already rotated by H = {have.name}; {self.matrix.name} was asked. Rotate "
            f"the original model, or rotate by {have.name}."
        )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        unwrap(model)  # a wrapped node is rewritten as itself (cache.prompt_path)
        rewrites = self._check(model)
        constants = _Constants(model.graph, self.matrix)
        for r in rewrites:
            r.run(constants)
        if rewrites:
            model.opset_imports.setdefault("com.microsoft", 1)
        logger.info(
            "Rotation (%s): rewrote %d GroupQueryAttention node(s).", self.rotation.name, len(rewrites)
        )
        return ir.passes.PassResult(model, modified=bool(rewrites))
