"""The capability table, gating rules and the CUDA fast-path diagnostics."""

from __future__ import annotations

import itertools
import os

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheQuantizationPass, check_kv_cache_support, fast_path_diagnostics
from onnx_kvcache.capabilities.refusals import RefusalCode
from onnx_kvcache.capabilities.table import EP_CAPABILITIES, PAGED_CAPABILITIES, get_capabilities
from onnx_kvcache.errors import NotConvertedWarning, RuntimeSupportWarning

from conftest import gqa_model, paged_model

F32, F16, BF16 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16


def expected_reasons(ep, fmt, dtype, ort, cc):
    """An independent statement of SPEC.md section 2, as reason keywords."""
    table = {
        ("cpu", "int8"): "1.27",
        ("cpu", "int4"): "1.27",
        ("cuda", "fp8"): "1.25",
        ("cuda", "int8"): "1.25",
        ("cuda", "int4"): "1.25",
    }
    if ep == "someep":
        return ["not in the capability table"]
    if (ep, fmt) not in table:
        return ["no GroupQueryAttention kernel"]
    reasons = []
    if tuple(map(int, ort.split("."))) < tuple(map(int, table[(ep, fmt)].split("."))):
        reasons.append("predates")
    if ep == "cuda" and fmt == "fp8" and cc is not None and cc < (8, 9):
        reasons.append("compute capability")
    if (ep == "cuda" and dtype == F32) or (ep == "cpu" and dtype == BF16):
        reasons.append("takes queries of")
    return reasons


CASES = list(
    itertools.product(
        ["cpu", "cuda", "dml", "webgpu", "someep"],
        ["fp8", "int8", "int4"],
        [F32, F16, BF16],
        ["1.24.0", "1.25.1", "1.27.0", "1.31.1"],
        [None, (8, 0), (8, 9), (9, 0)],
    )
)


@pytest.mark.parametrize(("ep", "fmt", "dtype", "ort", "cc"), CASES)
def test_gating_rules(ep, fmt, dtype, ort, cc):
    model = gqa_model(dtype=dtype)
    report = check_kv_cache_support(model, ep, fmt, "per_tensor", runtime_version=ort, compute_capability=cc)
    want = expected_reasons(ep, fmt, dtype, ort, cc)
    assert report.supported == (not want), report.reasons
    assert len(report.reasons) == len(want)
    for keyword, reason in zip(want, report.reasons):
        assert keyword in reason


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_granularities_run_where_listed(granularity):
    assert check_kv_cache_support(None, "cpu", "int4", granularity, runtime_version="1.31").supported


def test_model_without_gqa_is_a_reason():
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 21})
    report = check_kv_cache_support(ir.Model(graph, ir_version=10), "cuda", "fp8", runtime_version="1.31")
    assert not report.supported and "no GroupQueryAttention" in report.reasons[0]


def test_provider_aliases_and_unknown_rows():
    assert get_capabilities("CUDAExecutionProvider").name == "cuda"
    assert get_capabilities("CPUExecutionProvider") is EP_CAPABILITIES["cpu"]
    assert get_capabilities("DmlExecutionProvider").name == "dml"
    assert get_capabilities("QNNExecutionProvider").name == "default"
    assert all(row.formats.get("fp8") is None for name, row in EP_CAPABILITIES.items() if name != "cuda")


def test_installed_runtime_is_the_default_version():
    pytest.importorskip("onnxruntime")
    report = check_kv_cache_support(gqa_model(), "cpu", "int8")
    assert report.supported  # the test environment has a CPU runtime new enough


def quantized(heads, kv, head, shared=False):
    model = gqa_model(num_heads=heads, kv_heads=kv, head=head, max_pos=8)
    scales = {0: (0.1, 0.2)}
    KvCacheQuantizationPass("fp8", scales=scales, shared_kv_scale=shared)(model)
    return model


def test_fast_path_eligible_model():
    model = quantized(16, 2, 128, shared=True)
    [report] = fast_path_diagnostics(model, ort_version="1.28.0", share_buffer=True)
    assert report.eligible and report.reasons == ()


def test_fast_path_reasons_are_each_listed():
    model = quantized(6, 2, 48)
    [report] = fast_path_diagnostics(model, ort_version="1.28.0")
    text = " | ".join(report.reasons)
    assert not report.eligible and len(report.reasons) == 4
    for keyword in ("head size 48", "group size 3", "share one buffer", "one tensor"):
        assert keyword in text


def test_separate_scales_are_fine_from_ort_1_29():
    model = quantized(16, 2, 64)
    [report] = fast_path_diagnostics(model, ort_version="1.29.0", share_buffer=True)
    assert report.eligible


