"""The real producers as the oracle (issue 28, part 2): every file of tests/data/producers/.

Each file either fuses every layer and computes as the export does (logits, and each row's
real tokens' cache entries, within 1e-4: one row with a 7-token prefill and 3 decode steps; a
batch of 2 with the second row left-padded by 3; for windowed models a prefill longer than the
window; a padded row of an export mixing rolling and full-length caches, which no one mask
serves, as the full-length export of the same saved model), then converts to int8 that
onnxruntime's CPU kernel runs and to fp8 that the CUDA-rule emulation evaluates; or it is
refused in one line that names what the graph does. The outcome of each is its row of
:data:`producers.EXPECTED`; float16 files (GroupQueryAttention in float16 runs on CUDA only)
are checked structurally: fused, then converted to fp8 for CUDA.
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import numpy as np
import pytest
from producers import CONVERTS, EXPECTED, MANIFEST, ROOT, entries, model_path, outcome, render_support_table

from decoding import generate, max_differences
from onnx_kvcache import KvCacheQuantizationPass
from onnx_kvcache.cache.rolling import split_window_lengths
from onnx_kvcache.model_io.reading import load_model
from onnx_kvcache.passes.kv_cache_emulation import emulate_kv_cache
from onnx_kvcache.pipeline.decision import carry_out

ENTRIES = entries()
TOLERANCE = 1e-4


def _id(entry) -> str:
    return entry["path"]


def _scenarios(entry) -> dict[str, np.ndarray]:
    """Attention masks of the prompts each file runs (then 3 decode steps each)."""
    masks = {"single": np.ones((1, 7), np.int64), "left_padded": np.array([[1] * 7, [0] * 3 + [1] * 4])}
    window = entry["config"].get("window")
    if window:
        masks["past_the_window"] = np.ones((1, window + 5), np.int64)
    return masks


@pytest.fixture(scope="module", params=ENTRIES, ids=_id)
def decided(request):
    """``(entry, outcome line, decision)``: the file converted to int8 for CPU (fp16: fp8 for CUDA)."""
    entry = request.param
    line, decision = outcome(entry)
    return entry, line, decision


def test_the_manifest_and_the_expectations_name_the_same_files():
    assert MANIFEST.exists(), f"{MANIFEST} is missing: the producers' files are part of the test data"
    paths = [e["path"] for e in ENTRIES]
    assert sorted(paths) == sorted(EXPECTED), "add or remove rows of producers.EXPECTED"
    assert all(model_path(e).exists() for e in ENTRIES)


def test_each_file_has_its_recorded_outcome(decided):
    entry, line, _ = decided
    assert "\n" not in line
    assert line == EXPECTED[entry["path"]]


def _float_file(entry) -> bool:
    return all(v["type"] != "float16" for v in entry["inputs"])


def test_a_converting_file_fuses_every_layer(decided):
    entry, line, decision = decided
    if line != CONVERTS:
        assert not decision.converted
        return
    layers = entry["config"]["layers"]
    gqa = [n for n in decision.model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers and decision.fusion.fused in (0, layers)
    checked = decision.fusion.verification  # the export and its fusion side by side (translation validation)
    if decision.fusion.fused and "sliding_window_cache" not in str(gqa[0].attributes):
        assert checked is not None and checked.verified, checked
        assert checked.error < (1e-5 if _float_file(entry) else 1e-2), checked
    elif decision.fusion.fused:
        assert checked is not None and not checked.verified and checked.skipped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert carry_out(decision)
    fmt = decision.format.dtype
    caches = [v for v in decision.model.graph.inputs if v.name.startswith("past_key_values")]
    assert len(caches) == 2 * layers and {v.dtype for v in caches} == {fmt}


@pytest.fixture(scope="module")
def runs(decided):
    """The export and its fused form over every scenario (float32 files that convert)."""
    entry, line, _ = decided
    if line != CONVERTS or not _float_file(entry):
        return None
    _, decision = outcome(entry)  # a fresh fusion: the decision above was carried out
    if not decision.fusion.fused:  # a build with GroupQueryAttention already: nothing fused to check
        return None
    original = load_model(model_path(entry))
    fused = decision.model
    mixed = bool(split_window_lengths(original.graph))  # declared as the fused model declares it
    results = {}
    for name, mask in _scenarios(entry).items():
        # the export given its caches' columns of the mask (a rolling window cache reads its own:
        # docs/exporting.md, Rolling window caches; for full-length caches that is the whole mask);
        # with rolling and full caches no one mask serves both: a padded row is compared with the
        # full-length export of the same saved model
        want = _full_length(entry) if mixed and not mask.all() else original
        results[name] = (generate(want, mask, cache_columns=not mixed), generate(fused, mask))
    return fused, results


def _full_length(entry):
    """The export with full-length caches (``DynamicCache()``) made from the same saved model."""
    path = entry["path"].replace("-rollingcache/", "/")
    return load_model(model_path(next(e for e in ENTRIES if e["path"] == path)))


def test_the_fused_model_computes_as_the_export(decided, runs):
    if runs is None:
        assert decided[1] != CONVERTS or not _float_file(decided[0]) or not decided[2].fusion.fused
        return
    _, results = runs
    for name, (want, got) in results.items():
        worst = max_differences(want, got)
        assert worst["logits"] < TOLERANCE and worst["present"] < TOLERANCE, (name, worst)


def _scales(results: dict, qmax: float) -> dict[int, tuple[float, float]]:
    """Per-tensor scales from the fused model's own caches (their max over every run)."""
    top: dict[int, list[float]] = {}
    for _, got in results.values():
        for _, outputs in got:
            for name, array in outputs.items():
                match = re.fullmatch(r"present\.(\d+)\.(key|value)", name)
                if match:
                    layer = top.setdefault(int(match[1]), [0.0, 0.0])
                    side = 0 if match[2] == "key" else 1
                    layer[side] = max(layer[side], float(np.abs(array).max()))
    return {layer: (k / qmax or 1.0, v / qmax or 1.0) for layer, (k, v) in top.items()}


