"""benchmarks/cuda_check.py on a machine without a GPU: the plan, the preflight's exit 2,
the models it builds, and the CPU side of every comparison, with the CUDA kernel's results
replaced by onnxruntime's CPU kernel running the same graphs (int8/int4; fp8 has no CPU
kernel). What only a GPU shows (the CUDA kernels' figures) is not asserted here."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import warnings

import numpy as np
import onnx_ir as ir
import pytest

from benchmark_scripts import load
from onnx_kvcache.cache.formats import get_format

cc = load("cuda_check")
V = cc.Variant
GENAI = cc.ModelSpec("genai-fp16-h64", "float16", 64, genai=True, num_layers=2)


def small_plan(variants, models=(GENAI,)):
    return dataclasses.replace(
        cc.make_plan(quick=True),
        models=models,
        variants={m.name: variants for m in models},
        batches=(1, 2),
        prompt_len=32,
        decode_steps=4,
        speed=cc.SpeedSpec(1, 256, 8, 2, 32, 256, 300),
        speed_variants=(V(None), V("int8", "per_tensor"), V("int4", "per_channel")),
        contexts=(64, 96),
        speed_batches=(1, 2),
        speed_steps=2,
    )


@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_prints_the_plan(quick, capsys):
    assert cc.main(["--dry-run"] + ["--quick"] * quick) == 0
    out = capsys.readouterr().out
    plan = cc.make_plan(quick)
    for model in plan.models:
        assert model.name in out and f"heads of {model.head_size}" in out
    assert {m.dtype for m in plan.models} == {"float16", "bfloat16"}
    assert {m.head_size for m in plan.models} == {64, 128} and any(m.genai for m in plan.models)
    assert all(m.num_layers >= 4 for m in plan.models)
    assert f"256-token prefill + {plan.decode_steps} decode steps, batch 1 and 4" in out
    assert "layouts growing, shared" in out
    for fmt in ("fp8", "int8", "int4"):
        assert f"{fmt} per_channel" in out and f"{fmt} per_tensor" in out
    assert ("4k, 16k" if quick else "4k, 16k, 64k") in out and "batch 1 and 8" in out


def test_the_variants_are_the_cuda_rows():
    from onnx_kvcache.capabilities.table import get_capabilities

    row = get_capabilities("cuda")
    expected = {(f, g) for f, s in row.formats.items() for g in s.granularities}
    assert {(v.fmt, v.granularity) for v in cc.cuda_variants() if v.fmt and v.rotation == "none"} == expected
    rotated = [v.label for v in cc.cuda_variants() if v.rotation != "none"]
    assert row.rotation and rotated == ["int4 per_channel +keys_and_values"]  # int4's default rotation


def test_without_a_gpu_it_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    """On a machine without a GPU (made so here, whatever this machine has): the device line,
    then exit 2 with one line naming what is missing and how to install it; nothing written."""
    monkeypatch.setattr(cc, "_nvidia_smi", lambda: None)
    monkeypatch.setattr(cc, "_libcuda", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        cc.main(["--quick", "--json", str(tmp_path / "report.json")])
    assert exit_.value.code == cc.NO_DEVICE == 2
    out, err = capsys.readouterr()
    assert out.startswith("GPU: none found; compute capability ?; driver ?; onnxruntime")
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cuda_check: ")
    # onnxruntime without CUDA (this CI): how to install it; onnxruntime-gpu: the GPU is missing
    assert "pip install onnxruntime-gpu" in lines[0] or "NVIDIA GPU and its driver" in lines[0]
    assert not (tmp_path / "report.json").exists()


INFO = cc.DeviceInfo("NVIDIA H200", (9, 0), "560.35", "1.32.0", "onnxruntime-gpu")
NO_ORT = dataclasses.replace(INFO, ort_version=None)


@pytest.mark.parametrize(
    ("info", "providers", "cuda_run", "said"),
    [
        (NO_ORT, None, None, "not installed: pip install onnxruntime-gpu"),
        (INFO, ["CPUExecutionProvider"], None, "no CUDAExecutionProvider: pip uninstall -y onnxruntime"),
        (dataclasses.replace(INFO, gpu=None, ort_package="onnxruntime"), ["CPUExecutionProvider"], None,
         "no CUDA GPU (nvidia-smi and the driver library find none) and onnxruntime 1.32.0 has no "
         "CUDAExecutionProvider: on a machine with an NVIDIA GPU"),  # both missing: both said
        (dataclasses.replace(INFO, gpu=None), ["CUDAExecutionProvider"], None, "no CUDA GPU"),
        (INFO, ["CUDAExecutionProvider"], "libcudnn.so.9: cannot open", "does not run here (libcudnn.so.9"),
        (INFO, ["CUDAExecutionProvider", "CPUExecutionProvider"], None, None),
    ],
)  # fmt: skip
def test_what_is_missing(info, providers, cuda_run, said):
    found = cc.missing(info, providers, lambda: cuda_run)
    assert found == said if said is None else said in found


def test_the_device_line():
    assert (
        cc.DeviceInfo().line() == "GPU: none found; compute capability ?; driver ?; onnxruntime not installed"
    )
    assert "NVIDIA H200; compute capability 9.0; driver 560.35; onnxruntime-gpu 1.32.0" in INFO.line()


@pytest.mark.parametrize("spec", cc.make_plan().models, ids=lambda s: s.name)
def test_the_models_it_builds(spec, tmp_path):
    model, folder = cc.build_model(spec, 320, tmp_path)
    if spec.genai:
        config = json.loads((folder / "genai_config.json").read_text())
        assert config["search"]["past_present_share_buffer"] is True
        assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
        model = ir.load(folder / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == spec.num_layers >= 4
    assert (
        gqa[0].inputs[0].dtype
        == {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}[spec.dtype]
    )
    assert gqa[0].inputs[3].shape[3] == ("kv_cache_dim" if spec.genai else spec.head_size)
    assert gqa[0].attributes["num_heads"].as_int() // gqa[0].attributes["kv_num_heads"].as_int() == 4  # XQA's


def test_bf16_models_calibrate_on_cpu():
    spec = cc.ModelSpec("bf16-h64", "bfloat16", 64, num_layers=1)
    model, _ = cc.build_model(spec, 1024)
    scales = cc.calibration_scales(model, V("fp8", "per_channel"))
    assert scales.format == "fp8" and scales.granularity == "per_channel"
    assert np.all(np.asarray(scales.k[0]) > 0) and np.asarray(scales.k[0]).size == 2 * 64


def test_cpu_kernel_matches_its_emulation(tmp_path, capsys):
    """The CPU kernel stands in for CUDA's, against the same rule's emulation: every run is
    within its bound, the attention nodes ran where asked, the codes at most a step apart."""
    variants = (V(None), V("int8", "per_channel"), V("int4", "per_tensor", "keys_and_values"))
    results, ran = cc.kernel_phase(small_plan(variants), "cpu", tmp_path, rule="cpu")
    assert len(results) == 3 * 2 * 2
    assert (
        set(ran.values()) == {"ran"} and ("GroupQueryAttention", "int4", "per_tensor+keys_and_values") in ran
    )
    for r in results:
        assert not r.flagged, cc._row_text(r)
        assert r.placement_ok is None or r.placement_ok
        assert (r.code_max_steps is None) == (r.layout == "shared" or r.cache == "float")
        assert r.code_max_steps is None or r.code_max_steps <= 1
    assert [r.max_abs for r in results if r.cache == "float"] == [0.0] * 4  # the same graph, the same kernel
    assert any(r.placement_ok for r in results)
    assert "ok" in capsys.readouterr().out


def test_a_different_rule_is_flagged(tmp_path):
    """The CPU kernel against the CUDA rule (which attends the first prompt in full
    precision): the prefill step and the codes are flagged."""
    results, _ = cc.kernel_phase(small_plan((V(None), V("int8", "per_tensor"))), "cpu", tmp_path, rule="cuda")
    quantized = [r for r in results if r.cache != "float"]
    assert quantized and all(r.flagged and 0 in r.flagged_steps for r in quantized)
    assert all(not r.flagged for r in results if r.cache == "float")


def _run(steps):
    return cc.Run([np.asarray(s, np.float32) for s in steps], None, 0.0)


@pytest.mark.parametrize(("shift", "flagged"), [(0.0, []), (1e-3, []), (0.5, [1])])
def test_the_float_bound(shift, flagged):
    spec = cc.ModelSpec("m", "float16", 64)
    reference = _run([[[10.0, -3.0]], [[8.0, 1.0]]])
    kernel = _run([[[10.0, -3.0]], [[8.0 + shift, 1.0]]])
    found = cc.compare(kernel, reference, model=spec, variant=V(None), batch=1, layout="growing")
    assert found.flagged_steps == flagged
    assert found.worst_ratio == pytest.approx(shift / (2 * 4 * 2**-11 * 8.0), rel=1e-3)


def test_the_quantized_bound_allows_twice_the_quantization_error():
    spec = cc.ModelSpec("m", "bfloat16", 64)
    float_ref = _run([[[10.0, 0.0]]])
    reference = _run([[[10.3, 0.0]]])  # the emulated quantization moves the logit by 0.3
    bound = 2 * 4 * 2**-8 * 10.3 + 2 * 0.3
    for delta, flagged in ((bound * 0.99, False), (bound * 1.01, True)):
        kernel = _run([[[10.3 + delta, 0.0]]])
        found = cc.compare(
            kernel,
            reference,
            model=spec,
            variant=V("fp8"),
            batch=1,
            layout="growing",
            float_reference=float_ref,
        )
        assert found.flagged is flagged


@pytest.mark.parametrize(
    ("fmt", "dtype", "kernel", "reference", "worst", "flag"),
    [
        ("int8", "bfloat16", [3, -4, 100, 5], [3, -4, 100, 5], 0, False),
        ("int8", "bfloat16", [3, -4, 101, 5], [3, -4, 100, 5], 1, False),  # bf16 noise near full scale
        ("int8", "float16", [3, -4, 101, 5], [3, -4, 100, 5], 1, True),  # a quarter: more than fp16's
        ("int8", "bfloat16", [3, -4, 102, 5], [3, -4, 100, 5], 2, True),
        ("fp8", "float16", [0x38, 0xB8], [0x38, 0xB8], 0, False),
        ("fp8", "bfloat16", [0x39, 0xB8], [0x38, 0xB8], 1, False),
        ("fp8", "float16", [0x39, 0xB8], [0x38, 0xB8], 1, True),
        ("fp8", "bfloat16", [0x3A, 0xB8], [0x38, 0xB8], 2, True),
    ],
)
def test_stored_codes(fmt, dtype, kernel, reference, worst, flag):
    f = get_format(fmt)
    stored = np.int8 if fmt == "int8" else np.uint8
    a, b = np.array(kernel, stored), np.array(reference, stored)
    fraction, steps, _, flagged = cc.compare_codes(f, a, b, 4, dtype, 4)
    assert (steps, flagged) == (worst, flag)
    assert fraction == np.mean(a != b)


def test_int4_code_levels():
    f = get_format("int4")
    values = np.array([[-8, -1, 0, 7]], np.float32)
    packed = f.quantize(values, np.ones(1, np.float32))
    assert cc.code_levels(f, packed, 4).tolist() == values.tolist()


def test_paged_and_speed_on_cpu(tmp_path, monkeypatch):
    plan = small_plan((V(None), V("int8", "per_tensor")))
    results, ran = cc.paged_phase(plan, "cpu", rule_providers=("CPUExecutionProvider",))
    assert set(ran) == {("PagedAttention", "float", "per_tensor"), ("PagedAttention", "int8", "per_tensor")}
    assert all(not r.flagged for r in results)
    monkeypatch.setattr(cc, "device_memory_mib", lambda: 123.0)
    rows = cc.speed_phase(plan, "cpu", tmp_path)
    assert [(r.cache, r.context, r.batch) for r in rows][:4] == [
        ("float", 64, 1), ("float", 96, 1), ("float", 64, 2), ("float", 96, 2)
    ]  # fmt: skip
    assert len(rows) == 12 and all(r.tokens_per_s and r.tokens_per_s > 0 and not r.error for r in rows)
    by = {(r.cache, r.context, r.batch): r for r in rows}
    # bytes of the caches: 2 caches x batch x 2 heads x (context + 4) rows x 32 channels
    assert by[("float", 64, 2)].cache_mib * 2**20 == 2 * 2 * 2 * 68 * 32 * 2
    assert by[("int8 per_tensor", 64, 2)].cache_mib * 2 == by[("float", 64, 2)].cache_mib
    assert by[("int4 per_channel", 64, 2)].cache_mib * 4 == by[("float", 64, 2)].cache_mib
    text = cc.summary(results, rows, [])
    assert "decode speed" in text and "0 contradictions" in text


@pytest.mark.parametrize(
    ("key", "observed", "cc_", "contradiction"),
    [
        (("GroupQueryAttention", "fp8", "per_tensor"), "ran", (9, 0), False),
        (("GroupQueryAttention", "fp8", "per_tensor"), "ran", (8, 6), True),  # the table says SM 8.9+
        (("GroupQueryAttention", "fp8", "per_tensor"), "run failed: no kernel", (8, 6), False),
        (("GroupQueryAttention", "int8", "per_channel"), "session failed: NOT_IMPLEMENTED", (9, 0), True),
        (("PagedAttention", "int4", "per_tensor"), "ran", (9, 0), False),
        (("GroupQueryAttention", "int4", "per_channel+keys_and_values"), "ran", (9, 0), False),
        (("PagedAttention", "int8", "per_tensor+keys"), "ran", (9, 0), True),  # no paged rotation
    ],
)
def test_capability_claims(key, observed, cc_, contradiction):
    (claim,) = cc.capability_claims({key: observed}, "1.32.0", cc_)
    assert claim.contradiction is contradiction
    assert claim.observed == observed


def test_a_rotation_node_off_the_device_fails_the_placement(tmp_path):
    """The profile's RotaryEmbedding and MatMul-by-H nodes count with the attention nodes."""
    events = [
        {"cat": "Node", "name": f"{node}_kernel_time", "args": {"provider": provider, "op_name": op}}
        for node, op, provider in (
            ("gqa.0", "GroupQueryAttention", "CUDAExecutionProvider"),
            ("gqa.0/rotation/RotaryEmbedding_9", "RotaryEmbedding", "CUDAExecutionProvider"),
            ("gqa.0/rotation/MatMul_12", "MatMul", "CPUExecutionProvider"),
            ("/model/layers.0/mlp/MatMul", "MatMul", "CUDAExecutionProvider"),
        )
    ]
    (tmp_path / "p.json").write_text(json.dumps(events))
    placement = cc.read_placement(tmp_path / "p.json", True, "")
    assert placement.rotation == {
        "gqa.0/rotation/RotaryEmbedding_9": "CUDAExecutionProvider",
        "gqa.0/rotation/MatMul_12": "CPUExecutionProvider",
    }
    assert not placement.attention_on("CUDAExecutionProvider")


