"""The cache-format table: storage rules, packing, round trips, names."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.cache.formats import (
    CACHE_FORMATS,
    SCALE_GRANULARITIES,
    CacheFormat,
    ScaleGranularity,
    get_format,
    get_granularity,
)
from onnx_kvcache.capabilities.table import FAST_PATHS
from onnx_kvcache.errors import NotConvertedWarning

import codec


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_round_trip_error_is_half_a_step_inside_the_range(name):
    fmt = get_format(name)
    rng = np.random.default_rng(0)
    scale = np.float32(0.01)
    x = rng.uniform(-0.95, 0.95, (2, 3, 5, 16)).astype(np.float32) * scale * fmt.qmax_stored
    back = fmt.dequantize(fmt.quantize(x, scale), scale, 16)
    if fmt.is_float:  # relative: 3 mantissa bits
        assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + scale * 2.0**-10)
    else:
        assert np.all(np.abs(back - x) <= scale / 2 * 1.0001)


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_out_of_range_saturates(name):
    fmt = get_format(name)
    x = np.array([[-1e6, -1.0, 1.0, 1e6]], np.float32)
    back = fmt.dequantize(fmt.quantize(x, np.float32(1.0)), np.float32(1.0), 4)
    assert back[0, 0] == fmt.qmin_stored and back[0, -1] == fmt.qmax_stored
    assert np.isfinite(back).all()


def test_stored_forms_match_what_onnxruntime_feeds():
    x = np.array([[0.5, -2.0, 3.0, 7.0]], np.float32)
    fp8 = get_format("fp8").quantize(x, np.float32(1.0))
    assert fp8.dtype == np.uint8
    np.testing.assert_array_equal(fp8.view(ml_dtypes.float8_e4m3fn).astype(np.float32), x)
    assert get_format("int8").quantize(x, np.float32(1.0)).dtype == np.int8
    packed = get_format("int4").quantize(x, np.float32(1.0))
    assert packed.dtype == np.uint8 and packed.tolist() == [
        [(8 + 0) | ((8 - 2) << 4), (8 + 3) | ((8 + 7) << 4)]
    ]


@pytest.mark.parametrize("head", [1, 7, 8, 9, 128])
def test_int4_packs_two_a_byte_with_odd_heads(head):
    fmt = get_format("int4")
    assert fmt.packed_dim(head) == (head + 1) // 2
    x = np.arange(head, dtype=np.float32)[None] % 15 - 7
    packed = fmt.quantize(x, np.float32(1.0))
    assert packed.shape == (1, (head + 1) // 2)
    np.testing.assert_array_equal(fmt.dequantize(packed, np.float32(1.0), head), x)


def test_rounding_is_half_to_even_like_the_kernels():
    x = np.array([[0.5, 1.5, 2.5, -0.5, -2.5]], np.float32)
    assert get_format("int8").quantize(x, np.float32(1.0)).tolist() == [[0, 2, 2, 0, -2]]


def test_table_rows():
    assert {n: (f.dtype, f.bit_width, f.qmax) for n, f in CACHE_FORMATS.items()} == {
        "fp8": (ir.DataType.FLOAT8E4M3FN, 8, 448.0),
        "int8": (ir.DataType.INT8, 8, 128.0),
        "int4": (ir.DataType.UINT8, 4, 8.0),
    }
    assert get_format("int4").bytes_per_value() == 0.5


@pytest.mark.parametrize(
    ("alias", "name"), [("FP8", "fp8"), ("float8e4m3fn", "fp8"), ("INT8", "int8"), ("uint4", "int4")]
)
def test_names_and_aliases(alias, name):
    assert get_format(alias).name == name


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="Unknown KV-cache format 'fp4'; choose one of fp8, int8, int4"):
        get_format("fp4")
    with pytest.raises(ValueError, match="Unknown scale granularity 'per_head'"):
        get_granularity("per_head")
    assert get_granularity("per-channel") == "per_channel"


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_stored_codes_equal_the_cpu_kernel_at_ties(name, granularity):
    """The kernel multiplies by 1/scale: at exact ties ``x / scale`` would round differently."""
    from onnx_kvcache import KvCacheQuantizationPass
    from onnx_kvcache.model_io._sessions import create_session

    from conftest import gqa_model

    fmt, kv, head, seq = get_format(name), 2, 16, 512
    model = gqa_model(rotary=False, num_heads=kv, kv_heads=kv, head=head)
    rng = np.random.default_rng(3)
    n = 1 if granularity == "per_tensor" else kv * head
    scale = rng.uniform(0.005, 0.02, n).astype(np.float32)
    KvCacheQuantizationPass(name, granularity, {0: (scale, scale)})(model)
    codes = rng.integers(int(fmt.qmin_stored), int(fmt.qmax_stored), (1, seq, kv * head))
    flat = np.broadcast_to(scale, (kv * head,)) if n == 1 else scale
    x = ((codes + 0.5) * flat).astype(np.float32)  # every value sits at a tie
    empty = np.zeros((1, kv, 0, fmt.packed_dim(head)), fmt.numpy_dtype())
    feeds = {
        "query.0": x,
        "key.0": x,
        "value.0": x,
        "past_key_values.0.key": empty,
        "past_key_values.0.value": empty,
        "seqlens_k": np.array([seq - 1], np.int32),
        "total_sequence_length": np.array(seq, np.int32),
    }
    _, _, stored = create_session(model).run(None, feeds)
    bnsh = x.reshape(1, seq, kv, head).transpose(0, 2, 1, 3)
    s4 = scale.reshape(1, 1, 1, 1) if n == 1 else scale.reshape(1, kv, 1, head)
    np.testing.assert_array_equal(stored, fmt.quantize(bnsh, s4))
    np.testing.assert_array_equal(stored, codec.quantize(name, bnsh, s4))  # the oracles' codec too
    assert np.any(fmt.quantize(bnsh, s4) != _divide_rule(fmt, bnsh, s4))  # the test can tell


def _divide_rule(fmt, x, scale):
    q = np.clip(np.rint(x / scale), fmt.qmin_stored, fmt.qmax_stored)
    return fmt.quantize(q, np.float32(1.0))


# -- a format and a granularity added as table rows only ---------------------------------

EXTRA_FORMATS = (
    CacheFormat("int6", ir.DataType.INT8, 6, 32.0, 1, -32.0, 31.0, False, "int6"),
    CacheFormat("e5m2", ir.DataType.FLOAT8E5M2, 8, 57344.0, 1, -57344.0, 57344.0, True),
)
PER_HEAD = ScaleGranularity("per_head", "PER_HEAD", per_head=True, per_dim=False)
EXTRA_CASES = [("int6", "per_head"), ("e5m2", "per_channel"), ("e5m2", "per_head"), ("int8", "per_head")]
DATA = [list(np.random.default_rng(0).integers(0, 300, 300))]


@pytest.fixture
def extra_rows(monkeypatch):
    """Test-only rows: a 6-bit integer format, an fp8-like format stored in another element
    type (FLOAT8E5M2), and a per-head granularity. Only the two tables change."""
    for row in EXTRA_FORMATS:
        monkeypatch.setitem(CACHE_FORMATS, row.name, row)
    monkeypatch.setitem(SCALE_GRANULARITIES, PER_HEAD.name, PER_HEAD)


@pytest.mark.parametrize(("name", "granularity"), EXTRA_CASES)
def test_new_rows_flow_through_calibration_files_conversion_inspect_and_evaluation(
    extra_rows, tmp_path, capsys, name, granularity
):
    from onnx_kvcache import (
        KvCacheRunner,
        calibrate_kv_cache,
        convert_model,
        evaluate_kv_cache,
        fast_path_diagnostics,
        inspect_kv_cache,
        load_kv_cache_scale_file,
        load_model,
    )
    from onnx_kvcache.cli.commands import main
    from onnx_kvcache.models.decoder import build_decoder

    fmt, row = CACHE_FORMATS[name], SCALE_GRANULARITIES[granularity]
    base = build_decoder(num_layers=2, vocab_size=300)  # kv_num_heads 2, head_size 32
    ir.save(base, tmp_path / "model.onnx")
    scales = calibrate_kv_cache(base, DATA, format=name, granularity=granularity, progress=False)
    assert (scales.format, scales.granularity, scales.k[0].size) == (name, granularity, row.size(2, 32))
    scales.save(tmp_path / "scales.json")
    loaded = load_kv_cache_scale_file(tmp_path / "scales.json")
    assert (loaded.format, loaded.granularity, loaded.qmax) == (name, granularity, fmt.qmax)
    assert all(np.array_equal(loaded.k[i], scales.k[i]) for i in scales.layer_ids)

    result = convert_model(
        tmp_path / "model.onnx", tmp_path / "out.onnx", scales=tmp_path / "scales.json", ep=None
    )
    assert (result.converted, result.format, result.granularity, result.nodes) == (True, name, granularity, 2)
    model = load_model(tmp_path / "out.onnx")
    for node in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        assert node.attributes["k_quant_type"].value == row.quant_type
        assert node.attributes["kv_cache_bit_width"].value == fmt.bit_width
        assert node.inputs[3].dtype == fmt.dtype
    assert inspect_kv_cache(model).bytes_per_token == 2 * 2 * 2 * 32 * fmt.bytes_per_value()
    xqa = FAST_PATHS["GroupQueryAttention"].formats
    for report in fast_path_diagnostics(model, share_buffer=True):
        assert (f"not {name}" in " ".join(report.reasons)) == (name not in xqa)
    assert main(["inspect", str(tmp_path / "out.onnx"), "--ep", "cuda"]) == 0
    assert (f"not {name}" in capsys.readouterr().out) == (name not in xqa)
    with pytest.warns(NotConvertedWarning, match=f"not converted to {name} {granularity} for cuda"):
        refused = convert_model(tmp_path / "model.onnx", tmp_path / "cuda.onnx", scales=scales, ep="cuda")
    assert not refused.converted and not (tmp_path / "cuda.onnx").exists()

    runners = [KvCacheRunner(model), KvCacheRunner(model, quantized_io=True)]  # values / stored I/O
    assert all(r.emulated and r.bindings[0].format is fmt for r in runners)  # no CPU kernel
    logits = [r.prefill(DATA[0][:8]) for r in runners] + [r.step(DATA[0][8]) for r in runners]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4)
    np.testing.assert_allclose(logits[2], logits[3], atol=1e-4)
    stored = [r.present(1, "value") for r in runners]
    assert stored[1].dtype == fmt.numpy_dtype() and np.array_equal(stored[0], stored[1])
    report = evaluate_kv_cache(base, model, DATA, max_new_tokens=2, seq_len=48, num_seqs=2, progress=False)
    assert report.candidate_format == f"{name} {granularity}" and report.top1_agreement > 0.5


@pytest.mark.parametrize(("name", "granularity"), [("int6", "per_head"), ("e5m2", "per_channel")])
def test_new_rows_flow_through_paged_attention(extra_rows, name, granularity):
    from onnx_kvcache import KvCacheQuantizationPass, calibrate_kv_cache, evaluate_kv_cache
    from onnx_kvcache.models.decoder import build_decoder

    base = build_decoder(num_layers=2, vocab_size=300, paged=True, dtype="float16")
    scales = calibrate_kv_cache(base, DATA, format=name, granularity=granularity, progress=False)
    assert (scales.format, scales.granularity) == (name, granularity)
    cand = build_decoder(num_layers=2, vocab_size=300, paged=True, dtype="float16")
    KvCacheQuantizationPass(name, granularity, scales)(cand)
    node = next(n for n in cand.graph if n.op_type == "PagedAttention")
    assert node.attributes["k_quant_type"].value == SCALE_GRANULARITIES[granularity].quant_type
    assert node.inputs[3].dtype == CACHE_FORMATS[name].dtype
    report = evaluate_kv_cache(
        base, cand, DATA, max_new_tokens=2, prompt_len=8, seq_len=48, num_seqs=2, progress=False
    )
    assert report.kernel_rule.startswith("PagedAttention CPU reference")
    assert report.candidate_format == f"{name} {granularity}" and report.top1_agreement > 0.5


def test_new_rows_reach_the_doctor(extra_rows):
    """Every format x granularity is probed, and the runtime's answer is reported: this
    onnxruntime's schemas lack float8e5m2 and its kernels reject PER_HEAD."""
    pytest.importorskip("onnxruntime")
    from onnx_kvcache.runtime.doctor import run_doctor

    report = run_doctor(["cpu"])
    for schema in report.schemas:
        assert "the cache type constraint lacks e5m2 (float8e5m2)" in schema.problems
    gqa = {
        r.cache: r
        for r in report.rows
        if (r.op, r.provider) == ("GroupQueryAttention", "cpu") and not r.cache.endswith("+ head_sink")
    }
    assert set(gqa) == {"float"} | {f"{f} {g}" for f in CACHE_FORMATS for g in SCALE_GRANULARITIES}
    assert gqa["int6 per_tensor"].table == gqa["e5m2 per_head"].table == "not listed"
    assert gqa["int8 per_head"].table == "not per_head" and gqa["int8 per_head"].verdict == "disagrees"
    assert gqa["int8 per_channel"].verdict == "proven"


