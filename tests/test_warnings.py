"""errors.py's warning kinds: each a KvCacheWarning, exported and documented; every ``warn``
call in src/ names its kind; a representative trigger of each emits it, and filtering by
the class silences exactly it."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import warnings
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

import onnx_kvcache
from onnx_kvcache import (
    AttentionFusionPass,
    GqaFusionPass,
    KvCacheQuantizationPass,
    KvCacheRunner,
    calibrate_kv_cache,
    convert_model,
    evaluate_kv_cache,
    optimize_model,
)
from onnx_kvcache import errors as E
from onnx_kvcache.models.decoder import save_genai_folder
from onnx_kvcache.scales.files import KvCacheScales

from builders.exported import build_decoder, exported_config
from conftest import gqa_model, paged_model

ROOT = pathlib.Path(__file__).parents[1]
EXPORT = ROOT / "tests" / "data" / "export_llama_opset23.onnx"
NAMES = {c.__name__ for c in E.WARNINGS}


def test_each_kind_is_a_kv_cache_warning_in_errors_and_documented():
    page = (ROOT / "docs" / "warnings.md").read_text()
    for kind in E.WARNINGS:
        assert issubclass(kind, E.KvCacheWarning) and kind is not E.KvCacheWarning
        assert getattr(onnx_kvcache.errors, kind.__name__) is kind and kind.__name__ in E.__all__
        assert kind.__name__ not in onnx_kvcache.__all__  # the root holds the base type only
        assert f"| `{kind.__name__}` |" in page, kind.__name__
    assert len(NAMES) == len(E.WARNINGS)
    assert set(E.WARNINGS) == set(E.KvCacheWarning.__subclasses__())


def _warn_calls() -> list[tuple[str, ast.Call]]:
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "warn":
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node))
    return found


def test_every_warn_call_names_its_kind():
    """A second argument naming a kind (or replaying a recorded warning's category), or one
    argument that is already a warning of a kind (never text alone)."""
    calls = _warn_calls()
    assert len(calls) >= 12
    for where, call in calls:
        if len(call.args) == 2:
            kind = call.args[1]
            assert (isinstance(kind, ast.Name) and kind.id in NAMES) or (
                isinstance(kind, ast.Attribute) and kind.attr == "category"
            ), where
        else:
            assert len(call.args) == 1 and isinstance(call.args[0], ast.Name), where  # an instance
    made = [
        node.func.id
        for path in (ROOT / "src").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Warning")
    ]
    assert set(made) <= NAMES | {"KvCachePreconditionError"}, set(made) - NAMES


def test_pytest_filters_warnings_by_class(pytestconfig):
    entries = pytestconfig.getini("filterwarnings")
    assert len(entries) >= 2
    for entry in entries:
        _, message, category = entry.split(":")[:3]
        assert message == "", entry  # no message text
        assert category.rpartition(".")[2] in NAMES | {"KvCacheWarning"}, entry


def _padded_export() -> None:
    GqaFusionPass()(ir.load(EXPORT))


def _unprovable_export() -> None:
    model = ir.load(EXPORT)
    first = next(n for n in model.graph if n.op_type == "Attention")
    first.attributes["scale"] = ir.AttrFloat32("scale", float("nan"))
    AttentionFusionPass()(model)


def _cache_from_a_node() -> None:
    model = gqa_model(layers=2)
    node = [n for n in model.graph if n.op_type == "GroupQueryAttention"][1]
    copy = ir.Node("", "Identity", [node.inputs[3]], num_outputs=1, name="copy_cache")
    model.graph.insert_before(node, copy)
    node.replace_input_with(3, copy.outputs[0])
    KvCacheQuantizationPass("int8", scales={0: (0.1, 0.1), 1: (0.1, 0.1)})(model)


def _shared_scale() -> None:
    KvCacheQuantizationPass("int8", scales={0: (1.0, 0.01)}, shared_kv_scale=True)(gqa_model())


def _mse_retargeted() -> None:
    scales = KvCacheScales.from_mapping({0: (0.1, 0.05)}, format="int8")
    dataclasses.replace(scales, metadata={"method": "mse"}).retarget("int4")


def _quantized_baseline() -> None:
    model = build_decoder(num_layers=2, vocab_size=300, dtype="float16")
    KvCacheQuantizationPass("int8", scales={0: (0.05, 0.02), 1: (0.05, 0.02)})(model)
    evaluate_kv_cache(model, model, [list(range(24))], max_new_tokens=1, prompt_len=8)


def _fp8_under_cpu_rule() -> None:
    model = build_decoder(num_layers=1, vocab_size=300, dtype="float16")
    KvCacheQuantizationPass("fp8", scales={0: (0.05, 0.02)})(model)
    KvCacheRunner(model, semantics="cpu")


def _linked(tmp_path: pathlib.Path) -> None:
    src = save_genai_folder(tmp_path / "in", num_layers=2, vocab_size=300)
    ir.save(ir.load(src / "model.onnx"), src / "model.onnx", external_data="model.onnx.data")
    convert_model(
        src, tmp_path / "out", format="int8", scales={0: (0.1, 0.05), 1: (0.1, 0.05)}, weights="link"
    )


def _genai_for_openvino(tmp_path: pathlib.Path) -> None:
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300, dtype="float16")
    convert_model(
        folder, tmp_path / "o", format="int8", scales={0: (0.1, 0.05), 1: (0.1, 0.05)}, ep="openvino"
    )


def _short_context_scales(tmp_path: pathlib.Path) -> None:
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)  # context_length 4096
    scales = KvCacheScales.from_mapping({0: (0.5, 0.2), 1: (0.5, 0.2)}, format="int4")
    scales = dataclasses.replace(scales, metadata={"rope_positions": 512})
    convert_model(folder, tmp_path / "o", scales=scales, ep="cpu")


CALIBRATION_DATA = [list(np.random.default_rng(3).integers(0, 300, n)) for n in (300, 125, 200)]

TRIGGERS: dict[type[E.KvCacheWarning], Callable[[pathlib.Path], object]] = {
    E.NotConvertedWarning: lambda _: optimize_model(
        build_decoder(num_layers=1, dtype="float16"), ep="cpu", fp8_kv_cache=True
    ),
    E.PaddingAssumptionWarning: lambda _: _padded_export(),
    E.FusionSkippedWarning: lambda _: _unprovable_export(),
    E.SkippedNodeWarning: lambda _: _cache_from_a_node(),
    E.UnitScalesWarning: lambda _: KvCacheQuantizationPass("fp8")(build_decoder(num_layers=2)),
    E.ScalesAdjustedWarning: lambda _: (_shared_scale(), _mse_retargeted()),
    E.CalibrationDataWarning: lambda _: calibrate_kv_cache(
        build_decoder(num_layers=2, vocab_size=300), format="int8", seq_len=32, progress=False
    ),
    E.ClippingWarning: lambda _: calibrate_kv_cache(
        build_decoder(num_layers=2, vocab_size=300),
        CALIBRATION_DATA,
        format="int8",
        margin=1e-50,
        progress=False,
    ),
    E.ContextLengthWarning: _short_context_scales,
    E.MeasurementWarning: lambda _: (_quantized_baseline(), _fp8_under_cpu_rule()),
    E.RuntimeSupportWarning: lambda _: optimize_model(
        paged_model(dtype=ir.DataType.FLOAT16), format="int4", scales={0: (0.1, 0.1)}
    ),
    E.SharedWeightsWarning: _linked,
    E.GenaiConfigWarning: _genai_for_openvino,
    E.UnfusedAttentionWarning: lambda _: KvCacheQuantizationPass("fp8")(
        build_decoder(exported_config("llama", num_layers=2))
    ),
    E.Float16AttentionWarning: lambda _: optimize_model(build_decoder(num_layers=1), fp8_kv_cache=True),
}


def _said(trigger: Callable[[], object], ignored: type[Warning] | None = None) -> list[type[Warning]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ignored is not None:
            warnings.simplefilter("ignore", ignored)
        trigger()
    return [w.category for w in caught if issubclass(w.category, E.KvCacheWarning)]


def test_every_kind_has_a_trigger():
    assert set(TRIGGERS) == set(E.WARNINGS)


@pytest.mark.parametrize("kind", list(TRIGGERS), ids=lambda kind: kind.__name__)
def test_each_site_says_its_kind_and_filtering_it_silences_exactly_it(tmp_path, kind):
    said = _said(lambda: TRIGGERS[kind](tmp_path / "a"))
    assert kind in said, said
    others = [c for c in said if c is not kind]
    assert _said(lambda: TRIGGERS[kind](tmp_path / "b"), ignored=kind) == others


def test_a_warning_given_as_an_instance_keeps_its_kind_and_points_at_the_caller():
    with pytest.warns(E.UnitScalesWarning, match="^unit$") as caught:
        E.warn(E.UnitScalesWarning("unit"), E.ClippingWarning)  # the instance's kind wins
    assert caught[0].filename == __file__