@pytest.mark.parametrize(("fmt", "qmax", "tolerance"), [("int8", 127.0, 0.05), ("fp8", 448.0, 0.1)])
def test_the_converted_model_runs(decided, runs, fmt, qmax, tolerance):
    """int8 on onnxruntime's CPU kernel; fp8 through the CUDA-rule emulation."""
    if runs is None:
        assert decided[1] != CONVERTS or not _float_file(decided[0]) or not decided[2].fusion.fused
        return
    fused, results = runs
    model = fused.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert KvCacheQuantizationPass(fmt, scales=_scales(results, qmax))(model).modified
    if fmt == "fp8":
        model = emulate_kv_cache(model, "cuda")
    mask = _scenarios(decided[0])["single"]
    got = generate(model, mask)
    want = results["single"][1]
    for (_, a), (_, b) in zip(want, got):
        assert np.all(np.isfinite(b["logits"]))
        spread = float(np.abs(a["logits"]).max())
        assert float(np.abs(a["logits"] - b["logits"]).max()) < tolerance * spread


def test_the_support_table_in_docs_is_fresh():
    spec = importlib.util.spec_from_file_location("render", ROOT / "docs" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    page = (ROOT / "docs" / "exporting.md").read_text(encoding="utf-8")
    assert render_support_table() in page
    assert render.render_producers(page) == page, "docs/exporting.md is stale: run python docs/render.py"


def test_the_table_renders_every_row():
    models = [
        {"path": "a/b/llama", "producer": "p", "producer_version": "1", "form": "f", "family": "llama"},
        {"path": "a/b/x", "producer": "p", "producer_version": "1", "form": "f", "family": "x"},
    ]
    table = render_support_table(models)
    assert table.count("\n") == 3 and "| f | x | no: no expectation recorded |" in table
