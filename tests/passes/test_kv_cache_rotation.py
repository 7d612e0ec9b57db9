"""KvCacheRotationPass: the real producers' GroupQueryAttention builds, rotated, compute as they did.

The oracle is each file itself (genai's builder and mobius's GQA builds, RoPE inside the node):
rotated, its logits and every cache entry (turned back by ``H^T``) stay within 1e-4 of the
original's over a 7-token prefill and 3 decode steps, a batch whose second row is left-padded
by 3, and for windowed files a prefill longer than the window, before any quantization.
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import numpy as np
import onnx_ir as ir
import pytest

from decoding import PROMPTS, generate
from onnx_kvcache.cache.rolling import rolling_attention
from onnx_kvcache.cache.rotation import (
    MATRICES,
    ROTATIONS,
    get_rotation,
    rotate,
    site_matrix,
    site_rotation,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import KvCacheError, KvCachePreconditionError
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.model_io.reading import load_model
from onnx_kvcache.passes import KvCacheQuantizationPass
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.kv_cache_emulation import emulate_kv_cache
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass

from builders.exported import ExportStyle, build_decoder, exported_config
from conftest import demo_decoder, gqa_model

PRODUCERS = pathlib.Path(__file__).parents[1] / "data" / "producers"
TOLERANCE = 1e-4
GQA_FORMS = ("genai-builder-cpu-fp32", "mobius-cpu-gqa", "mobius-ort-genai")
BUILDS = [
    m
    for m in json.loads((PRODUCERS / "manifest.json").read_text())["models"]
    if m["form"] in GQA_FORMS and "error" not in m
]


def _masks(entry: dict) -> dict[str, np.ndarray]:
    masks = {"single": np.ones((1, 7), np.int64), "left_padded": np.array([[1] * 7, [0] * 3 + [1] * 4])}
    if entry["config"].get("window"):
        masks["past_the_window"] = np.ones((1, entry["config"]["window"] + 5), np.int64)
    return masks


def _worst(want: list, got: list, rotation: str, matrix: str = "hadamard") -> tuple[float, float]:
    """Largest |difference| of the logits of real tokens and of the cache entries (turned back)."""
    logits = caches = 0.0
    values = get_rotation(rotation).values
    for (mask, a), (_, b) in zip(want, got):
        rows = mask[:, -a["logits"].shape[1] :].astype(bool)
        logits = max(logits, float(np.abs(a["logits"] - b["logits"])[rows].max()))
        for name, x in a.items():
            if name.startswith("present"):
                turned = name.endswith("key") or values
                y = rotate(b[name], inverse=True, matrix=matrix) if turned else b[name]
                caches = max(caches, float(np.abs(x - y).max()))
    return logits, caches


CASES = [(b, "keys_and_values") for b in BUILDS] + [
    (b, "keys")
    for b in BUILDS
    if b["path"].endswith(("genai-builder-cpu-fp32/llama", "mobius-cpu-gqa/qwen3"))
]


@pytest.mark.parametrize(("entry", "rotation"), CASES, ids=[f"{b['path']}-{r}" for b, r in CASES])
def test_a_rotated_build_computes_as_the_original(entry, rotation):
    path = PRODUCERS / entry["path"] / "model.onnx"
    original, rotated = load_model(path), load_model(path)
    assert KvCacheRotationPass(rotation)(rotated).modified
    assert {site_rotation(s).name for s in find_attention_sites(rotated)} == {rotation}
    for name, mask in _masks(entry).items():
        try:
            want = generate(original, mask)
        except Exception as refused:  # genai's Gemma-2 window caches refuse a left-padded row
            with pytest.raises(type(refused), match=re.escape(str(refused).split("Status Message: ")[-1])):
                generate(rotated, mask)
            continue
        logits, caches = _worst(want, generate(rotated, mask), rotation)
        assert logits < TOLERANCE and caches < TOLERANCE, (name, logits, caches)


#: Head sizes whose H is a Hadamard matrix but no power of two (Paley I 12 and 20, Paley II 28),
#: and partial rotary (head 80, RoPE on its first 32 channels)
HEADS = {"48": (48, None), "80": (80, None), "96": (96, None), "112": (112, None), "80-rotary32": (80, 32)}


@pytest.mark.parametrize("matrix", sorted(MATRICES))
@pytest.mark.parametrize("rotation", ["keys_and_values", "keys"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_a_decoder_of_each_head_size_computes_as_the_original(heads, rotation, matrix):
    """Rotated by either H, a prompt, 3 decode steps and a left-padded batch compute as the
    original's (the caches turned back by that H)."""
    original, rotated = demo_decoder(*HEADS[heads]), demo_decoder(*HEADS[heads])
    assert KvCacheRotationPass(rotation, matrix)(rotated).modified
    sites = find_attention_sites(rotated)
    assert {(site_rotation(s).name, site_matrix(s)) for s in sites} == {(rotation, MATRICES[matrix])}
    for name in ("single", "left_padded"):
        mask = PROMPTS[name]
        logits, caches = _worst(generate(original, mask), generate(rotated, mask), rotation, matrix)
        assert logits < TOLERANCE and caches < TOLERANCE, (name, logits, caches)