def test_the_report_is_json(tmp_path):
    row = cc.Comparison("m", "float", 1, "growing", 0.0, 0.0, 1.0, 0.0, [])
    speed = [cc.SpeedRow("float", 4096, 1, 10.0, 1.0, None)]
    claims = [cc.Claim("GroupQueryAttention", "int8 per_tensor", "runs", "ran", False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doc = cc.report(INFO, cc.make_plan(True), {"x": 1.0}, [row], speed, claims, [], True)
    assert json.loads(json.dumps(doc))["comparisons"][0]["verdict"] == "ok"


@pytest.mark.parametrize(
    "variant", [V(None), V("fp8", "per_tensor"), V("int8", "per_channel")], ids=lambda v: v.label
)
def test_bf16_references_run_on_cpu(variant, tmp_path):
    """The CPU side of every bf16 comparison: the emulated model loads (the runner and the
    emulation both compute bf16 in float32) and gives finite logits at every step."""
    spec = cc.ModelSpec("bf16-h64", "bfloat16", 64, num_layers=1)
    model, folder = cc.build_model(spec, 320)  # calibration reads 256 tokens
    qmodel, _ = cc.converted(spec, model, folder, variant, tmp_path)
    prompt, decode = cc.token_batches(2, 16, 3, spec.vocab_size)
    found = cc.reference_run(qmodel, "cuda", prompt, decode)
    assert len(found.logits) == 4 and all(s.shape == (2, spec.vocab_size) for s in found.logits)
    assert all(np.isfinite(s).all() for s in found.logits)


# --- the command: bad --json, Ctrl-C, a report that cannot be written, failures -----------------


@pytest.mark.parametrize("case", ["folder", "not ours", "device", "no parent", "empty"])
def test_a_bad_json_is_one_line_and_exit_2(case, tmp_path, capsys):
    foreign = tmp_path / "notes.json"
    foreign.write_text("[1, 2]\n")
    path, said = {
        "folder": (str(tmp_path), "is a folder"),
        "not ours": (str(foreign), "pass --overwrite to replace it"),
        "device": ("/dev/null", "not a regular file"),
        "no parent": (str(foreign / "r.json"), "is not a folder, so nothing can be written"),
        "empty": ("", "is a folder"),
    }[case]
    assert cc.main(["--json", path]) == cc.NO_DEVICE == 2  # before the preflight: no device line
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("cuda_check: ") and said in err
    assert "overwrite=True" not in err and foreign.read_text() == "[1, 2]\n"


@pytest.fixture
def on_cpu(monkeypatch):
    """main() on this machine: the preflight passes, the phases run on the CPU kernel."""
    monkeypatch.setattr(cc, "preflight", lambda: INFO)
    plan = dataclasses.replace(small_plan((V(None), V("int8", "per_tensor"))), batches=(1,), paged=False)
    monkeypatch.setattr(cc, "make_plan", lambda quick=False: plan)
    real = cc.kernel_phase
    monkeypatch.setattr(
        cc, "kernel_phase", lambda plan, device, work, **kw: real(plan, "cpu", work, rule="cpu", **kw)
    )
    return monkeypatch


def test_a_run_writes_its_report(on_cpu, tmp_path, capsys):
    path = tmp_path / "r.json"
    assert cc.main(["--json", str(path), "--skip-speed"]) == 0
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and doc["failures"] == [] and len(doc["comparisons"]) == 4
    assert {c["verdict"] for c in doc["comparisons"]} == {"ok"}
    assert [c["contradiction"] for c in doc["capabilities"]] == [False, False]
    assert f"wrote {path}" in capsys.readouterr().out
    assert cc.main(["--json", str(path), "--skip-speed"]) == 0  # its own report: replaced


def _canned(plan, device, work, failures=None, **kw):
    return [cc.Comparison("m", "float", 1, "growing", 0.0, 0.0, 1.0, 0.0, [])], {}


def _interrupt(*args, **kw):
    raise KeyboardInterrupt


def _terminate(*args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)  # a time limit (timeout(1)) stops the run


@pytest.mark.parametrize("stop", [_interrupt, _terminate])
def test_sigterm_is_ctrl_c(stop, on_cpu, tmp_path, capsys):
    """Stopped in the speed phase: exit 130, one line, the earlier phases kept, the working
    folder removed, SIGTERM's handler restored."""
    before = signal.getsignal(signal.SIGTERM)
    on_cpu.setattr(cc, "kernel_phase", _canned)
    on_cpu.setattr(cc, "speed_phase", stop)
    on_cpu.setattr(cc.tempfile, "tempdir", str(tmp_path))
    assert cc.main(["--json", str(tmp_path / "r.json")]) == 130
    assert capsys.readouterr().err.startswith("cuda_check: interrupted; the phases that ended are in ")
    assert json.loads((tmp_path / "r.json").read_text())["complete"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("where", ["kernel_phase", "paged_phase"])
def test_ctrl_c(where, on_cpu, tmp_path, capsys):
    """Ctrl-C: exit 130 and one line; the phases that ended are in the report, marked
    incomplete (a time limit that kills the run leaves them too)."""
    plan = dataclasses.replace(small_plan((V(None),)), paged=True)
    on_cpu.setattr(cc, "make_plan", lambda quick=False: plan)
    on_cpu.setattr(cc, "kernel_phase", _canned)
    on_cpu.setattr(cc, where, _interrupt)
    path = tmp_path / "r.json"
    assert cc.main(["--json", str(path)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cuda_check: interrupted; ")
    if where == "kernel_phase":
        assert not path.exists() and "no report written" in err
    else:
        doc = json.loads(path.read_text())
        assert doc["complete"] is False and len(doc["comparisons"]) == 1 and str(path) in err


def test_a_report_that_cannot_be_written_goes_elsewhere(on_cpu, tmp_path, capsys):
    """The --json folder becomes a file during the run (a vanished one is created again): the
    report of minutes of work is kept in a new temporary file, named on one line, and the exit
    status says the argument failed."""
    folder = tmp_path / "out"
    folder.mkdir()

    def vanish(*args, **kw):
        folder.rmdir()
        folder.write_text("not a folder any more")
        return _canned(*args, **kw)

    on_cpu.setattr(cc, "kernel_phase", vanish)
    assert cc.main(["--json", str(folder / "r.json"), "--skip-speed"]) == cc.NO_DEVICE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"cuda_check: cannot write {folder / 'r.json'} (")
    kept = pathlib.Path(err[0].rsplit(" ", 1)[1])
    assert json.loads(kept.read_text())["complete"] is True
    kept.unlink()
    kept.parent.rmdir()


def test_failures_are_reported_and_each_layout_tried(tmp_path, monkeypatch):
    """fp8 has no CPU kernel: its session fails in both layouts (the second is still tried),
    the cell records the failure, the failures are listed; a CPU side that fails is a
    failure but says nothing about the device."""
    plan = dataclasses.replace(
        small_plan((V(None), V("fp8", "per_tensor"), V("int8", "per_tensor"))), batches=(1,)
    )
    real = cc.reference_run

    def reference(model, rule, prompt, decode):
        if any(
            n.attributes.get("k_quant_type") and n.inputs[3].dtype == ir.DataType.INT8 for n in model.graph
        ):
            raise RuntimeError("the CPU side broke")
        return real(model, rule, prompt, decode)

    monkeypatch.setattr(cc, "reference_run", reference)
    failures: list[str] = []
    results, ran = cc.kernel_phase(plan, "cpu", tmp_path, rule="cpu", failures=failures)
    assert ran[("GroupQueryAttention", "float", "per_tensor")] == "ran"
    assert ran[("GroupQueryAttention", "fp8", "per_tensor")].startswith("session failed: ")
    assert ("GroupQueryAttention", "int8", "per_tensor") not in ran
    assert [f.split(":")[0].removeprefix("genai-fp16-h64 ") for f in failures] == [
        "fp8 per_tensor growing", "fp8 per_tensor shared", "int8 per_tensor"
    ]  # fmt: skip
    assert "CPU side not prepared: the CPU side broke" in failures[2]
    assert len(results) == 2  # the float cache, both layouts
    text = cc.summary(results, [], [], failures)
    assert "3 failed (no comparison):" in text and text.count("  FAILED ") == 3


def test_a_layout_that_runs_makes_the_cell_run(tmp_path, monkeypatch):
    """One layout failing beside one that runs: the cell ran (no table contradiction), the
    failing layout is a failure line."""
    real = cc.DeviceDecoder.run

    def growing_fails(self, prompt, decode, shared, keep_codes=False):
        if not shared:
            raise RuntimeError("growing broke")
        return real(self, prompt, decode, shared, keep_codes)

    monkeypatch.setattr(cc.DeviceDecoder, "run", growing_fails)
    failures: list[str] = []
    plan = dataclasses.replace(small_plan((V("int8", "per_tensor"),)), batches=(1,))
    results, ran = cc.kernel_phase(plan, "cpu", tmp_path, rule="cpu", failures=failures)
    assert ran == {("GroupQueryAttention", "int8", "per_tensor"): "ran"}
    assert [r.layout for r in results] == ["shared"] and len(failures) == 1 and "growing broke" in failures[0]


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT8E4M3FN, ir.DataType.BFLOAT16, ir.DataType.INT8])
def test_fill_zeros(dtype):
    """A fresh cache is zeroed in place, as onnxruntime-genai zeroes its shared buffers (fp8
    and bf16: types numpy lacks, copied from an OrtValue)."""
    import onnxruntime as ort

    from onnx_kvcache.model_io._sessions import host_array, to_ort_value

    value = to_ort_value(np.ones((2, 3), dtype.numpy()), dtype, "cpu")
    assert cc.fill_zeros(ort, value, (2, 3), dtype)
    assert not host_array(value).any()
