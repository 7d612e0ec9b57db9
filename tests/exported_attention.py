"""A decoder whose attention is written out the way exporters write it (no GQA node).

One layer: projections, per-head reshape/transpose, com.microsoft::RotaryEmbedding,
concatenation with the past cache, KV heads expanded to the query heads, the causal +
padding mask idiom, MatMul/Softmax/MatMul attention. The present's length is declared
``past + seq`` (the past's plus the new tokens'), so ``DecomposedAttentionFusionPass`` proves it
and turns it into a GroupQueryAttention node, which is what ``fuse_attention`` relies on.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

B, S, P, T = "batch", "seq", "past", "past + seq"


def exported_decoder(
    *, heads: int = 4, kv_heads: int = 2, head: int = 16, vocab: int = 64, seed: int = 0
) -> ir.Model:
    rng = np.random.default_rng(seed)
    hidden, kv_dim, group = heads * head, kv_heads * head, heads // kv_heads
    f32 = ir.DataType.FLOAT
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 18, "com.microsoft": 1}, name="exported")
    tape = ir.tape.Tape(graph)

    def const(name, array):
        return tape.initializer(ir.tensor(np.asarray(array), name=name))

    def op(op_type, inputs, shape=None, dtype=None, **attrs):
        value = tape.op(
            op_type, inputs, attrs or None, domain="com.microsoft" if op_type == "RotaryEmbedding" else ""
        )
        if shape is not None:
            value.shape, value.dtype = ir.Shape(shape), dtype or f32
        return value

    input_ids = ir.val("input_ids", ir.DataType.INT64, [B, S])
    mask = ir.val("attention_mask", ir.DataType.INT64, [B, T])
    position_ids = ir.val("position_ids", ir.DataType.INT64, [B, S])
    past_k = ir.val("past_key_values.0.key", f32, [B, kv_heads, P, head])
    past_v = ir.val("past_key_values.0.value", f32, [B, kv_heads, P, head])
    graph.inputs.extend([input_ids, mask, position_ids, past_k, past_v])

    angles = np.outer(np.arange(256), 1.0 / (10000 ** (np.arange(0, head, 2) / head)))
    cos = const("cos_cache", np.cos(angles).astype(np.float32))
    sin = const("sin_cache", np.sin(angles).astype(np.float32))
    embed = const("embed", rng.standard_normal((vocab, hidden)).astype(np.float32))
    x = op("Gather", [embed, input_ids], [B, S, hidden])
    weights = {
        n: const(f"w{n}", (rng.standard_normal((hidden, d)) / np.sqrt(hidden)).astype(np.float32))
        for n, d in (("q", hidden), ("k", kv_dim), ("v", kv_dim), ("o", hidden))
    }
    q = op("MatMul", [x, weights["q"]], [B, S, hidden])
    k = op("MatMul", [x, weights["k"]], [B, S, kv_dim])
    v = op("MatMul", [x, weights["v"]], [B, S, kv_dim])

    q4 = op("Reshape", [q, const("shape_q", np.array([0, 0, heads, head], np.int64))], [B, S, heads, head])
    q4 = op("Transpose", [q4], [B, heads, S, head], perm=[0, 2, 1, 3])
    q4 = op("RotaryEmbedding", [q4, position_ids, cos, sin], [B, heads, S, head])
    k4 = op(
        "Reshape", [k, const("shape_k", np.array([0, 0, kv_heads, head], np.int64))], [B, S, kv_heads, head]
    )
    k4 = op("Transpose", [k4], [B, kv_heads, S, head], perm=[0, 2, 1, 3])
    k4 = op("RotaryEmbedding", [k4, position_ids, cos, sin], [B, kv_heads, S, head])
    v4 = op(
        "Reshape", [v, const("shape_v", np.array([0, 0, kv_heads, head], np.int64))], [B, S, kv_heads, head]
    )
    v4 = op("Transpose", [v4], [B, kv_heads, S, head], perm=[0, 2, 1, 3])
    present_k = op("Concat", [past_k, k4], [B, kv_heads, T, head], axis=-2)
    present_v = op("Concat", [past_v, v4], [B, kv_heads, T, head], axis=-2)
    present_k.name, present_v.name = "present.0.key", "present.0.value"

    batch = op("Shape", [input_ids], [1], ir.DataType.INT64, start=0, end=1)
    total = op("Shape", [present_k], [1], ir.DataType.INT64, start=2, end=3)
    expand_shape = op(
        "Concat",
        [
            batch,
            const("hkv_g", np.array([kv_heads, group], np.int64)),
            total,
            const("dh", np.array([head], np.int64)),
        ],
        [5],
        ir.DataType.INT64,
        axis=0,
    )
    full_shape = op(
        "Concat",
        [batch, const("h", np.array([heads], np.int64)), total, const("dh2", np.array([head], np.int64))],
        [4],
        ir.DataType.INT64,
        axis=0,
    )
    axis2 = const("axis2", np.array([2], np.int64))

    def expand_heads(cache):
        grown = op(
            "Expand",
            [op("Unsqueeze", [cache, axis2], [B, kv_heads, 1, T, head]), expand_shape],
            [B, kv_heads, group, T, head],
        )
        return op("Reshape", [grown, full_shape], [B, heads, T, head])

    keys, values = expand_heads(present_k), expand_heads(present_v)

    # The causal + padding mask, as exporters write it.
    min_val = const("min_val", np.array(np.finfo(np.float32).min, np.float32))
    seq_len = op("Shape", [input_ids], [1], ir.DataType.INT64, start=1, end=2)
    seq_0d = op("Squeeze", [seq_len], [], ir.DataType.INT64)
    past_len = op("Shape", [past_k], [1], ir.DataType.INT64, start=2, end=3)
    past_0d = op("Squeeze", [past_len], [], ir.DataType.INT64)
    total_0d = op("Add", [past_0d, seq_0d], [], ir.DataType.INT64)
    total_1d = op("Reshape", [total_0d, const("minus1", np.array([-1], np.int64))], [1], ir.DataType.INT64)
    current = op("Range", [past_0d, total_0d, const("one", np.array(1, np.int64))], [S], ir.DataType.INT64)
    mask_shape = op("Concat", [seq_len, total_1d], [2], ir.DataType.INT64, axis=0)
    all_min = op("Expand", [min_val, mask_shape], [S, T])
    row = op(
        "Range",
        [const("zero", np.array(0, np.int64)), total_0d, const("one_b", np.array(1, np.int64))],
        [T],
        ir.DataType.INT64,
    )
    column = op("Reshape", [current, const("col", np.array([-1, 1], np.int64))], [S, 1], ir.DataType.INT64)
    future = op("Greater", [row, column], [S, T], ir.DataType.BOOL)
    causal = op("Mul", [all_min, op("Cast", [future], [S, T], to=ir.DataType.FLOAT)], [S, T])
    causal = op("Unsqueeze", [causal, const("axes01", np.array([0, 1], np.int64))], [1, 1, S, T])
    shape_b111 = op(
        "Concat", [batch, const("ones3", np.array([1, 1, 1], np.int64))], [4], ir.DataType.INT64, axis=0
    )
    causal = op("Expand", [causal, shape_b111], [B, 1, S, T])
    pad = op(
        "Unsqueeze", [mask, const("axes12", np.array([1, 2], np.int64))], [B, 1, 1, T], ir.DataType.INT64
    )
    pad = op("Cast", [pad], [B, 1, 1, T], to=ir.DataType.FLOAT)
    both = op("Add", [causal, pad], [B, 1, S, T])
    is_zero = op("Equal", [both, const("zero_f", np.array(0.0, np.float32))], [B, 1, S, T], ir.DataType.BOOL)
    attn_mask = op("Where", [is_zero, min_val, causal], [B, 1, S, T])

    scores = op(
        "MatMul", [q4, op("Transpose", [keys], [B, heads, head, T], perm=[0, 1, 3, 2])], [B, heads, S, T]
    )
    scores = op("Mul", [scores, const("scale", np.array(1 / np.sqrt(head), np.float32))], [B, heads, S, T])
    probs = op("Softmax", [op("Add", [scores, attn_mask], [B, heads, S, T])], [B, heads, S, T], axis=-1)
    attn = op("MatMul", [probs, values], [B, heads, S, head])
    attn = op("Transpose", [attn], [B, S, heads, head], perm=[0, 2, 1, 3])
    attn = op("Reshape", [attn, const("shape_o", np.array([0, 0, -1], np.int64))], [B, S, hidden])
    out = op("MatMul", [attn, weights["o"]], [B, S, hidden])
    logits = op(
        "MatMul",
        [out, const("lm_head", rng.standard_normal((hidden, vocab)).astype(np.float32))],
        [B, S, vocab],
    )
    logits.name = "logits"
    graph.outputs.extend([logits, present_k, present_v])
    return ir.Model(graph, ir_version=10)