def test_the_oracles_codec_by_hand():
    """tests/codec.py, which the numpy references use instead of the library's, on known codes."""
    one = np.float32(1.0)
    x = np.array([[0.5, 1.5, 2.5, -2.5, 300.0, -300.0]], np.float32)
    assert codec.quantize("int8", x, one).tolist() == [[0, 2, 2, -2, 127, -128]]
    # int4 levels -8, 7, 0, 1 -> codes 0, 15, 8, 9: element 2i in the low nibble
    assert codec.quantize("int4", np.array([[-9.0, 7.4, 0.2, 1.0]]), one).tolist() == [[0xF0, 0x98]]
    assert codec.quantize("int4", np.array([[3.0]]), one).tolist() == [[8 + 3 | 8 << 4]]  # odd: pad 0
    # fp8 E4M3FN bits: 1.0, a tie between 16 and 18 (to even: 16), ±448 saturated, -0.5
    fp8 = codec.quantize("fp8", np.array([[1.0, 17.0, 1e4, -1e4, -0.5]], np.float32), one)
    assert fp8.dtype == np.uint8 and fp8.tolist() == [[0x38, 0x58, 0x7E, 0xFE, 0xB0]]
    # the float32 reciprocal: -0.555 / 0.03 rounds to -18, -0.555 * float32(1 / 0.03) to -19
    x, s = np.array([[-0.555]], np.float32), np.float32(0.03)
    assert np.rint(x / s).item() == -18 and codec.quantize("int8", x, s).item() == -19
    packed = codec.quantize("int4", np.arange(9, dtype=np.float32)[None] - 4, one)
    np.testing.assert_array_equal(codec.dequantize("int4", packed, 0.5, 9), (np.arange(9)[None] - 4) * 0.5)


@pytest.mark.parametrize("head", [15, 16])
@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_the_library_codec_equals_the_oracles(name, head):
    """Random values across the range, past it, and at integer ties, per-channel scales."""
    fmt = get_format(name)
    rng = np.random.default_rng(11)
    scale = rng.uniform(0.01, 0.05, (1, 2, 1, head)).astype(np.float32)
    levels = rng.uniform(-1.5, 1.5, (1, 2, 64, head)) * fmt.qmax_stored
    ties = np.rint(levels[:, :, :16]) + 0.5
    x = (np.concatenate([levels[:, :, :48], ties], axis=2) * scale).astype(np.float32)
    stored = fmt.quantize(x, scale)
    np.testing.assert_array_equal(stored, codec.quantize(name, x, scale))
    np.testing.assert_array_equal(
        fmt.dequantize(stored, scale, head), codec.dequantize(name, stored, scale, head)
    )