def test_a_model_rotated_by_one_h_is_not_rotated_by_another():
    model = demo_decoder(48)
    KvCacheRotationPass(matrix="walsh_dct")(model)
    assert not KvCacheRotationPass(matrix="walsh_dct")(model).modified
    before = [n.op_type for n in model.graph]
    with pytest.raises(
        KvCachePreconditionError, match="already rotated by H = walsh_dct; hadamard was asked"
    ):
        KvCacheRotationPass()(model)
    assert [n.op_type for n in model.graph] == before


def _fused(arch: str, style: dict) -> ir.Model:
    exported = ExportStyle(**style)
    config = exported_config(arch, num_layers=2, vocab_size=300, sliding_window=4, exported=exported)
    model = build_decoder(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GqaFusionPass()(model)
    return model


FUSED = {  # rolling window caches (the export's, query_seqlens), gpt-oss's sinks (head_sink)
    "gemma2-sinks": ("gemma2", {"attention": "eager", "attention_sinks": True, "window_cache": "cropped"}),
    "mistral": ("mistral", {"window_cache": "cropped"}),
}


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_sinks_and_window_sized_caches_rotate(case):
    """A fused export's GQA with head_sink and window-sized caches: rotated, it computes as it
    did (the genai builds above hold them with RoPE inside the node); cache rows compared where a
    row's tokens are (the kernel leaves the rest unread)."""
    original, rotated = _fused(*FUSED[case]), _fused(*FUSED[case])
    nodes = [n for n in original.graph if n.op_type == "GroupQueryAttention"]
    assert any(rolling_attention(n) for n in nodes)
    assert (case == "gemma2-sinks") == all(n.inputs[11] is not None for n in nodes)
    assert KvCacheRotationPass()(rotated).modified
    for mask in (PROMPTS["single"], PROMPTS["left_padded"], np.ones((1, 12), np.int64)):
        for (whole, a), (_, b) in zip(generate(original, mask), generate(rotated, mask)):
            rows = whole[:, -a["logits"].shape[1] :].astype(bool)
            assert np.abs(a["logits"] - b["logits"])[rows].max() < TOLERANCE
            for name in (n for n in a if n.startswith("present")):
                for r, tokens in enumerate(whole.sum(axis=1)):
                    n = min(int(tokens), a[name].shape[2])
                    turned = rotate(b[name][r, :, :n], inverse=True)
                    assert np.abs(a[name][r, :, :n] - turned).max() < TOLERANCE, (name, r)


def test_the_genai_build_has_what_the_kernel_applied_outside_and_one_matrix():
    path = PRODUCERS / "genai-builder/genai-builder-cpu-fp32/llama/model.onnx"
    model = load_model(path)
    KvCacheRotationPass()(model)
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    # packed QKV in, no rotary, tables or norms: a few nodes a layer
    assert all("do_rotary" not in n.attributes and len(n.inputs) <= 7 and n.inputs[1] is None for n in nodes)
    second = [
        n.op_type
        for n in model.graph
        if (n.name or "").startswith(f"{nodes[1].name.split('/rotation/')[0]}/")
    ]
    assert second == [  # the first layer also computes the positions every layer reads
        *("Split", "RotaryEmbedding", "Concat", "Reshape", "MatMul", "Reshape"),  # query and key at once
        *("GroupQueryAttention", "Reshape", "MatMul", "Reshape"),  # the output turned back
    ]
    matrices = {n.inputs[1].name for n in model.graph if n.op_type == "MatMul" and "/rotation/" in n.name}
    assert matrices == {"kv_cache_rotation_16"} and "kv_cache_rotation_16" in model.graph.initializers
    assert sum(n.op_type == "Range" for n in model.graph) == 1  # the positions, once for every layer
    assert not KvCacheRotationPass()(model).modified  # already rotated as asked
    with pytest.raises(KvCachePreconditionError, match="already rotated"):
        KvCacheRotationPass("keys")(model)
    create_session(model)


def test_rotation_names_and_bad_ones():
    assert get_rotation("keys-and-values") is ROTATIONS["keys_and_values"]
    assert not get_rotation("none").rotates
    with pytest.raises(KvCacheError, match="choose one of none, keys, keys_and_values"):
        get_rotation("values")
    assert not KvCacheRotationPass("none")(gqa_model()).modified


def _steps(model: ir.Model, session, steps=(3, 2, 1), seed=1):
    """Random q/k/v (or packed QKV) fed by the graph's input names; every step's outputs."""
    rng = np.random.default_rng(seed)
    names = [i.name for i in session.get_inputs()]
    shapes = {v.name: v.shape for v in model.graph.inputs}
    dtype = model.graph.inputs[0].dtype.numpy()
    pasts = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), dtype) for n in names if "past" in n}
    length, out = 0, []
    for s in steps:
        length += s
        feeds = {
            n: rng.standard_normal((1, s, shapes[n][2])).astype(dtype)
            for n in names
            if n.split(".")[0] in ("query", "key", "value", "qkv")
        }
        feeds |= pasts | {
            "seqlens_k": np.full((1,), length - 1, np.int32),
            "total_sequence_length": np.array(length, np.int32),
        }
        result = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        out.append(result)
        pasts = {n: result[n.replace("past_key_values", "present")] for n in pasts}
    return out


