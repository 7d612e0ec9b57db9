"""What onnxruntime-genai 0.18's model builder writes for a quantized paged model, restated.

The builder cannot run here (it imports torch and transformers), so its code path is
restated from its source (``onnxruntime_genai/models/builders/base.py``):

- ``make_kv_cache_init``: cache element type FLOAT8E4M3FN (fp8), INT8 (int8) or UINT8 (int4)
  for ``past_key_values.*`` and ``present.*``; int4's last dimension ``(head_size + 1) // 2``;
- ``make_kv_cache_scale_initializers``: float32 initializers ``model.layers.{i}.attn.k_scale``
  / ``v_scale``, the file's value times ``file_qmax / target_qmax`` (in float64), shaped
  ``(1,)`` per tensor and ``(kv_num_heads, 1, head_size)`` per channel on the paged path;
- ``make_paged_attention`` + ``get_attention_op_attributes``: scales at inputs 14/15,
  ``k_quant_type``/``v_quant_type`` = the quant mode, ``k_cache_dtype``/``v_cache_dtype`` =
  ``"int4"`` only when the bit width is 4, never ``kv_cache_bit_width``.

Applied to a float paged model, this gives the graph the builder would have written for the
same weights; :func:`structure` summarizes a model for comparison, scale names aside.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx_ir as ir

QMAX = {"int8": 128.0, "int4": 8.0, "fp8": 448.0}  # KV_CACHE_CALIBRATION_QMAX
CACHE_TYPE = {"fp8": ir.DataType.FLOAT8E4M3FN, "int8": ir.DataType.INT8, "int4": ir.DataType.UINT8}


def builder_quantized_paged(
    model: ir.Model, fmt: str, granularity: str, scale_file: pathlib.Path
) -> ir.Model:
    """``model`` (a float paged decoder, changed in place) as the builder would have written it."""
    data = json.loads(pathlib.Path(scale_file).read_text())
    factor = data["qmax"] / QMAX[fmt] if "qmax" in data else 1.0
    mode = {"per_tensor": "PER_TENSOR", "per_channel": "PER_CHANNEL"}[granularity]
    bit_width = 4 if fmt == "int4" else 8
    layer_ids = data.get("layer_ids", list(range(len(data["scales"]["k_scales"]))))
    for node in model.graph:
        if node.op_type != "PagedAttention":
            continue
        layer = int(node.name.split("layers.")[1].split("/")[0])
        kv = node.attributes["kv_num_heads"].as_int()
        head = node.inputs[3].shape[3]
        shape = (kv, 1, head) if granularity == "per_channel" else (-1,)
        index = layer_ids.index(layer)
        scale_values = []
        for kind in ("k", "v"):
            raw = np.asarray(data["scales"][f"{kind}_scales"][index], np.float32).reshape(-1)
            scale = (raw.astype(np.float64) * factor).astype(np.float32).reshape(shape)
            name = f"model.layers.{layer}.attn.{kind}_scale"
            value = ir.Value(name=name, const_value=ir.tensor(scale, name=name))
            value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape(scale.shape)
            model.graph.register_initializer(value)
            scale_values.append(value)
        if len(node.inputs) < 17:
            node.resize_inputs(17)
        node.replace_input_with(14, scale_values[0])
        node.replace_input_with(15, scale_values[1])
        for name in ("k_quant_type", "v_quant_type"):
            node.attributes[name] = ir.AttrString(name, mode)
        if bit_width == 4:
            for name in ("k_cache_dtype", "v_cache_dtype"):
                node.attributes[name] = ir.AttrString(name, "int4")
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.name and (value.name.startswith("past_key_values.") or value.name.startswith("present.")):
            dims = list(value.shape)
            if fmt == "int4":
                dims[-1] = (dims[-1] + 1) // 2
            value.type = ir.TensorType(CACHE_TYPE[fmt])
            value.shape = ir.Shape(dims)
    return model


def _dims(shape: ir.Shape | None) -> tuple:
    return () if shape is None else tuple(d if isinstance(d, int) else str(d) for d in shape)


def structure(model: ir.Model) -> dict:
    """Per attention node: attributes and every input (scales by dtype, shape and values);
    the graph's inputs and outputs by name, dtype and shape."""
    nodes = {}
    for node in model.graph:
        if node.op_type not in ("PagedAttention", "GroupQueryAttention"):
            continue
        inputs = []
        for slot, value in enumerate(node.inputs):
            if value is not None and value.const_value is not None and value.dtype == ir.DataType.FLOAT:
                array = value.const_value.numpy()
                inputs.append((slot, "float32", array.shape, array.tobytes()))
            else:
                inputs.append((slot, None if value is None else value.name))
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        nodes[node.name] = {"inputs": inputs, "attributes": attrs}
    io = [(v.name, v.dtype, _dims(v.shape)) for v in [*model.graph.inputs, *model.graph.outputs]]
    return {"nodes": nodes, "io": io}
