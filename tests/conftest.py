"""Small GQA models built with onnx_ir and numpy, and helpers to run them on CPU."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.cache.formats import CACHE_FORMATS

FORMATS = list(CACHE_FORMATS)
GRANULARITIES = ["per_tensor", "per_channel"]
CPU_FORMATS = ["int8", "int4"]


def gqa_model(
    *,
    num_heads: int = 4,
    kv_heads: int = 2,
    head: int = 16,
    dtype: ir.DataType = ir.DataType.FLOAT,
    rotary: bool = True,
    interleaved: bool = False,
    qk_norm: bool = False,
    packed_qkv: bool = False,
    max_pos: int = 64,
    layers: int = 1,
    names: str = "past_key_values.{i}.{kind}",
    seed: int = 0,
    head_sink: bool = False,
) -> ir.Model:
    """``layers`` independent GQA nodes whose q/k/v are graph inputs (genai names); with
    ``head_sink``, a constant sink logit per query head (input 11, gpt-oss's sinks)."""
    rng = np.random.default_rng(seed)
    np_dtype = dtype.numpy()
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 21, "com.microsoft": 1}, name="gqa")
    seqlens = ir.val("seqlens_k", ir.DataType.INT32, ["batch"])
    total = ir.val("total_sequence_length", ir.DataType.INT32, [])
    inv = 1.0 / (10000 ** (np.arange(0, head, 2) / head))
    angles = np.outer(np.arange(max_pos), inv)
    cos = ir.Value(name="cos_cache", const_value=ir.tensor(np.cos(angles).astype(np_dtype), name="cos_cache"))
    sin = ir.Value(name="sin_cache", const_value=ir.tensor(np.sin(angles).astype(np_dtype), name="sin_cache"))
    for init in (cos, sin):
        init.dtype, init.shape = dtype, ir.Shape([max_pos, head // 2])
        graph.register_initializer(init)
    for i in range(layers):
        if packed_qkv:
            q = ir.val(f"qkv.{i}", dtype, ["batch", "seq", (num_heads + 2 * kv_heads) * head])
            k = v = None
            graph.inputs.append(q)
        else:
            q = ir.val(f"query.{i}", dtype, ["batch", "seq", num_heads * head])
            k = ir.val(f"key.{i}", dtype, ["batch", "seq", kv_heads * head])
            v = ir.val(f"value.{i}", dtype, ["batch", "seq", kv_heads * head])
            graph.inputs.extend([q, k, v])
        shape = ["batch", kv_heads, "past", head]
        pk = ir.val(names.format(i=i, kind="key"), dtype, shape)
        pv = ir.val(names.format(i=i, kind="value"), dtype, shape)
        graph.inputs.extend([pk, pv])
        inputs = [q, k, v, pk, pv, seqlens, total]
        inputs += [cos, sin] if rotary else [None, None]
        if qk_norm:
            qn = ir.Value(
                name=f"q_norm.{i}",
                const_value=ir.tensor((1 + 0.1 * rng.standard_normal(head)).astype(np_dtype)),
            )
            kn = ir.Value(
                name=f"k_norm.{i}",
                const_value=ir.tensor((1 + 0.1 * rng.standard_normal(head)).astype(np_dtype)),
            )
            for w in (qn, kn):
                w.dtype, w.shape = dtype, ir.Shape([head])
                graph.register_initializer(w)
            inputs += [None] * 5 + [qn, kn]
        if head_sink:
            sink = ir.Value(
                name=f"head_sink.{i}",
                const_value=ir.tensor(np.linspace(-1.0, 2.0, num_heads).astype(np_dtype)),
            )
            sink.dtype, sink.shape = dtype, ir.Shape([num_heads])
            graph.register_initializer(sink)
            inputs += [None] * (11 - len(inputs)) + [sink]
        out_shape = ["batch", kv_heads, "total", head]
        outputs = [
            ir.val(f"output.{i}", dtype, ["batch", "seq", num_heads * head]),
            ir.val(names.format(i=i, kind="key").replace("past_key_values", "present"), dtype, out_shape),
            ir.val(names.format(i=i, kind="value").replace("past_key_values", "present"), dtype, out_shape),
        ]
        node = ir.Node(
            "com.microsoft",
            "GroupQueryAttention",
            inputs,
            attributes=ir.convenience.convert_attributes(
                {
                    "num_heads": num_heads,
                    "kv_num_heads": kv_heads,
                    "do_rotary": int(rotary),
                    "rotary_interleaved": int(interleaved),
                }
            ),
            outputs=outputs,
            name=f"gqa.{i}",
        )
        graph.append(node)
        graph.outputs.extend(outputs)
    graph.inputs.extend([seqlens, total])
    return ir.Model(graph, ir_version=10)


def rope_tables(model: ir.Model) -> dict[str, np.ndarray]:
    """The model's cos/sin caches, as the reference's keyword arguments."""
    return {name: model.graph.initializers[f"{name}_cache"].const_value.numpy() for name in ("cos", "sin")}


def reference_step(model: ir.Model, feeds: dict, fmt, k_scale=None, v_scale=None, **kwargs):
    """The numpy reference for one step of ``run_gqa_steps`` on ``model``."""
    from reference import quantized_gqa_step

    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    return quantized_gqa_step(
        feeds["q"],
        feeds["k"],
        feeds["v"],
        feeds["past_k"],
        feeds["past_v"],
        fmt,
        k_scale,
        v_scale,
        num_heads=node.attributes["num_heads"].as_int(),
        kv_heads=node.attributes["kv_num_heads"].as_int(),
        interleaved=bool(node.attributes["rotary_interleaved"].as_int()),
        sink=node.inputs[11].const_value.numpy() if len(node.inputs) > 11 and node.inputs[11] else None,
        **rope_tables(model),
        **kwargs,
    )


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(float8e4m3fn)": np.uint8,
}


def run_gqa_steps(
    session, model: ir.Model, steps: list[int], *, seed: int = 1, batch: int = 1, scale: float = 1.0
):
    """Feed random q/k/v for each step length in ``steps``; yields (feeds, outputs).

    Caches are fed as the session declares them: stored (fp8 as OrtValues of its bits) or
    float (emulated caches holding values). ``feeds`` has the past caches as fed.
    """
    from onnx_kvcache.model_io._sessions import to_ort_value

    rng = np.random.default_rng(seed)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    heads = node.attributes["num_heads"].as_int()
    kv = node.attributes["kv_num_heads"].as_int()
    q_in, k_in, v_in, pk, pv = node.inputs[:5]
    head = k_in.shape[-1] // kv
    t_dtype = q_in.dtype.numpy()
    declared = {i.name: i for i in session.get_inputs()}[pk.name]
    last = declared.shape[3] if isinstance(declared.shape[3], int) else pk.shape[3]
    past_k = np.zeros((batch, kv, 0, last), _ORT_TYPES[declared.type])
    past_v = past_k.copy()
    fp8 = declared.type == "tensor(float8e4m3fn)"
    length = 0
    for s in steps:
        q = (rng.standard_normal((batch, s, heads * head)) * scale).astype(t_dtype)
        k = (rng.standard_normal((batch, s, kv * head)) * scale).astype(t_dtype)
        v = (rng.standard_normal((batch, s, kv * head)) * scale).astype(t_dtype)
        length += s
        feeds = {
            q_in.name: q,
            k_in.name: k,
            v_in.name: v,
            "seqlens_k": np.full((batch,), length - 1, np.int32),
            "total_sequence_length": np.array(length, np.int32),
        }
        if fp8:
            feeds[pk.name] = to_ort_value(past_k, ir.DataType.FLOAT8E4M3FN)
            feeds[pv.name] = to_ort_value(past_v, ir.DataType.FLOAT8E4M3FN)
        else:
            feeds[pk.name], feeds[pv.name] = past_k, past_v
        out, present_k, present_v = session.run(None, feeds)
        yield {"q": q, "k": k, "v": v, "past_k": past_k, "past_v": past_v}, (out, present_k, present_v)
        past_k, past_v = present_k, present_v


@pytest.fixture
def decoder():
    from onnx_kvcache.models.decoder import build_decoder

    return build_decoder(num_layers=2, vocab_size=300)


def paged_model(
    *,
    num_heads: int = 4,
    kv_heads: int = 2,
    head: int = 16,
    dtype: ir.DataType = ir.DataType.FLOAT,
    rotary: bool = True,
    interleaved: bool = False,
    qk_norm: bool = False,
    packed_qkv: bool = False,
    latent: bool = False,
    v_head: int | None = None,
    slot_mapping: bool = False,
    head_sink: bool = False,
    layers: int = 1,
    max_pos: int = 256,
    attributes: dict | None = None,
    seed: int = 0,
) -> ir.Model:
    """``layers`` PagedAttention nodes whose q/k/v are graph inputs, genai's cache names.

    The block pool is ``[num_blocks, block_size, kv, head]`` with both leading dims symbolic;
    ``latent`` builds the single-cache LATENT layout (``kv_heads`` must be 1) whose V is the
    leading ``v_head`` channels and whose rotary channels are the last ``head - v_head``.
    """
    rng = np.random.default_rng(seed)
    np_dtype = dtype.numpy()
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 21, "com.microsoft": 1}, name="paged")
    i32 = ir.DataType.INT32
    cu = ir.val("cumulative_sequence_lengths", i32, ["batch_size + 1"])
    past = ir.val("past_sequence_lengths", i32, ["batch_size"])
    table = ir.val("block_table", i32, ["batch_size", "max_num_blocks"])
    metadata = ir.val("attention_metadata", i32, [3])
    slots = ir.val("slot_mapping", i32, ["num_tokens"]) if slot_mapping else None
    rot = (head - v_head) if latent and v_head else head
    inv = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
    angles = np.outer(np.arange(max_pos), inv)
    cos = ir.Value(name="cos_cache", const_value=ir.tensor(np.cos(angles).astype(np_dtype), name="cos_cache"))
    sin = ir.Value(name="sin_cache", const_value=ir.tensor(np.sin(angles).astype(np_dtype), name="sin_cache"))
    for init in (cos, sin):
        init.dtype, init.shape = dtype, ir.Shape([max_pos, rot // 2])
        graph.register_initializer(init)
    dv = v_head or head
    for i in range(layers):
        if packed_qkv:
            q = ir.val(f"qkv.{i}", dtype, ["num_tokens", (num_heads + 2 * kv_heads) * head])
            k = v = None
            graph.inputs.append(q)
        else:
            q = ir.val(f"query.{i}", dtype, ["num_tokens", num_heads * head])
            k = ir.val(f"key.{i}", dtype, ["num_tokens", kv_heads * head])
            graph.inputs.extend([q, k])
            v = None
            if not latent:
                v = ir.val(f"value.{i}", dtype, ["num_tokens", kv_heads * head])
                graph.inputs.append(v)
        shape = ["num_blocks", "block_size", kv_heads, head]
        pk = ir.val(f"past_key_values.{i}.key", dtype, shape)
        pv = None if latent else ir.val(f"past_key_values.{i}.value", dtype, shape)
        graph.inputs.extend([x for x in (pk, pv) if x is not None])
        inputs = [q, k, v, pk, pv, cu, past, table]
        inputs += [cos, sin] if rotary else [None, None]
        inputs.append(slots)
        sink = None
        if head_sink:
            sink = ir.Value(
                name=f"sink.{i}", const_value=ir.tensor(rng.standard_normal(num_heads).astype(np_dtype))
            )
            sink.dtype, sink.shape = dtype, ir.Shape([num_heads])
            graph.register_initializer(sink)
        inputs.append(sink)
        norms = [None, None]
        if qk_norm:
            norms = []
            for name in ("q_norm", "k_norm"):
                w = ir.Value(
                    name=f"{name}.{i}",
                    const_value=ir.tensor((1 + 0.1 * rng.standard_normal(head)).astype(np_dtype)),
                )
                w.dtype, w.shape = dtype, ir.Shape([head])
                graph.register_initializer(w)
                norms.append(w)
        inputs += [*norms, None, None, metadata]
        attrs = {"num_heads": num_heads, "kv_num_heads": kv_heads, "do_rotary": int(rotary)}
        attrs["rotary_interleaved"] = int(interleaved)
        if latent:
            attrs |= {"kv_cache_layout": "LATENT", "v_head_size": dv, "rotary_offset": head - rot}
            attrs["scale"] = float(1 / np.sqrt(head))
        attrs |= attributes or {}
        outputs = [ir.val(f"output.{i}", dtype, ["num_tokens", num_heads * dv])]
        outputs.append(ir.val(f"present.{i}.key", dtype, shape))
        if not latent:
            outputs.append(ir.val(f"present.{i}.value", dtype, shape))
        node = ir.Node(
            "com.microsoft",
            "PagedAttention",
            inputs,
            attributes=ir.convenience.convert_attributes(attrs),
            outputs=outputs,
            name=f"paged.{i}",
        )
        graph.append(node)
        graph.outputs.extend(outputs)
    graph.inputs.extend([x for x in (cu, past, table, slots, metadata) if x is not None])
    return ir.Model(graph, ir_version=10)


def og_generate(folder, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens onnxruntime-genai generates from a model folder after ``prompt``."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt) :]


def gqa_nodes(model: ir.Model) -> list[ir.Node]:
    """The model's GroupQueryAttention nodes, each as its site: a node ``convert`` wrapped for the
    CPU (its prompt through the float kernel, :mod:`onnx_kvcache.cache.prompt_path`) included."""
    from onnx_kvcache.cache.sites import find_gqa_sites

    return [s.node for s in find_gqa_sites(model, with_cache_only=False)]


def quantized_decoder(fmt: str, granularity: str = "per_tensor", opset: int | None = None) -> ir.Model:
    """The 2-layer test decoder (vocabulary 300) with its cache in ``fmt``, seeded per-layer scales
    (int8 about 0.05, int4 about 0.5; per channel: one per KV head and channel)."""
    from onnx_kvcache import KvCacheQuantizationPass
    from onnx_kvcache.cache.sites import find_gqa_sites
    from onnx_kvcache.models.decoder import build_decoder

    model = build_decoder(num_layers=2, vocab_size=300)
    if opset is not None:
        model.opset_imports[""] = opset
    scales = {}
    for site in find_gqa_sites(model):
        n = 1 if granularity == "per_tensor" else site.kv_num_heads * site.head_size()
        rng = np.random.default_rng(site.layer_id)
        base = 0.05 if fmt == "int8" else 0.5
        scales[site.layer_id] = tuple((base * rng.uniform(0.5, 1.5, n)).astype(np.float32) for _ in range(2))
    KvCacheQuantizationPass(fmt, granularity, scales)(model)
    return model


def partial_rotary(model: ir.Model, rotary_dim: int, theta: float = 10000.0) -> ir.Model:
    """``model`` with cos/sin tables of ``rotary_dim`` channels: the node's RoPE turns the first
    ``rotary_dim`` of each head and leaves the rest (phi-2's partial rotary)."""
    for name, wave in (("cos_cache", np.cos), ("sin_cache", np.sin)):
        value = model.graph.initializers[name]
        angles = np.outer(np.arange(value.shape[0]), theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim))
        value.const_value = ir.tensor(wave(angles).astype(np.float32), name=name)
        value.shape = ir.Shape(angles.shape)
    return model


def demo_decoder(head_size: int, rotary_dim: int | None = None, **overrides) -> ir.Model:
    """The demo decoder (outlier K channels, RoPE inside GroupQueryAttention, 2 layers) of
    ``head_size``, its RoPE on the first ``rotary_dim`` channels when given."""
    from onnx_kvcache.models.decoder import build_decoder

    model = build_decoder(**({"num_layers": 2, "vocab_size": 300} | overrides), head_size=head_size)
    return model if rotary_dim is None else partial_rotary(model, rotary_dim)