def test_the_fast_path_asks_the_format_row_whether_a_cache_is_packed(monkeypatch):
    """A test-only 8-bit format stored as UINT8, unpacked: the cache's last dimension is the
    head size (UINT8 is not a synonym of packed int4)."""
    from onnx_kvcache.cache.formats import CACHE_FORMATS, CacheFormat

    u8 = CacheFormat("u8", ir.DataType.UINT8, 8, 255.0, 1, 0.0, 255.0, False)
    monkeypatch.setitem(CACHE_FORMATS, "u8", u8)
    model = gqa_model(num_heads=8, kv_heads=2, head=64, max_pos=8)
    KvCacheQuantizationPass("u8", scales={0: (0.1, 0.2)}, shared_kv_scale=True)(model)
    for value in model.graph.inputs:  # only the cache tells the head size
        if value.name.split(".")[0] in ("query", "key", "value"):
            value.shape = ir.Shape(["batch", "seq", "hidden"])
    [report] = fast_path_diagnostics(model, ort_version="1.29.0", share_buffer=True)
    assert report.reasons == ("XQA reads fp8/int8 caches, not u8",)


def test_docs_page_is_rendered_from_the_table():
    import importlib.util
    import pathlib

    docs = pathlib.Path(__file__).parents[2] / "docs"
    spec = importlib.util.spec_from_file_location("render", docs / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    page = (docs / "capabilities.md").read_text()
    assert render.render(page) == page, "docs/capabilities.md is stale: run python docs/render.py"
    assert "SM 8.9+" in page


@pytest.mark.parametrize(("ep", "ok"), [("cpu", False), ("cuda", True)])
def test_qk_norm_nodes_need_a_provider_that_takes_them(ep, ok):
    model = gqa_model(qk_norm=True, dtype=F16)
    report = check_kv_cache_support(model, ep, "int8", runtime_version="1.31")
    assert report.supported == ok
    if not ok:
        assert "q/k norm" in report.reasons[0]


@pytest.mark.parametrize(
    ("ep", "fmt", "version", "code"),
    [
        ("cpu", "int8", "1.32", None),
        ("cpu", "int4", "1.32", None),
        ("cpu", None, "1.22", RefusalCode.RUNTIME_TOO_OLD),
        ("cuda", "fp8", "1.32", None),
        ("webgpu", None, "1.32", None),
        ("dml", None, "1.32", RefusalCode.HEAD_SINK_UNSUPPORTED),
    ],
)
def test_attention_sinks_need_a_provider_that_honors_them(ep, fmt, version, code):
    """head_sink (gpt-oss): each row says since which version, with which quantized caches."""
    model = gqa_model(head_sink=True, dtype=F16 if ep != "cpu" else ir.DataType.FLOAT)
    report = check_kv_cache_support(model, ep, fmt, runtime_version=version)
    assert [r.code for r in report.refusals] == ([code] if code else [])
    if code is RefusalCode.HEAD_SINK_UNSUPPORTED:
        assert (
            "not known to honor attention sinks" in report.reasons[0]
            and "run it on cpu, cuda" in report.reasons[0]
        )
    assert check_kv_cache_support(gqa_model(dtype=F16), "dml", None, runtime_version=version).supported


@pytest.mark.parametrize(
    ("ep", "version", "code"),
    [
        ("cpu", "1.32", None),
        ("cpu", "1.31", RefusalCode.RUNTIME_TOO_OLD),
        ("openvino", "2026.4", RefusalCode.INPUT_UNSUPPORTED),
    ],
)
def test_window_sized_caches_of_a_fusion_need_query_seqlens(ep, version, code):
    """A rolling window cache fuses into GQA with query_seqlens (input 16): refused where not taken."""
    import warnings

    from onnx_kvcache import optimize_model

    from builders.exported import ExportStyle, build_decoder, exported_config

    config = exported_config(
        "mistral", num_layers=1, sliding_window=4, exported=ExportStyle(window_cache="cropped")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = optimize_model(build_decoder(config))
    report = check_kv_cache_support(model, ep, "int8", runtime_version=version)
    assert [r.code for r in report.refusals] == ([code] if code else [])


def fake_nvidia_smi(tmp_path, monkeypatch, output: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{output}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_compute_capability_from_nvidia_smi(tmp_path, monkeypatch):
    from onnx_kvcache.capabilities.device import cuda_compute_capability

    fake_nvidia_smi(tmp_path, monkeypatch, "8.9")
    assert cuda_compute_capability() == (8, 9)


def test_compute_capability_is_none_without_a_gpu(tmp_path, monkeypatch):
    from onnx_kvcache.capabilities import device

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(device.ctypes.util, "find_library", lambda name: "libcuda-that-is-not-there.so")
    assert device.cuda_compute_capability() is None


@pytest.mark.parametrize(("cc", "converted"), [("8.6", False), ("8.9", True), ("9.0", True)])
def test_check_device_gates_fp8_on_the_local_gpu(tmp_path, monkeypatch, cc, converted):
    from onnx_kvcache import optimize_model

    fake_nvidia_smi(tmp_path, monkeypatch, cc)
    model = gqa_model(dtype=F16)
    if converted:
        optimize_model(model, fp8_kv_cache=True, scales={0: (0.1, 0.1)}, check_device=True)
    else:
        with pytest.warns(NotConvertedWarning, match=f"compute capability {cc} is below 8.9"):
            optimize_model(model, fp8_kv_cache=True, scales={0: (0.1, 0.1)}, check_device=True)
    assert (model.graph.inputs[3].dtype == ir.DataType.FLOAT8E4M3FN) == converted


def test_openvino_row_gates_on_its_own_version():
    assert check_kv_cache_support(None, "openvino", "int4", runtime_version="2026.4.1").supported
    old = check_kv_cache_support(None, "openvino", "int8", runtime_version="2026.2.0")
    assert (
        not old.supported
        and "openvino 2026.2.0 predates 2026.4, the first openvino known to run an int8 cache"
        in old.reasons[0]
    )
    fp8 = check_kv_cache_support(None, "openvino", "fp8", runtime_version="2026.4.1")
    assert not fp8.supported and "no GroupQueryAttention kernel" not in fp8.reasons[0]  # it has one
    assert fp8.reasons[0].startswith(
        "openvino does not list fp8: an fp8 cache compiles there, but its codes differ from "
        "onnxruntime's rule"
    )


@pytest.mark.parametrize(
    ("dtype", "fmt", "config", "want"),
    [
        (F32, None, None, ("cpu", "a float32 model")),
        (F16, None, None, ("cuda", "a float16 model")),
        (BF16, "int8", None, ("cuda", "a bfloat16 model")),
        (F32, "fp8", None, ("cuda", "its fp8 cache runs only on CUDA")),
        (F16, None, [{"dml": {}}], ("dml", "genai_config.json's provider_options name 'dml'")),
        (F16, None, [{"QNN": {}}, {"cpu": {}}], ("cpu", "genai_config.json's provider_options name 'cpu'")),
        (F16, None, [], ("cpu", "genai_config.json names no provider, so onnxruntime-genai runs it on CPU")),
        (F32, "fp8", [{"dml": {}}], ("cuda", "its fp8 cache runs only on CUDA")),
    ],
)
def test_the_target_is_inferred_from_config_cache_and_dtype(dtype, fmt, config, want):
    from onnx_kvcache.capabilities.table import infer_target

    model = gqa_model(dtype=dtype)
    if fmt is not None:
        KvCacheQuantizationPass(fmt, scales={0: (0.1, 0.1)})(model)
    genai = (
        None if config is None else {"model": {"decoder": {"session_options": {"provider_options": config}}}}
    )
    assert infer_target(model, genai) == want


# -- PagedAttention --------------------------------------------------------------------


def paged_expected_reasons(ep, fmt, dtype, ort):
    """An independent statement of the issue's PagedAttention facts, as reason keywords."""
    if ep == "someep":
        return ["not in the capability table"]
    if ep != "cuda" and ep != "webgpu":
        return ["no PagedAttention kernel"]
    if ep == "webgpu":
        return ["no PagedAttention kernel for an"]
    reasons = []
    if tuple(map(int, ort.split("."))) < (1, 30):
        reasons.append("predates")
    if dtype == F32:
        reasons.append("takes queries of")
    return reasons


PAGED_CASES = list(
    itertools.product(
        ["cpu", "cuda", "webgpu", "dml", "someep"],
        ["fp8", "int8", "int4"],
        [F32, F16, BF16],
        ["1.29.1", "1.30.0"],
        [None, (7, 5)],
    )
)


@pytest.mark.parametrize(("ep", "fmt", "dtype", "ort", "cc"), PAGED_CASES)
def test_paged_gating_rules(ep, fmt, dtype, ort, cc):
    model = paged_model(dtype=dtype)
    report = check_kv_cache_support(model, ep, fmt, "per_channel", runtime_version=ort, compute_capability=cc)
    want = paged_expected_reasons(ep, fmt, dtype, ort)
    assert report.supported == (not want), report.reasons
    assert len(report.reasons) == len(want)
    for keyword, reason in zip(want, report.reasons):
        assert keyword in reason
    # fp8 paged caches have no SM gate; only int4 warns (the build option)
    assert bool(report.warnings) == (not want and fmt == "int4")


def test_paged_rows_say_what_is_documented_only():
    cuda = PAGED_CAPABILITIES["cuda"]
    assert all(s.evidence == "documented" for s in cuda.formats.values())
    assert "1.29" in cuda.formats["int8"].note and "1.29" in cuda.formats["fp8"].note
    assert cuda.formats["fp8"].min_compute_capability is None
    assert not PAGED_CAPABILITIES["cpu"].has_kernel
    assert PAGED_CAPABILITIES["webgpu"].has_kernel and not PAGED_CAPABILITIES["webgpu"].formats
    assert get_capabilities("CUDAExecutionProvider", "PagedAttention") is cuda


def test_paged_int4_conversion_warns_about_the_build_option():
    from onnx_kvcache import optimize_model

    for ep in ("cuda", None):
        model = paged_model(dtype=F16)
        with pytest.warns(RuntimeSupportWarning, match="int4 KV-cache option"):
            optimize_model(model, ep=ep, format="int4", scales={0: (0.1, 0.1)})
        assert model.graph.inputs[3].dtype == ir.DataType.UINT8


def test_paged_model_targets_cuda():
    from onnx_kvcache.capabilities.table import infer_target

    assert infer_target(paged_model(dtype=F16)) == (
        "cuda",
        "PagedAttention has no CPU kernel (CUDA runs its quantized caches)",
    )
    assert infer_target(paged_model(dtype=F32))[0] == "cuda"


def paged_quantized(heads, kv, head, fmt="int8"):
    model = paged_model(num_heads=heads, kv_heads=kv, head=head, dtype=F16, max_pos=8)
    KvCacheQuantizationPass(fmt, scales={0: (0.1, 0.2)})(model)
    return model


@pytest.mark.parametrize("group", [4, 6, 8, 16, 32])
def test_paged_fast_path_group_sizes(group):
    [report] = fast_path_diagnostics(paged_quantized(2 * group, 2, 64), ort_version="1.30.0")
    assert report.eligible and report.op == "PagedAttention"


def test_paged_fast_path_reasons_are_each_listed():
    model = paged_quantized(6, 2, 48, fmt="int4")
    [report] = fast_path_diagnostics(model, ort_version="1.30.0", compute_capability=(7, 5))
    text = " | ".join(report.reasons)
    assert not report.eligible and len(report.reasons) == 4, text
    for keyword in ("head size 48", "group size 3", "not int4", "7.5 is below 8.0"):
        assert keyword in text
    assert "share one buffer" not in text and "one tensor" not in text  # GQA-only rules


def test_cli_inspect_reports_the_paged_fast_path(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    ir.save(paged_quantized(8, 2, 64), tmp_path / "m.onnx")
    assert main(["inspect", str(tmp_path / "m.onnx"), "--ep", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "PagedAttention" in out and "layer 0: eligible" in out


@pytest.mark.parametrize(("ep", "semantics"), [("cpu", "cpu"), ("cuda", "cuda")])
def test_a_converted_model_keeps_the_target_it_was_converted_for(tmp_path, ep, semantics):
    from onnx_kvcache import KvCacheRunner, convert_model
    from onnx_kvcache.capabilities.table import infer_target

    from builders.exported import build_decoder

    ir.save(build_decoder(num_layers=1, dtype="float16"), tmp_path / "m.onnx")  # fp16: cuda by default
    out = tmp_path / f"{ep}.onnx"
    convert_model(tmp_path / "m.onnx", out, format="int8", scales={0: (0.05, 0.05)}, ep=ep)
    assert infer_target(ir.load(out)) == (ep, f"converted for {ep} (its onnx_kvcache.converted metadata)")
    assert KvCacheRunner(out).semantics == semantics


@pytest.mark.parametrize(
    ("head", "fmt", "runs"),
    [(16, "int4", False), (48, "int4", False), (32, "int4", True), (64, "int4", True), (16, "int8", True)],
)
def test_a_window_sized_cache_runs_int4_on_cpu_only_with_a_head_size_multiple_of_32(
    tmp_path, head, fmt, runs
):
    """onnxruntime 1.32's CPU kernel, at run time: "sliding_window_cache: head_size (16) must be
    a multiple of 32 for a 4-bit KV cache" (genai's builder writes such caches for Gemma-2):
    the conversion is refused where the kernel would refuse the model, and runs where it is not."""
    from onnx_kvcache import KvCacheRunner, convert_model
    from onnx_kvcache.models.decoder import DecoderConfig

    from builders.exported import build_decoder

    config = DecoderConfig(
        num_layers=2, head_size=head, sliding_window=4, sliding_window_layers=(0,), sliding_window_cache=True
    )
    model = build_decoder(config)
    report = check_kv_cache_support(model, "cpu", fmt)
    assert report.supported is runs
    if not runs:
        assert f"multiple of 32, the model's is {head}" in report.reasons[0]
        return
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    result = convert_model(
        path, tmp_path / "q.onnx", format=fmt, scales={0: (0.05, 0.05), 1: (0.05, 0.05)}, ep="cpu"
    )
    assert result.converted
    assert len(KvCacheRunner(result.model_file).generate([1, 2, 3, 4, 5, 6], 3)) == 3  # past the window
