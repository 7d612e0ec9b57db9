"""Run an exported decoder and its fused form side by side, as transformers feeds them."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_kvcache.model_io._sessions import create_session

STEPS = 3


def count(model: ir.Model, op_type: str) -> int:
    return sum(1 for n in model.graph if n.op_type == op_type)


def vocab_of(model: ir.Model) -> int:
    return next(v for v in model.graph.outputs if v.name == "logits").shape[-1]


PROMPTS = {  # attention masks of a 7-token prompt
    "single": np.ones((1, 7), np.int64),
    "right_padded": np.array([[1] * 7, [1] * 4 + [0] * 3]),
    "left_padded": np.array([[1] * 7, [0] * 3 + [1] * 4]),
    "middle_padded": np.array([[1] * 7, [1, 1, 0, 0, 1, 1, 1]]),
    "empty_row": np.array([[1] * 7, [0] * 7]),  # a free slot: its first token comes with decode
}


def window_rows(model: ir.Model) -> dict[str, int]:
    """The past inputs of window-sized caches (``sliding_window_cache=1``) and their window:
    such a cache starts as that many zero rows (onnxruntime-genai allocates it so)."""
    rows = {}
    for node in model.graph:
        attrs = node.attributes
        if (
            node.op_type == "GroupQueryAttention"
            and attrs.get("sliding_window_cache", ir.AttrInt64("", 0)).value
        ):
            for value in node.inputs[3:5]:
                rows[value.name] = attrs["local_window_size"].as_int()
    return rows


def generate(
    model: ir.Model, mask: np.ndarray, *, steps: int = STEPS, seed: int = 0, cache_columns: bool = False
) -> list:
    """Prefill then ``steps`` decode steps as transformers feeds them (seeded tokens): each
    present fed back as the next past, the attention mask of every token so far. With
    ``cache_columns`` the model gets the mask's last ``past + seq`` columns instead (``past``: the
    rows of its first cache), what an export whose caches keep only their last tokens (a rolling
    window cache) reads as its own; for full-length caches that is the whole mask.

    Returns ``(attention_mask, {output name: array})`` per step (the whole mask).
    """
    session = create_session(model)
    inputs = {i.name for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    caches = [v for v in model.graph.inputs if v.name.startswith("past_key_values")]
    windows = window_rows(model)
    rng = np.random.default_rng(seed)
    batch = mask.shape[0]
    feeds = {"input_ids": rng.integers(0, vocab_of(model), mask.shape), "attention_mask": mask}
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    for value in caches:
        rows = windows.get(value.name, 0)
        feeds[value.name] = np.zeros((batch, value.shape[1], rows, value.shape[3]), value.dtype.numpy())
    history = []
    for _ in range(steps + 1):
        if "position_ids" in inputs:
            feeds["position_ids"] = positions
        whole = feeds["attention_mask"]
        if cache_columns and caches:
            columns = feeds[caches[0].name].shape[2] + feeds["input_ids"].shape[1]
            feeds["attention_mask"] = whole[:, -columns:]
        result = dict(zip(outputs, session.run(None, feeds)))
        feeds["attention_mask"] = whole
        history.append((feeds["attention_mask"], result))
        positions = feeds["attention_mask"].sum(axis=1, keepdims=True)
        feeds = {
            "input_ids": rng.integers(0, vocab_of(model), (batch, 1)),
            "attention_mask": np.concatenate([feeds["attention_mask"], np.ones((batch, 1), np.int64)], 1),
        } | {v.name: result[v.name.replace("past_key_values", "present")] for v in caches}
    return history


def max_differences(want: list, got: list) -> dict[str, float]:
    """Largest |difference| per output kind, at the positions a row's mask marks valid.

    The export's cache keeps padding positions in place; GQA's holds a row's valid
    tokens compacted at its start: cache column ``c`` of the export is column
    ``rank of c among the row's valid columns`` of the fused model. A cache that keeps only a
    row's last tokens (a rolling window cache: the export's last ``n`` positions, a window-sized
    GQA cache its last ``min(tokens, rows)`` valid tokens at its start) is compared on the row's
    last valid tokens that both hold.
    """
    worst = {"logits": 0.0, "present": 0.0, "attn_weights": 0.0}
    for (mask, a), (_, b) in zip(want, got):
        queries = a["logits"].shape[1]
        rows = mask[:, -queries:].astype(bool)
        diff = _distance(a["logits"], b["logits"])
        worst["logits"] = max(worst["logits"], float(diff[rows].max(initial=0.0)))
        for name in a:
            kind = name.split(".")[0]
            if kind not in ("present", "attn_weights"):
                continue
            for r, valid in enumerate(mask.astype(bool)):
                x, y = np.asarray(a[name][r], np.float32), np.asarray(b[name][r], np.float32)
                if kind == "present":  # [kv_heads, total, head]
                    tail = valid[-x.shape[1] :] if x.shape[1] < len(valid) else valid
                    held = min(int(valid.sum()), y.shape[1])  # the fused cache's tokens, compacted
                    both = min(int(tail.sum()), held)  # the row's last tokens both hold
                    x = x[:, tail][:, x[:, tail].shape[1] - both :]
                    y = y[:, held - both : held]
                else:  # [heads, seq, total]: valid query rows only
                    x, y = x[:, rows[r]][..., valid], y[:, rows[r]][..., : valid.sum()]
                worst[kind] = max(worst[kind], float(_distance(x, y).max(initial=0.0)))
    return worst


def _distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, infinite where either side is not finite (a NaN is never "close")."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    diff = np.abs(a - b)
    diff[~(np.isfinite(a) & np.isfinite(b))] = np.inf
    return diff