@pytest.mark.parametrize(
    "kwargs", [{"qk_norm": True}, {"interleaved": True}, {"packed_qkv": True}, {"num_heads": 8, "head": 32}]
)
def test_qk_norms_interleaved_rope_and_packed_qkv_move_out(kwargs):
    """q/k norm inputs (which the CPU kernel refuses) against the emulation's, proven there."""
    model = gqa_model(**kwargs)
    want = _steps(model, create_session(emulate_kv_cache(model, "cpu")))
    KvCacheRotationPass()(model)
    assert not any(n.op_type == "GroupQueryAttention" and len(n.inputs) > 7 for n in model.graph)
    assert {site_rotation(s).name for s in find_attention_sites(model)} == {"keys_and_values"}
    got = _steps(model, create_session(model))
    for a, b in zip(want, got):
        for name, x in a.items():
            y = rotate(b[name], inverse=True) if name.startswith("present") else b[name]
            np.testing.assert_allclose(y, x, atol=TOLERANCE, rtol=0)


def test_a_float16_build_gets_a_float16_matrix():
    model = load_model(PRODUCERS / "mobius/mobius-cuda-f16/llama/model.onnx")
    KvCacheRotationPass()(model)
    assert model.graph.initializers["kv_cache_rotation_16_float16"].dtype == ir.DataType.FLOAT16
    assert {site_rotation(s).name for s in find_attention_sites(model)} == {"keys_and_values"}


def test_a_quantized_cache_is_refused_and_the_model_left_as_it_was():
    model = gqa_model()
    KvCacheQuantizationPass("int8", "per_tensor", {0: (0.02, 0.02)})(model)
    before = [n.op_type for n in model.graph]
    with pytest.raises(KvCachePreconditionError, match=r"already int8.*scales calibrated for the rotation"):
        KvCacheRotationPass()(model)
    assert [n.op_type for n in model.graph] == before


@pytest.mark.parametrize("doing", ["rotate", "emulate"])
def test_a_cos_table_of_unknown_width_is_refused_before_a_node_is_written(doing):
    """Partial rotary is read from cos_cache's width: a symbolic one cannot be told from full,
    so the model is refused (it failed at run time), left as it was."""
    model = gqa_model()
    if doing == "emulate":  # the emulation writes the prologue of a quantized cache's node
        KvCacheQuantizationPass("int8", "per_tensor", {0: (0.02, 0.02)})(model)
    (site,) = find_attention_sites(model)
    cos = site.input("cos_cache")
    assert cos is not None and cos.shape is not None
    cos.shape = ir.Shape([*cos.shape[:-1], "half_rotary"])
    before = ir.to_onnx_text(model)
    with pytest.raises(KvCachePreconditionError):
        KvCacheRotationPass("keys")(model) if doing == "rotate" else emulate_kv_cache(model, "cuda")
    assert ir.to_onnx_text(model) == before
