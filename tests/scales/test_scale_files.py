"""Scale files: every variant of the format, every malformed case, round trips."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from onnx_kvcache import KvCacheScales, load_kv_cache_scale_file
from onnx_kvcache.cache.formats import SCALE_GRANULARITIES, ScaleGranularity
from onnx_kvcache.errors import KvCacheError

from conftest import gqa_nodes


def write(tmp_path, doc, name="scales.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_genai_format_with_layer_ids_and_qmax(tmp_path):
    path = write(
        tmp_path,
        {
            "scales": {"k_scales": [[0.0019], [0.0022]], "v_scales": [[0.0018], [0.002]]},
            "qmax": 448.0,
            "layer_ids": [0, 5],
        },
    )
    scales = load_kv_cache_scale_file(path)
    assert scales.layer_ids == (0, 5) and scales.qmax == 448.0
    k, v = scales.for_layer(5)
    assert k.dtype == np.float32 and k.tolist() == pytest.approx([0.0022])
    assert v.tolist() == pytest.approx([0.002])


def test_flat_legacy_form_numbers_per_layer(tmp_path):
    scales = load_kv_cache_scale_file(
        write(tmp_path, {"scales": {"k_scales": [0.1, 0.2], "v_scales": [0.3, 0.4]}})
    )
    assert scales.layer_ids == (0, 1) and scales.for_layer(1)[1].tolist() == pytest.approx([0.4])
    assert scales.qmax is None and scales.granularity is None  # the file does not say


def test_per_channel_lists(tmp_path):
    doc = {"scales": {"k_scales": [[0.1] * 8, [0.2] * 8], "v_scales": [[0.3] * 8, [0.4] * 8]}}
    scales = load_kv_cache_scale_file(write(tmp_path, doc))
    assert scales.granularity is None and scales.for_layer(0)[0].shape == (8,)
    stated = load_kv_cache_scale_file(write(tmp_path, {**doc, "granularity": "per_channel"}, "pc.json"))
    assert stated.granularity == "per_channel"


@pytest.fixture
def per_head(monkeypatch):
    """A test-only granularity row: nothing but the table knows it."""
    monkeypatch.setitem(
        SCALE_GRANULARITIES, "per_head", ScaleGranularity("per_head", "PER_HEAD", True, False)
    )


def test_the_granularity_is_recorded_not_guessed_from_sizes(tmp_path, per_head):
    """Two elements a layer may be per head or per channel: only the maker knows."""
    scales = KvCacheScales.from_mapping({0: ([0.1, 0.2], [0.3, 0.4])}, format="int8", granularity="per_head")
    assert scales.granularity == "per_head" and scales.retarget("int4").granularity == "per_head"
    scales.save(tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())["granularity"] == "per_head"
    assert load_kv_cache_scale_file(tmp_path / "s.json").granularity == "per_head"
    unknown = KvCacheScales.from_mapping({0: ([0.1, 0.2], [0.3, 0.4])})
    unknown.save(tmp_path / "u.json")
    assert "granularity" not in json.loads((tmp_path / "u.json").read_text())
    assert load_kv_cache_scale_file(tmp_path / "u.json").granularity is None
    with pytest.raises(KvCacheError, match=r"Unknown scale granularity 'per_row'; choose one of .*per_head"):
        KvCacheScales.from_mapping({0: (0.1, 0.1)}, granularity="per_row")
    with pytest.raises(KvCacheError, match="per_tensor, one element each, but have 2"):
        KvCacheScales.from_mapping({0: ([0.1, 0.2], [0.3, 0.4])}, granularity="per_tensor")


@pytest.mark.parametrize(("target", "factor"), [("fp8", 1.0), ("int8", 448 / 128), ("int4", 448 / 8)])
def test_retargeting_by_qmax(tmp_path, target, factor):
    path = write(tmp_path, {"scales": {"k_scales": [[1.0]], "v_scales": [[0.5]]}, "qmax": 448.0})
    scales = load_kv_cache_scale_file(path, format=target)
    assert scales.format == target and scales.qmax == {"fp8": 448, "int8": 128, "int4": 8}[target]
    assert scales.for_layer(0)[0][0] == pytest.approx(factor)
    assert scales.for_layer(0)[1][0] == pytest.approx(0.5 * factor)


def test_sections_per_model_file(tmp_path):
    doc = {
        "model": {"scales": {"k_scales": [1.0], "v_scales": [2.0]}},
        "vision": {"scales": {"k_scales": [3.0], "v_scales": [4.0]}},
    }
    path = write(tmp_path, doc)
    assert load_kv_cache_scale_file(path, model="vision").for_layer(0)[0][0] == 3.0
    with pytest.raises(KvCacheError, match=r"several model files.*model, vision"):
        load_kv_cache_scale_file(path)
    single = write(tmp_path, {"model": doc["model"]}, "one.json")
    assert load_kv_cache_scale_file(single).for_layer(0)[1][0] == 2.0


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("channels", [1, 6])
def test_save_load_round_trip(tmp_path, fmt, channels):
    rng = np.random.default_rng(0)
    scales = KvCacheScales(
        {i: rng.uniform(0.01, 1, channels) for i in (0, 3, 7)},
        {i: rng.uniform(0.01, 1, channels) for i in (0, 3, 7)},
        format=fmt,
        metadata={"method": "minmax"},
    )
    path = tmp_path / "out.json"
    scales.save(path)
    doc = json.loads(path.read_text())
    assert doc["layer_ids"] == [0, 3, 7] and doc["format"] == fmt and doc["method"] == "minmax"
    again = load_kv_cache_scale_file(path)
    assert again.layer_ids == scales.layer_ids and again.format == fmt and again.qmax == scales.qmax
    for i in scales.layer_ids:
        np.testing.assert_array_equal(again.for_layer(i)[0], scales.for_layer(i)[0])
        np.testing.assert_array_equal(again.for_layer(i)[1], scales.for_layer(i)[1])


def mobius_accepts(doc: dict) -> bool:
    """mobius's ``--kv-cache-scale-file`` rule, replicated from its loader: onnxruntime/mobius
    ``src/mobius/_passes/_fp8_kv_cache.py`` (commit 78437cd0), ``load_kv_cache_scale_file`` and
    ``_validate_scales``: ``scales.k_scales`` and ``scales.v_scales`` are JSON arrays of equal
    length, entry i is layer i, and each entry is ``float(entry)``, finite and > 0 (a list
    such as ``[0.0072]`` raises TypeError there: refused)."""
    try:
        k_scales, v_scales = doc["scales"]["k_scales"], doc["scales"]["v_scales"]
    except (KeyError, TypeError):
        return False
    if not isinstance(k_scales, list) or not isinstance(v_scales, list) or len(k_scales) != len(v_scales):
        return False
    for k, v in zip(k_scales, v_scales):
        try:
            k_f, v_f = float(k), float(v)
        except (TypeError, ValueError):
            return False
        if not (math.isfinite(k_f) and k_f > 0.0 and math.isfinite(v_f) and v_f > 0.0):
            return False
    return True


def genai_builder_reads(doc: dict, scale_size: int) -> list[np.ndarray]:
    """onnxruntime-genai 0.18's builder (``models/builders/base.py``, ``make_kv_cache_scale``):
    each entry as ``np.asarray(entry, float32).reshape(-1)`` of the scale size."""
    entries = doc["scales"]["k_scales"] + doc["scales"]["v_scales"]
    arrays = [np.asarray(entry, dtype=np.float32).reshape(-1) for entry in entries]
    assert all(a.size == scale_size for a in arrays)
    return arrays


def test_mobius_rule_as_replicated_refuses_the_nested_form():
    """The replica's own check: the form issue 32 saw mobius refuse, and the one it takes."""
    assert not mobius_accepts({"scales": {"k_scales": [[0.0072]], "v_scales": [[0.0081]]}})
    assert mobius_accepts({"scales": {"k_scales": [0.0072], "v_scales": [0.0081]}})
    assert not mobius_accepts({"scales": {"k_scales": [0.1, 0.0], "v_scales": [0.3, 0.4]}})


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_per_tensor_scales_are_written_as_numbers_every_reader_takes(tmp_path, fmt):
    scales = KvCacheScales(
        {0: [0.0072], 1: [0.0081]}, {0: [0.0065], 1: [0.0093]}, format=fmt, granularity="per_tensor"
    )
    scales.save(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["scales"] == {"k_scales": [0.0072, 0.0081], "v_scales": [0.0065, 0.0093]}
    assert mobius_accepts(doc)
    assert [a.tolist() for a in genai_builder_reads(doc, 1)] == [
        [np.float32(x)] for x in (0.0072, 0.0081, 0.0065, 0.0093)
    ]
    again = load_kv_cache_scale_file(tmp_path / "s.json")
    assert again.to_json() == scales.to_json() and again.granularity == "per_tensor"


def test_per_channel_scales_stay_a_list_per_layer(tmp_path):
    scales = KvCacheScales(
        {0: [0.1, 0.2, 0.3, 0.4]}, {0: [0.5, 0.6, 0.7, 0.8]}, format="int8", granularity="per_channel"
    )
    scales.save(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["scales"]["k_scales"] == [[0.1, 0.2, 0.3, 0.4]]
    assert not mobius_accepts(doc)  # mobius takes per-tensor fp8 scales only
    assert genai_builder_reads(doc, 4)[1].tolist() == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert load_kv_cache_scale_file(tmp_path / "s.json").to_json() == scales.to_json()


@pytest.mark.parametrize(
    "entries",
    [[[0.0072], [0.0081]], [0.0072, 0.0081], [[0.0072], 0.0081]],
    ids=["nested (genai's calibrator)", "flat", "mixed"],
)
def test_every_per_tensor_form_reads_the_same(tmp_path, entries):
    path = write(tmp_path, {"scales": {"k_scales": entries, "v_scales": entries}, "qmax": 448.0})
    scales = load_kv_cache_scale_file(path)
    assert [scales.for_layer(i)[0].tolist() for i in (0, 1)] == [[np.float32(0.0072)], [np.float32(0.0081)]]
    scales.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["scales"]["k_scales"] == [0.0072, 0.0081]


MALFORMED = {
    "invalid JSON": ("{not json", "not valid JSON"),
    "top level list": ([1, 2], "top level must be an object"),
    "no scales key": ({"k_scales": [1.0]}, "no 'scales' key"),
    "scales not object": ({"scales": [1.0]}, "'scales' must be an object"),
    "missing v": ({"scales": {"k_scales": [1.0]}}, "no 'v_scales'"),
    "k not list": ({"scales": {"k_scales": 1.0, "v_scales": [1.0]}}, "'k_scales' must be a non-empty list"),
    "empty list": ({"scales": {"k_scales": [], "v_scales": []}}, "non-empty list"),
    "string entry": ({"scales": {"k_scales": ["a"], "v_scales": [1.0]}}, r"'k_scales'\[0\] must be a number"),
    "bool entry": ({"scales": {"k_scales": [True], "v_scales": [1.0]}}, "must be a number"),
    "nested too deep": ({"scales": {"k_scales": [[[1.0]]], "v_scales": [[1.0]]}}, "must be a number"),
    "unequal lengths": (
        {"scales": {"k_scales": [1.0, 2.0], "v_scales": [1.0]}},
        "2 entries but 'v_scales' has 1",
    ),
    "zero": ({"scales": {"k_scales": [0.0], "v_scales": [1.0]}}, "finite and > 0"),
    "negative": ({"scales": {"k_scales": [1.0], "v_scales": [-1.0]}}, "finite and > 0"),
    "nan": (
        '{"scales": {"k_scales": [NaN], "v_scales": [1.0]}}',
        "NaN, which is not JSON \\(numbers must be finite\\)",
    ),
    "infinite": ('{"scales": {"k_scales": [Infinity], "v_scales": [1.0]}}', "Infinity, which is not JSON"),
    "layer ids length": (
        {"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "layer_ids": [0, 1]},
        "'layer_ids' has 2",
    ),
    "duplicate layer ids": (
        {"scales": {"k_scales": [1.0, 1.0], "v_scales": [1.0, 1.0]}, "layer_ids": [2, 2]},
        r"repeats \[2\]",
    ),
    "negative layer id": ({"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "layer_ids": [-1]}, ">= 0"),
    "layer id not int": (
        {"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "layer_ids": ["0"]},
        "list of integers",
    ),
    "k/v element counts": (
        {"scales": {"k_scales": [[1.0, 2.0]], "v_scales": [[1.0]]}},
        "2 k scales but 1 v scales",
    ),
    "ragged layers": (
        {"scales": {"k_scales": [[1.0, 2.0], [1.0]], "v_scales": [[1.0, 2.0], [1.0]]}},
        "different element counts",
    ),
    "per tensor with lists": (
        {"scales": {"k_scales": [[1.0, 2.0]], "v_scales": [[1.0, 2.0]]}, "granularity": "per_tensor"},
        "per_tensor, one element each, but have 2",
    ),
    "bad qmax": (
        {"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "qmax": 0},
        "'qmax' must be a number from 1 to 65504",
    ),
    "bad granularity": (
        {"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "granularity": "per_row"},
        "Unknown scale granularity 'per_row'",
    ),
    "bad format": (
        {"scales": {"k_scales": [1.0], "v_scales": [1.0]}, "format": "fp4"},
        "Unknown KV-cache format",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_name_the_file_and_the_problem(tmp_path, case):
    doc, message = MALFORMED[case]
    path = write(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as info:
        load_kv_cache_scale_file(path)
    assert str(path) in str(info.value)


def test_missing_file_or_a_folder(tmp_path):
    with pytest.raises(KvCacheError, match=r"nope\.json is missing; give the path of a JSON scale file"):
        load_kv_cache_scale_file(tmp_path / "nope.json")
    with pytest.raises(KvCacheError, match="is a folder, not a JSON file"):
        load_kv_cache_scale_file(tmp_path)


def test_for_layer_unknown_and_mapping_errors():
    scales = KvCacheScales.from_mapping({1: (0.1, 0.2)})
    with pytest.raises(KvCacheError, match="No scales for layer 0"):
        scales.for_layer(0)
    with pytest.raises(KvCacheError, match=r"\(k_scale, v_scale\) pair"):
        KvCacheScales.from_mapping({0: 0.1})
    with pytest.raises(KvCacheError, match="same granularity"):
        KvCacheScales.from_mapping({0: ([0.1, 0.2], 0.1)})


def test_a_saved_file_holds_the_shortest_decimals_that_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    k = {i: rng.uniform(1e-4, 1.0, 64).astype(np.float32) for i in range(2)}
    scales = KvCacheScales(k, {i: a * 2 for i, a in k.items()}, format="int8", granularity="per_channel")
    scales.save(tmp_path / "s.json")
    text = (tmp_path / "s.json").read_text()
    assert all(len(number) <= 12 for number in re.findall(r"\d\.\d+(?:e-?\d+)?", text))
    loaded = load_kv_cache_scale_file(tmp_path / "s.json")
    assert all(np.array_equal(loaded.k[i], k[i]) and np.array_equal(loaded.v[i], 2 * k[i]) for i in k)
    assert loaded.granularity == "per_channel"
    assert repr(scales) == "KvCacheScales(2 layers, format='int8', granularity='per_channel', scales " + (
        f"{min(a.min() for a in k.values()):.3g}..{max(2 * a.max() for a in k.values()):.3g})"
    )


def test_layer_ids_may_be_digit_strings_as_json_gives():
    from onnx_kvcache.scales.files import as_kv_cache_scales

    scales = as_kv_cache_scales({"0": (0.1, 0.2), "1": (0.3, 0.4)})
    assert scales.layer_ids == (0, 1) and scales.k[1].item() == np.float32(0.3)
    with pytest.raises(KvCacheError, match=r"Layer id 'x' must be an integer from 0"):
        as_kv_cache_scales({"x": (0.1, 0.2)})


@pytest.mark.parametrize("given", ["file", "folder"])
@pytest.mark.parametrize("stem", ["model", "vision", "decoder"])
def test_convert_reads_the_section_named_after_the_model_files_stem(tmp_path, capsys, stem, given):
    """As onnxruntime-genai does: a file of one section per model file gives the converted
    model the section of its own file's stem, from Python and the CLI alike."""
    import onnx_ir as ir

    from onnx_kvcache.cli.commands import main
    from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

    sections = {"model": (0.02, 0.03), "vision": (0.04, 0.05)}
    doc = {
        name: {"scales": {"k_scales": [k, k], "v_scales": [v, v]}, "qmax": 128.0}
        for name, (k, v) in sections.items()
    }
    path = write(tmp_path, doc)
    if given == "folder":
        folder = save_genai_folder(tmp_path / "in", num_layers=2)
        (folder / "model.onnx").rename(folder / f"{stem}.onnx")
        config = json.loads((folder / "genai_config.json").read_text())
        config["model"]["decoder"]["filename"] = f"{stem}.onnx"
        (folder / "genai_config.json").write_text(json.dumps(config))
        source = folder
    else:
        source = tmp_path / f"{stem}.onnx"
        ir.save(build_decoder(num_layers=2, vocab_size=300), source)
    out = tmp_path / ("out" if given == "folder" else "out.onnx")
    code = main(["convert", str(source), str(out), "--format", "int8", "--scales", str(path), "--ep", "cpu"])
    if stem not in sections:
        assert code != 0
        err = capsys.readouterr().err
        assert "named after its file's stem (none is named 'decoder'" in err
        return
    assert code == 0
    converted = ir.load(next(out.glob("*.onnx")) if out.is_dir() else out)
    node = gqa_nodes(converted)[0]
    assert node.inputs[12].const_value.numpy().tolist() == [np.float32(sections[stem][0])]


@pytest.mark.parametrize(
    ("made", "target", "note"),
    [
        ("int8", "int4", "made for int8 (qmax 128) and are retargeted to int4 (qmax 8): each scale times 16"),
        (
            "fp8",
            "int8",
            "made for fp8 (qmax 448) and are retargeted to int8 (qmax 128): each scale times 3.5",
        ),
        ("int8", "int8", None),
    ],
)
def test_retargeted_scales_are_said_once(made, target, note, caplog):
    import logging

    from onnx_kvcache.scales.files import as_kv_cache_scales

    scales = KvCacheScales.from_mapping({0: (0.01, 0.02)}, format=made)
    with caplog.at_level(logging.WARNING, logger="onnx_kvcache.scales.files"):
        retargeted = as_kv_cache_scales(scales, format=target)
        as_kv_cache_scales(retargeted, format=target)  # the pass's call: already retargeted
    said = [r.getMessage() for r in caplog.records if "retargeted" in r.getMessage()]
    assert len(said) == (note is not None) and all(note in line for line in said)
