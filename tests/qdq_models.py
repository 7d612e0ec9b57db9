"""Run a decoder whose caches a storage-quantized conversion keeps (static buffers, MLA exports)
over a prompt and a few decode steps, in its own calling convention; calibrate scales for it;
compare two models' next-token distributions (KL)."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnx_kvcache.cache.storage import find_qdq_caches
from onnx_kvcache.scales.files import KvCacheScales

ROOT = pathlib.Path(__file__).parents[1] / "tests" / "data" / "producers"
STATIC = [f"mobius/mobius-static/{family}" for family in ("llama", "mistral", "phi3", "qwen2", "qwen3")]
#: DeepSeek-V3's multi-head latent attention: keys 32 wide, values 16 (dynamo: one KV head, opset 23;
#: optimum-onnx on transformers 4.57: four, opset 18, where fp8 and int4's QuantizeLinear do not exist).
MLA = ["torch-tf5/dynamo-opset23-optimize/deepseek_v3", "optimum/optimum-cli/deepseek_v3"]
#: An export whose caches are Concat's (mobius's gpt-oss, read through Unsqueeze): under ``auto`` its
#: attention fuses; ``qdq`` stores the caches around its own attention instead.
CONCAT = ["mobius/mobius-default/gpt_oss"]
#: ONNX Attention holding its own cache (past_key/past_value in, present_key/present_value out).
OWN_CACHE = ["mobius/mobius-default/llama"]
PROMPT = [1, 72, 101, 108, 108, 111, 33]
DECODE = [32, 72, 105]

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}
_ONNX = {"tensor(float8e4m3fn)": ir.DataType.FLOAT8E4M3FN, "tensor(int4)": ir.DataType.INT4}


def load(path: str) -> ir.Model:
    """A producer's file with its weights in memory (the test changes a copy, never the file)."""
    return ir.external_data.load_to_model(ir.load(ROOT / path / "model.onnx"))


def session(model: ir.Model) -> ort.InferenceSession:
    data = ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _zeros(info: ort.NodeArg, shape: list[int]) -> ort.OrtValue:
    """A zero cache of ``shape`` in the input's type (fp8 and int4: their bits, as onnxruntime takes them)."""
    if info.type in _NUMPY:
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, _NUMPY[info.type]))
    dtype = _ONNX[info.type]
    if dtype == ir.DataType.INT4:  # a zero int4 tensor: one made by the runtime (numpy has none)
        return _int4_zeros(shape)
    bits = np.zeros(shape, ml_dtypes.float8_e4m3fn).view(np.uint8)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_element_type=int(dtype))


def _int4_zeros(shape: list[int]) -> ort.OrtValue:
    """Zeros of int4 made by a one-node model (Cast), since numpy has no int4 array to give."""
    x = ir.Value(name="x", shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("Cast", [x], {"to": ir.DataType.INT4}, name="cast")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21})
    s = session(ir.Model(graph, ir_version=10))
    return s.run_with_ort_values(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))})[
        0
    ]


def run(model: ir.Model, *, capture: bool = False) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """The logits of a 7-token prompt then 3 decode steps (each fed the model's own presents);
    ``capture``: also each present output's values (float models), by cache input name."""
    static = any(v.name == "write_indices" for v in model.graph.inputs)
    s = session(model)
    infos = {i.name: i for i in s.get_inputs()}
    caches = {c.past.name: c.present.name for c in find_qdq_caches(model.graph)}
    feeds: dict[str, ort.OrtValue] = {}
    for name in caches:
        shape = [1 if not isinstance(d, int) else d for d in model.graph.inputs[_index(model, name)].shape]
        if not static:
            shape[2] = 0
        feeds[name] = _zeros(infos[name], shape)
    logits, seen, past = [], {name: [] for name in caches}, 0
    for ids in [PROMPT, *([t] for t in DECODE)]:
        step = {
            k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in positions(ids, past, static=static).items()
        }
        names = ["logits", *caches.values()]
        out = s.run_with_ort_values(names, {**feeds, **step})
        logits.append(out[0].numpy()[0])
        for (name, _), value in zip(caches.items(), out[1:]):
            feeds[name] = value
            if capture:
                seen[name].append(value.numpy())
        past += len(ids)
    return logits, seen


def _index(model: ir.Model, name: str) -> int:
    return next(i for i, v in enumerate(model.graph.inputs) if v.name == name)


def positions(ids: list[int], past: int, *, static: bool) -> dict[str, np.ndarray]:
    n = len(ids)
    feeds = {
        "input_ids": np.array([ids], np.int64),
        "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
    }
    if static:
        feeds["write_indices"] = np.array([past], np.int64)
        feeds["nonpad_kv_seqlen"] = np.array([past + n], np.int64)
    else:
        feeds["attention_mask"] = np.ones((1, past + n), np.int64)
    return feeds


def calibrate(
    model: ir.Model, fmt: str, granularity: str, qmax: float, rotation: str = "none"
) -> KvCacheScales:
    """Scales from the float model's own presents over :data:`PROMPT` and :data:`DECODE`:
    each cache's absolute max (per tensor, or per ``kv_heads * head_size`` channel) over qmax;
    ``rotation``: the model's, recorded (its presents hold the rotated caches)."""
    _, seen = run(model, capture=True)
    k, v = {}, {}
    for cache in find_qdq_caches(model.graph):
        last = np.abs(seen[cache.past.name][-1])  # every row written: the last present holds them all
        amax = last.max(axis=(0, 2) if last.ndim == 4 else (0, 1)).reshape(-1)  # (heads, head) channels
        amax = amax if granularity == "per_channel" else amax.max(keepdims=True)
        (k if cache.side == "k" else v)[cache.layer] = np.maximum(amax, 1e-6) / qmax
    return KvCacheScales(k, v, format=fmt, granularity=granularity, metadata={"rotation": rotation})


def kl_mean(want: list[np.ndarray], got: list[np.ndarray]) -> float:
    """The mean KL divergence, over every position, of ``got``'s next-token distributions from ``want``'s."""
    p = np.concatenate(want).astype(np.float64)
    q = np.concatenate(got).astype(np.float64)
    log_p = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    log_q = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
