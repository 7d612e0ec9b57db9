"""Rotate the KV cache of every GroupQueryAttention node: ``KvCacheRotationPass``.

Why: RoPE turns each key channel pair by an angle that grows with the position, so a slow pair's
energy moves between its two channels over the context and a scale fitted on short windows
misses where it goes; and a few channels carry outliers far above the rest, which a shared
scale must cover. An orthonormal ``H`` (:mod:`onnx_kvcache.cache.rotation`) spreads every
channel over all of them, so each stored channel holds a mix whose range changes little with
the position, without changing attention: ``(q H)(k H)^T = q k^T``.

Rules:

1. Every GroupQueryAttention node with a float cache is rewritten (a node already rotated as
   asked is left: the pass runs once); a quantized cache is refused (its scales were measured
   on unrotated values: calibrate for the rotation, then quantize), as is a node inside a
   function (inline first) or a model whose opset is too old for the prologue.
2. What the kernel did to Q and K before attending moves out of the node, with its positions
   (:mod:`onnx_kvcache.passes._gqa_prologue`): packed QKV split, q/k RMS norms, RoPE
   (com.microsoft ``RotaryEmbedding``). The node loses ``do_rotary``, its cos/sin tables,
   ``position_ids`` and norm weights; every other input and attribute is kept.
3. The query and the key are turned per head, ``Reshape(MatMul(Reshape(x, [0, 0, -1, d]), H),
   [0, 0, -1])``; with ``keys_and_values`` the value too, and the node's output turned back by
   ``H^T`` the same way. ``H`` is one initializer per head size and dtype, shared by every layer
   (``kv_cache_rotation_<d>``; its transpose ``kv_cache_rotation_<d>_t`` when it is not
   symmetric).
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
from onnx_kvcache.cache.rotation import Rotation, get_rotation, rotation_matrix, site_rotation
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._gqa_prologue import MOVED_ATTRS, MOVED_INPUTS, Prologue, Step, prologue_opset
from onnx_kvcache.passes._graph import Builder

logger = logging.getLogger(__name__)

_DOING = "rotate the cache of"


class _Matrices:
    """``H`` (and ``H^T``) initializers of one graph, one per head size and dtype."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.made: dict[tuple[int, ir.DataType, bool], ir.Value] = {}

    def get(self, size: int, dtype: ir.DataType, transposed: bool = False) -> ir.Value:
        h = rotation_matrix(size)
        if transposed and np.array_equal(h, h.T):
            transposed = False
        key = (size, dtype, transposed)
        if key not in self.made:
            array = (h.T if transposed else h).astype(dtype.numpy())
            base = f"kv_cache_rotation_{size}" + (
                "" if dtype == ir.DataType.FLOAT else f"_{dtype.name.lower()}"
            )
            name = base + ("_t" if transposed else "")
            taken = self.graph.initializers.get(name)
            if taken is not None and (
                taken.const_value is None or not np.array_equal(taken.const_value.numpy(), array)
            ):
                name = f"{name}_{len(self.graph.initializers)}"
            value = self.graph.initializers.get(name)
            if value is None:
                value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
                value.type, value.shape = ir.TensorType(dtype), ir.Shape([size, size])
                self.graph.register_initializer(value)
            self.made[key] = value
        return self.made[key]


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

    def _turn(self, x: ir.Value, h: ir.Value, like: ir.Value | None, heads: int) -> ir.Value:
        """``x`` ``[B, S, heads * d]`` turned per head by ``h``."""
        b, d = self.b, self.head
        split = b.op("Reshape", [x, b.const(np.array([0, 0, -1, d], np.int64))], dtype=self.dtype)
        turned = b.op("MatMul", [split, h], dtype=self.dtype)
        out = b.op("Reshape", [turned, b.const(np.array([0, 0, -1], np.int64))], dtype=self.dtype)
        shape = like.shape if like is not None else None
        if shape is not None and len(shape) == 3:
            out.shape = ir.Shape([shape[0], shape[1], heads * d])
        return out

    def run(self, matrices: _Matrices) -> None:
        site, b, rotation = self.site, self.b, self.rotation
        node = site.node
        original = site.input(GqaInput.QUERY)
        query, key, value = self.prologue.inputs()
        query, key, _ = self.prologue.apply(query, key)
        h = matrices.get(self.head, self.dtype)
        query = self._turn(query, h, original, site.num_heads)
        key = self._turn(key, h, original, site.kv_num_heads)
        if rotation.values:
            value = self._turn(value, h, original, site.kv_num_heads)
        inputs = list(node.inputs)
        inputs[GqaInput.QUERY], inputs[GqaInput.KEY], inputs[GqaInput.VALUE] = query, key, value
        for slot in MOVED_INPUTS:
            if slot < len(inputs):
                inputs[slot] = None
        while inputs and inputs[-1] is None:
            inputs.pop()
        attrs = {name: attr for name, attr in node.attributes.items() if name not in MOVED_ATTRS}
        outputs = list(b.ops(node.op_type, inputs, len(node.outputs), node.domain, **attrs))
        if rotation.values:
            back = matrices.get(self.head, self.dtype, transposed=True)
            outputs[GqaOutput.OUTPUT] = self._turn(
                outputs[GqaOutput.OUTPUT], back, node.outputs[0], site.num_heads
            )
        assert node.graph is not None
        ir.convenience.replace_nodes_and_values(
            node.graph, node, [node], b.nodes, list(node.outputs), outputs
        )


class KvCacheRotationPass(InPlacePass):
    """Turn every GroupQueryAttention cache by ``H``; see the module.

    Args:
        rotation: A row of :data:`~onnx_kvcache.cache.rotation.ROTATIONS`: ``keys_and_values``
            (default) or ``keys``; ``none`` leaves the model as it is.
    """

    def __init__(self, rotation: str | Rotation = "keys_and_values") -> None:
        super().__init__()
        self.rotation = get_rotation(rotation)

    def requires(self, model: ir.Model) -> None:
        """Every refusal is raised here, before the model changes (the rules)."""
        with preconditions():
            self._check(model)

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
            if have == self.rotation:
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

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewrites = self._check(model)
        matrices = _Matrices(model.graph)
        for r in rewrites:
            r.run(matrices)
        if rewrites:
            model.opset_imports.setdefault("com.microsoft", 1)
        logger.info(
            "Rotation (%s): rewrote %d GroupQueryAttention node(s).", self.rotation.name, len(rewrites)
        )
        return ir.passes.PassResult(model, modified=bool(rewrites))
