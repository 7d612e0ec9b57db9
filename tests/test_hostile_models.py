"""Hostile models (issue 29): every malformed model ends in one line before any work, on every
command and API that reads it; a graph out of topological order is run as its sorted twin;
arguments are checked against the model before it runs; outputs are never replaced silently.
Then a fuzz test over real-producer files: every mutant is one line, or an output onnxruntime loads."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import random
import re

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import (
    KvCacheQuantizationPass,
    KvCacheRunner,
    convert_model,
    inspect_kv_cache,
    optimize_model,
)
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import MalformedModelError
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

DATA = pathlib.Path(__file__).parent / "data"
SCALES = {0: (0.05, 0.04), 1: (0.06, 0.05)}


def run(argv: list[object]) -> tuple[int, str, str]:
    """The command in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse refuses an option's value
            code = e.code
    return code, out.getvalue(), err.getvalue()


def one_line(err: str) -> str:
    """The error line (after any warnings), the run's last: one line, no traceback."""
    lines = err.splitlines()
    assert lines and lines[-1].startswith("onnx-kvcache: error: "), err
    assert all(line.startswith("onnx-kvcache: warning: ") for line in lines[:-1]), err
    assert "Traceback" not in err
    return lines[-1]


def gqa(model: ir.Model, index: int = 1) -> ir.Node:
    return [n for n in model.graph if n.op_type == "GroupQueryAttention"][index]


def with_int(attr: str, value: int):
    def mutate(model: ir.Model) -> None:
        gqa(model).attributes[attr] = ir.AttrInt64(attr, value)

    return mutate


def without_caches(model: ir.Model) -> None:
    node = gqa(model)
    node.replace_input_with(3, None)
    node.replace_input_with(4, None)
    model.graph.inputs[:] = [v for v in model.graph.inputs if v.uses()]


def float16_scales(model: ir.Model) -> None:
    KvCacheQuantizationPass("int8", scales=SCALES)(model)
    node = gqa(model)
    for slot in (12, 13):
        value = ir.Value(
            name=f"half_{slot}", const_value=ir.tensor(np.array([0.05], np.float16), name=f"half_{slot}")
        )
        value.dtype, value.shape = ir.DataType.FLOAT16, ir.Shape([1])
        model.graph.register_initializer(value)
        node.replace_input_with(slot, value)


def without_a_node(model: ir.Model) -> None:
    """A node removed by hand (its readers left dangling)."""
    proto = ir.to_proto(model)
    victim = next(i for i, n in enumerate(proto.graph.node) if n.op_type == "MatMul")
    del proto.graph.node[victim]
    model.graph = ir.from_proto(proto).graph


def shuffled(model: ir.Model, seed: int = 0) -> None:
    """The nodes in a random order (onnxruntime runs it; graph-surgery tools write such graphs)."""
    nodes = list(model.graph)
    random.Random(seed).shuffle(nodes)
    model.graph.remove(nodes, safe=False)
    model.graph.extend(nodes)


def float_num_heads(model: ir.Model) -> None:
    gqa(model).attributes["num_heads"] = ir.AttrFloat32("num_heads", 4.0)


def reads_its_own_output(model: ir.Model) -> None:
    node = next(n for n in model.graph if n.op_type == "MatMul")
    node.replace_input_with(0, node.outputs[0])


def two_nodes_of_one_name(model: ir.Model) -> None:
    first, second = [n for n in model.graph if n.op_type == "MatMul"][:2]
    second.name = first.name


def an_output_nothing_produces(model: ir.Model) -> None:
    """A graph output no node, input or initializer defines (issue 37, row 1: a traceback)."""
    z = ir.Value(name="z", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    model.graph.outputs.append(z)


def presents_removed_from_the_node(model: ir.Model) -> None:
    """A GQA node whose present outputs were removed, the graph still listing them (row 4)."""
    proto = ir.to_proto(model)
    node = next(n for n in proto.graph.node if n.name == gqa(model).name)
    del node.output[1:]
    model.graph = ir.from_proto(proto).graph


def past_key_of_half_heads(model: ir.Model) -> None:
    gqa(model).inputs[3].shape = ir.Shape(["batch_size", 2, "past_sequence_length", 16])


#: mutant -> (mutation, what the one line says)
MALFORMED = {
    "num_heads 0": (with_int("num_heads", 0), "has num_heads=0"),
    "num_heads -3": (with_int("num_heads", -3), "has num_heads=-3"),
    "kv_num_heads 0": (with_int("kv_num_heads", 0), "has kv_num_heads=0"),
    "kv_num_heads 3": (with_int("kv_num_heads", 3), "num_heads must be a multiple of kv_num_heads"),
    "no cache inputs": (without_caches, "but has no past_key input: its cache input is missing"),
    "float16 scales": (float16_scales, "has a float16 k_scale 'half_12': scales are float32"),
    "a node removed": (without_a_node, "which no node, graph input or initializer defines"),
    # rev29: a traceback; a cyclic graph and one onnxruntime refuses written; a model failing its first run
    "float num_heads": (float_num_heads, "has num_heads of type FLOAT, where onnxruntime's schema takes INT"),
    "a node reading its own output": (reads_its_own_output, "has a cycle"),
    "two nodes of one name": (two_nodes_of_one_name, "Two nodes of the graph are named"),
    "a past key of half heads": (past_key_of_half_heads, "has heads of size 32 but its past_key"),
    # rev37: a traceback (inspect, optimize_model); an output onnxruntime refuses (convert)
    "an output nothing produces": (an_output_nothing_produces, "The graph outputs 'z', which no node"),
    "presents removed from the node": (
        presents_removed_from_the_node,
        "The graph outputs 'present.1.key', which no node",
    ),
}


def saved(folder: pathlib.Path, name: str, mutate=None) -> pathlib.Path:
    model = build_decoder(num_layers=2, vocab_size=300)
    if mutate is not None:
        mutate(model)
    path = folder / f"{name.replace(' ', '_')}.onnx"
    ir.save(model, path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_models")
    files = {name: saved(root, name, mutate) for name, (mutate, _) in MALFORMED.items()}
    files["good"] = saved(root, "good")
    files["shuffled"] = saved(root, "shuffled", shuffled)
    return files


def commands(model: pathlib.Path, good: pathlib.Path, out: pathlib.Path) -> dict[str, list[object]]:
    return {
        "inspect": ["inspect", model],
        "inspect --json": ["inspect", "--json", model],
        "convert": ["convert", model, out / "converted.onnx", "--format", "int8"],
        "calibrate": ["calibrate", model, "--out", out / "scales.json", "--num-seqs", "1", "--seq-len", "16"],
        "evaluate": ["evaluate", good, model, "--num-seqs", "1", "--seq-len", "16"],
    }


@pytest.mark.parametrize("command", ["inspect", "inspect --json", "convert", "calibrate", "evaluate"])
@pytest.mark.parametrize("mutant", list(MALFORMED))
def test_a_malformed_model_is_one_line_on_every_command_and_nothing_is_written(
    tmp_path, models, mutant, command
):
    argv = commands(models[mutant], models["good"], tmp_path)[command]
    code, out, err = run(argv)
    assert code in (1, 2)
    assert MALFORMED[mutant][1] in one_line(err) and "malformed" in err
    assert list(tmp_path.iterdir()) == [] and out == ""


@pytest.mark.parametrize("mutant", list(MALFORMED))
def test_a_malformed_model_is_a_malformed_model_error_in_python(models, mutant):
    for call in (
        inspect_kv_cache,
        KvCacheRunner,
        lambda m: optimize_model(m, format="int8", scales=SCALES),
    ):
        with pytest.raises(MalformedModelError, match=re.escape(MALFORMED[mutant][1])):
            call(ir.load(models[mutant]))


def test_a_missing_cache_is_named_not_blamed_on_the_scales(tmp_path, models):
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    code, _, err = run(["convert", models["no cache inputs"], tmp_path / "o.onnx", "--scales", scales])
    assert code in (1, 2) and "measured for another model" not in err
    assert "/model/layers.1/attn/GroupQueryAttention writes present_key 'present.1.key'" in one_line(err)


# -- issue 37, row 4: models whose conversion onnxruntime would refuse ------------------------


def _ir_version(model: ir.Model) -> None:
    model.ir_version = 99


def _opset(model: ir.Model) -> None:
    model.opset_imports[""] = 99


def _huge_heads(model: ir.Model) -> None:
    gqa(model, 0).attributes["num_heads"] = ir.AttrInt64("num_heads", 2**40)


def _mobius_gqa() -> ir.Model:
    """mobius's CPU GQA build: no shape on its packed QKV, so only the projection tells the width."""
    return ir.load(DATA / "producers" / "mobius" / "mobius-cpu-gqa" / "llama" / "model.onnx")


def _decoder() -> ir.Model:
    return build_decoder(num_layers=2, vocab_size=300)


UNLOADABLE = {  # mutant -> (base, mutation, what the one line says)
    "IR version 99": (_decoder, _ir_version, "its IR version is 99, and the installed onnxruntime"),
    "opset 99": (_decoder, _opset, "its ai.onnx opset is 99"),
    "num_heads 2**40 (mobius)": (
        _mobius_gqa,
        _huge_heads,
        "= 1099511627780, which does not divide its query's",
    ),
}


@pytest.mark.parametrize("mutant", list(UNLOADABLE))
def test_a_model_onnxruntime_would_refuse_is_never_converted(tmp_path, mutant):
    base, mutate, said = UNLOADABLE[mutant]
    model = base()
    mutate(model)
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    ir.save(model, src, external_data="model.onnx.data")
    out = tmp_path / "out"
    code, stdout, err = run(["convert", src, out / "model.onnx", "--format", "fp8", "--ep", "cuda"])
    assert code == 2 and said in one_line(err) and stdout == "" and not out.exists()
    with pytest.raises(MalformedModelError, match=re.escape(said)):
        optimize_model(ir.load(src), format="fp8", ep="cuda")
    for argv in (  # every command that reads it: one line before any work
        ["inspect", src],
        ["calibrate", src, "--out", out / "s.json", "--format", "int8"],
        ["evaluate", src, src, "--num-seqs", 1],
    ):
        code, stdout, err = run(argv)
        assert code == 2 and said in one_line(err) and stdout == "" and not out.exists()


# -- a graph out of topological order ------------------------------------------------------


def test_an_unsorted_decoder_calibrates_as_its_sorted_twin(tmp_path, models):
    argv = ["--num-seqs", "2", "--seq-len", "64", "--min-tokens", "64", "--format", "int8"]
    before = models["shuffled"].read_bytes()
    for name in ("good", "shuffled"):
        code, _, err = run(["calibrate", models[name], "--out", tmp_path / f"{name}.json", *argv])
        assert code == 0, err
    docs = [json.loads((tmp_path / f"{name}.json").read_text())["scales"] for name in ("good", "shuffled")]
    assert docs[0] == docs[1]
    assert models["shuffled"].read_bytes() == before  # the file read is never sorted


def test_an_unsorted_decoder_evaluates_against_its_sorted_twin_as_the_same_model(tmp_path, models):
    code, out, err = run(
        ["evaluate", models["good"], models["shuffled"], "--num-seqs", "1", "--seq-len", "16"]
    )
    assert code == 0, err
    assert "differ in their KV caches" not in err
    errors = re.findall(r"layer +\d+: ([0-9.e+-]+) / ([0-9.e+-]+)", out)
    assert errors and all(float(k) == 0 == float(v) for k, v in errors)


def test_an_unsorted_model_in_memory_runs_and_is_sorted_in_place(models):
    model = ir.load(models["shuffled"])
    runner = KvCacheRunner(model)
    want = KvCacheRunner(models["good"]).prefill([1, 2, 3])
    np.testing.assert_array_equal(runner.prefill([1, 2, 3]), want)
    model.clone()  # sorted: onnx-ir clones it (it refused the unsorted graph)


def test_an_unsorted_export_converts_and_its_file_is_never_touched(tmp_path):
    model = ir.load(DATA / "export_llama_opset23.onnx")
    shuffled(model, seed=3)
    src = tmp_path / "shuffled_export.onnx"
    ir.save(model, src)
    before = src.read_bytes()
    result = convert_model(
        src, tmp_path / "out.onnx", format="int8", scales=dict(enumerate([(0.05, 0.04)] * 3))
    )
    assert result.converted and src.read_bytes() == before
    create_session(str(result.model_file))


# -- outputs: validated before they are committed ----------------------------------------------


def test_an_output_the_validation_refuses_is_never_written(tmp_path, models, monkeypatch):
    """The pipeline validates what it made before writing it (here a pass gone wrong)."""
    from onnx_kvcache.pipeline import decision

    real = decision.KvCacheQuantizationPass

    class Broken(real):  # type: ignore[misc, valid-type]
        def call(self, model):
            result = super().call(model)
            gqa(model, 0).attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 3)
            return result

    monkeypatch.setattr(decision, "KvCacheQuantizationPass", Broken)
    with pytest.raises(MalformedModelError, match="kv_cache_bit_width=3"):
        convert_model(models["good"], tmp_path / "out.onnx", format="int8", scales=SCALES)
    assert list(tmp_path.iterdir()) == []


# -- arguments against the model, before any work ----------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        (
            "--max-new-tokens",
            1_000_000_000,
            ["--max-new-tokens 1000000000", "4096 positions", "--max-new-tokens 4033"],
        ),
        ("--seq-len", 5000, ["--seq-len 5000", "4096 positions", "--seq-len 4097"]),
        ("--seq-len", 99_999_999_999, ["--seq-len 99999999999", "int32 (at most 2147483647)"]),
    ],
)
def test_lengths_past_the_models_positions_are_refused_before_it_runs(
    models, monkeypatch, option, value, words
):
    def never(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(KvCacheRunner, "prefill", never)
    code, _, err = run(["evaluate", models["good"], models["good"], option, value])
    assert code in (1, 2)
    for word in words:
        assert word in one_line(err)


# -- issue 37, rows 2 and 3: sizes and counts bounded before anything is allocated ---------------


def _never(*args, **kwargs):
    raise AssertionError("the windows were made or the model ran")


BOUNDED = {  # argv after the model(s) -> what the one line says
    ("calibrate", "--seq-len", 10**12): ["--seq-len 1000000000000", "int32 (at most 2147483647)"],
    ("calibrate", "--seq-len", 5000): ["--seq-len 5000", "4096 positions", "--seq-len 4096"],
    ("calibrate", "--num-seqs", 10**9): ["This calibration would hold about", "TiB", "--num-seqs N"],
    ("evaluate", "--num-seqs", 10**9): ["This evaluation would hold about", "TiB", "--num-seqs N"],
}


@pytest.mark.parametrize("argv", list(BOUNDED), ids=lambda a: " ".join(map(str, a)))
def test_sizes_and_counts_are_bounded_before_anything_is_allocated(tmp_path, models, monkeypatch, argv):
    """Once a 7.28 TiB numpy allocation (a traceback), or memory growing until the process was killed."""
    from onnx_kvcache.calibrate import calibration
    from onnx_kvcache.runtime import evaluation

    for module in (calibration, evaluation):
        monkeypatch.setattr(module, "load_token_windows", _never)
    monkeypatch.setattr(KvCacheRunner, "fill", _never)
    command, option, value = argv
    head = (
        ["calibrate", models["good"], "--out", tmp_path / "s.json"]
        if command == "calibrate"
        else ["evaluate", models["good"], models["good"], "--max-new-tokens", 1]
    )
    code, out, err = run([*head, option, value])
    assert code == 2 and out == "" and not (tmp_path / "s.json").exists()
    for word in BOUNDED[argv]:
        assert word in one_line(err)


def test_greedy_tokens_past_any_memory_are_refused_on_a_model_without_a_rotary_table(monkeypatch):
    """An export computes its rotary angles from the positions: no context bounds
    --max-new-tokens, the caches the generation holds do."""
    monkeypatch.setattr(KvCacheRunner, "prefill", _never)
    export = DATA / "export_llama_opset23.onnx"
    code, _, err = run(
        ["evaluate", export, export, "--num-seqs", 1, "--seq-len", 16, "--max-new-tokens", 10**9]
    )
    assert code == 2 and "This evaluation would hold about" in one_line(err)
    assert "1000000008 tokens' caches" in err and "--max-new-tokens N" in err


@pytest.mark.parametrize("command", ["calibrate", "evaluate"])
def test_the_memory_limit_is_the_memory_available(tmp_path, models, monkeypatch, command):
    """The estimate is refused past what the machine has now, naming both figures."""
    from onnx_kvcache.runtime import _memory

    monkeypatch.setattr(_memory, "available_memory", lambda: 1 << 16)
    head = (
        ["calibrate", models["good"], "--out", tmp_path / "s.json", "--min-tokens", 16]
        if command == "calibrate"
        else ["evaluate", models["good"], models["good"], "--max-new-tokens", 2]
    )
    code, _, err = run([*head, "--num-seqs", 4, "--seq-len", 64])
    assert code == 2 and "more than the 64.0 KiB available; nothing was run" in one_line(err)
    monkeypatch.setattr(_memory, "available_memory", lambda: None)  # unknown: not checked
    assert run([*head, "--num-seqs", 4, "--seq-len", 64])[0] == 0


@pytest.mark.parametrize("value", ["100000000000000000000000", "2147483648", "1e23"])
def test_an_inspect_context_past_any_models_positions_is_refused(models, value):
    code, out, err = run(["inspect", models["good"], "--context", value])
    assert code == 2 and "--context" in err and out == ""


def test_the_largest_inspect_context_prints_a_short_size(models):
    code, out, _ = run(["inspect", models["good"], "--context", 2**31 - 1, "--batch", 2**20])
    assert code == 0
    sized = [line for line in out.splitlines() if line.startswith("cache for batch")]
    assert len(sized) == 1 and re.search(r"tokens: \d{1,7}\.\d PiB$", sized[0])


# -- the success summary and concurrent runs --------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "calibrate"])
def test_a_newline_in_an_output_path_prints_escaped_in_the_summary(tmp_path, models, command):
    out = tmp_path / ("a\nb.onnx" if command == "convert" else "a\nb.json")
    argv = (
        ["convert", models["good"], out, "--format", "int8", "--scales", _scales(tmp_path)]
        if command == "convert"
        else [
            "calibrate",
            models["good"],
            "--out",
            out,
            "--num-seqs",
            "1",
            "--seq-len",
            "64",
            "--min-tokens",
            "32",
        ]
    )
    code, said, err = run(argv)
    assert code == 0, err
    line = next(line for line in said.splitlines() if "a\\nb" in line)
    assert line.startswith(("converted ", "wrote ")) and "\nb." not in said


def _scales(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "scales_file.json"
    path.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    return path


@pytest.mark.parametrize("existing", [False, True])
def test_two_calibrations_to_one_out_never_both_say_wrote(tmp_path, models, monkeypatch, existing):
    """The run that finishes second finds the first's file, which appeared (or changed) while it
    worked: it is left as it is and the second run says so in one line."""
    from onnx_kvcache.calibrate import calibration

    out = tmp_path / "scales.json"
    argv = [
        "calibrate",
        models["good"],
        "--out",
        out,
        "--num-seqs",
        "1",
        "--seq-len",
        "64",
        "--min-tokens",
        "32",
    ]
    if existing:
        assert run(argv)[0] == 0
    real, other = calibration.calibrate_kv_cache, []

    def calibrate(*args, **kwargs):
        if not other:
            other.append(None)
            other[0] = run([*argv, "--method", "percentile"])  # another run, finishing first
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate_kv_cache", calibrate)
    code, said, err = run(argv)
    said_first = "replaced" if existing else "wrote"  # the summary of a run that replaced a file
    assert other[0][0] == 0 and f"{said_first} " in other[0][1]
    assert code in (1, 2) and "was written by another run" in one_line(err)
    assert "wrote" not in said and "replaced" not in said
    assert json.loads(out.read_text())["method"] == "percentile"  # the first run's file


@pytest.mark.parametrize("existing", [False, True])
def test_two_evaluations_to_one_report_never_both_say_wrote(tmp_path, models, monkeypatch, existing):
    """As for calibrate (issue 37: safety.md says two runs to one output never both succeed;
    evaluate --json replaced the other run's report silently)."""
    from onnx_kvcache.runtime import evaluation

    out = tmp_path / "report.json"
    argv = ["evaluate", models["good"], models["good"], "--num-seqs", 1, "--seq-len", 16, "--json", out]
    if existing:
        assert run(argv)[0] == 0
    real, other = evaluation.evaluate_kv_cache, []

    def evaluate(*args, **kwargs):
        if not other:
            other.append(None)
            other[0] = run([*argv, "--max-new-tokens", 3])  # another run, finishing first
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_kv_cache", evaluate)
    code, said, err = run(argv)
    assert other[0][0] == 0 and f"{'replaced' if existing else 'wrote'} " in other[0][1]
    assert code == 2 and "was written by another run" in one_line(err)
    assert "wrote" not in said and "replaced" not in said
    assert json.loads(out.read_text())["greedy_match_prefix"] == 3  # the first run's report


def test_onnxruntimes_refusal_is_said_without_its_source_paths(tmp_path, models):
    """A model onnxruntime refuses for what validation does not check (an operator it does not
    know): its message, without the build machine's source file, line and C++ signature."""
    model = ir.load(models["good"])
    node = next(n for n in model.graph if n.op_type == "MatMul")
    node.op_type = "NoSuchOperator"
    ir.save(model, tmp_path / "m.onnx")
    code, _, err = run(["evaluate", models["good"], tmp_path / "m.onnx", "--num-seqs", 1, "--seq-len", 16])
    assert code == 2 and "onnxruntime cannot load the model" in one_line(err)
    assert "NoSuchOperator" in err and "onnxruntime_src" not in err and "::" not in err


# -- a fuzz test over real-producer files and genai-shaped builds ----------------------------


def _genai_shaped() -> ir.Model:
    return build_decoder(num_layers=2, vocab_size=300)


def _export() -> ir.Model:
    return ir.load(DATA / "export_llama_opset23.onnx")


def _attention_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type in ("GroupQueryAttention", "Attention")]


def _set_heads(rng: random.Random, model: ir.Model) -> None:
    node = rng.choice(_attention_nodes(model))
    names = [a for a in ("num_heads", "kv_num_heads", "q_num_heads") if a in node.attributes]
    attr = rng.choice(names or ["q_num_heads", "kv_num_heads"])  # an export's 4D Attention has none
    node.attributes[attr] = ir.AttrInt64(attr, rng.choice([0, -1, -3, 3, 5, 64]))


def _delete_node(rng: random.Random, model: ir.Model) -> None:
    proto = ir.to_proto(model)
    del proto.graph.node[rng.randrange(len(proto.graph.node))]
    model.graph = ir.from_proto(proto).graph


def _shuffle(rng: random.Random, model: ir.Model) -> None:
    shuffled(model, rng.randrange(1000))


def _drop_cache(rng: random.Random, model: ir.Model) -> None:
    node = rng.choice(_attention_nodes(model))
    slots = (3, 4) if node.op_type == "GroupQueryAttention" else (4, 5)
    for slot in rng.sample(slots, rng.choice([1, 2])):
        if slot < len(node.inputs):
            node.replace_input_with(slot, None)


def _scale(rng: random.Random, model: ir.Model) -> None:
    """A scale of another dtype or size (a quantized base; others have none to change)."""
    nodes = [n for n in _attention_nodes(model) if len(n.inputs) > 12 and n.inputs[12] is not None]
    if not nodes:
        return
    node, slot = rng.choice(nodes), rng.choice([12, 13])
    dtype, size = rng.choice([(np.float16, 1), (np.float64, 1), (np.float32, 3), (np.float32, 64)])
    name = f"mutant_scale_{slot}"
    value = ir.Value(name=name, const_value=ir.tensor(np.full(size, 0.05, dtype), name=name))
    value.dtype, value.shape = value.const_value.dtype, ir.Shape([size])
    model.graph.register_initializer(value)
    node.replace_input_with(slot, value)


def _cut_outputs(rng: random.Random, model: ir.Model) -> None:
    """An attention node's outputs after the first cut, the graph still listing them (row 4)."""
    name = rng.choice(_attention_nodes(model)).name
    proto = ir.to_proto(model)
    del next(n for n in proto.graph.node if n.name == name).output[1:]
    model.graph = ir.from_proto(proto).graph


def _header(rng: random.Random, model: ir.Model) -> None:
    """An IR version or an opset past what onnxruntime loads, or one it does (row 4; an older
    ai.onnx opset than the nodes' is a model onnxruntime refuses already, converted as it is)."""
    if rng.random() < 0.5:
        model.ir_version = rng.choice([10, 15, 99])
    else:
        model.opset_imports[rng.choice(["", "com.microsoft"])] = rng.choice([29, 99])


def _genai_shaped_int8() -> ir.Model:
    model = _genai_shaped()
    KvCacheQuantizationPass("int8", scales=SCALES)(model)
    return model


MUTATIONS = [_set_heads, _delete_node, _shuffle, _drop_cache, _scale, _cut_outputs, _header]
BASES = {"genai-shaped": _genai_shaped, "genai-shaped int8": _genai_shaped_int8, "torch export": _export}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("base", list(BASES))
def test_fuzz_every_mutant_is_one_line_or_an_output_that_loads(tmp_path, base, seed):
    rng = random.Random(seed)
    model = BASES[base]()
    mutations = MUTATIONS if base != "genai-shaped int8" else [_scale, _set_heads, _shuffle]
    rng.choice(mutations)(rng, model)
    src = tmp_path / "mutant.onnx"
    ir.save(model, src)
    layers = 2 if base == "genai-shaped" else 3
    scales = tmp_path / "scales.json"
    scales.write_text(
        json.dumps({"scales": {"k_scales": [0.1] * layers, "v_scales": [0.05] * layers}, "qmax": 128})
    )
    out = tmp_path / "out.onnx"
    code, _, err = run(["convert", src, out, "--scales", scales, "--ep", "cpu"])
    if code == 0:
        create_session(str(out), ["CPUExecutionProvider"])  # onnxruntime loads what was written
    else:
        assert code in (1, 2)
        one_line(err)
        assert not out.exists()


# -- issue 37: the first hour's friction -------------------------------------------------------


def test_rope_positions_with_a_method_that_never_reads_it_is_one_line(tmp_path, models):
    """The default method gave the same scales for 2, 64 and 100000, yet recorded 64, and convert
    then warned of keys clipped past position 64."""
    argv = ["calibrate", models["good"], "--out", tmp_path / "s.json", "--rope-positions", 64]
    code, out, err = run([*argv, "--format", "int8", "--num-seqs", 1, "--seq-len", 64])
    assert code == 2 and out == "" and not (tmp_path / "s.json").exists()
    assert "--rope-positions 64 limits only, under the RoPE envelope, the attention methods" in one_line(err)
    assert "--method minmax of an unrotated cache never reads it" in err and "Drop --rope-positions" in err
    assert "choose an attention method or a rotated cache (--rotation keys)" in one_line(err)


def test_scales_for_a_short_context_on_a_model_that_states_none_say_so(tmp_path):
    """An export alone (its rotary angles computed from the positions): once no word at all."""
    scales = tmp_path / "s.json"
    doc = {"scales": {"k_scales": [0.1] * 3, "v_scales": [0.05] * 3}, "qmax": 128, "rope_positions": 64}
    scales.write_text(json.dumps(doc))
    code, _, err = run(
        ["convert", DATA / "export_llama_opset23.onnx", tmp_path / "o.onnx", "--scales", scales]
    )
    assert code == 0
    assert "(--rope-positions 64), and nothing states the model's context" in err


def test_the_readmes_beside_comment_is_what_convert_does(tmp_path):
    """README: "beside it: the weights are shared" was wrong for an export with inline weights."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("onnx-kvcache convert model.onnx model.int8"))
    assert line.endswith("# beside it: external data shared, inline weights copied")
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1] * 3, "v_scales": [0.05] * 3}, "qmax": 128}))
    src = tmp_path / "model.onnx"
    src.write_bytes((DATA / "export_llama_opset23.onnx").read_bytes())  # weights inline
    code, out, _ = run(["convert", src, tmp_path / "model.int8.onnx", "--scales", scales])
    assert code == 0 and "weights: inline in the graph" in out
    external = tmp_path / "ext" / "model.onnx"
    external.parent.mkdir()
    ir.save(ir.load(src), external, external_data="model.onnx.data")
    code, out, _ = run(["convert", external, tmp_path / "ext" / "model.int8.onnx", "--scales", scales])
    assert code == 0 and "weights: model.onnx.data, shared with model.onnx" in out
    assert not (tmp_path / "ext" / "model.int8.onnx.data").exists()


def test_genai_and_the_runner_agree_when_an_end_token_comes_in_the_window(tmp_path):
    """docs/converting.md's comparison held only while no end token came: genai's sequence leaves
    it out, the runner keeps it. The page's comparison now holds either way."""
    og = pytest.importorskip("onnxruntime_genai")
    folder = save_genai_folder(tmp_path / "g", num_layers=2)
    prompt = [1, 72, 101, 108, 108, 111]
    first = KvCacheRunner(folder).generate(prompt, 1)[0]
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = first  # the first greedy token ends the sequence
    (folder / "genai_config.json").write_text(json.dumps(config))
    params = og.GeneratorParams(og_model := og.Model(str(folder)))
    params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
    generator = og.Generator(og_model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    runner = KvCacheRunner(folder)
    tokens = runner.generate(prompt, 8)
    ended = bool(tokens) and tokens[-1] in runner.eos_token_ids
    assert tokens == [first] and ended
    assert list(generator.get_sequence(0))[len(prompt) :] == tokens[: len(tokens) - ended] == []


def test_an_optimum_folder_whose_configs_name_no_eos_takes_the_tokenizers(tmp_path):
    """config.json and generation_config.json without eos_token_id: once no genai_config.json."""
    folder = tmp_path / "export"
    folder.mkdir()
    for name in ("model.onnx", "config.json"):
        (folder / name).write_bytes((DATA / "optimum_llama" / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = {"eos_token": "</s>", "added_tokens_decoder": {"2": {"content": "</s>", "special": True}}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1] * 3, "v_scales": [0.05] * 3}, "qmax": 128}))
    code, out, err = run(["convert", folder, tmp_path / "out", "--scales", scales])
    assert code == 0 and "genai_config.json written from config.json" in out, err
    assert json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]["eos_token_id"] == 2


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("offset", "-100", "External data offset must be non-negative, got -100 for tensor"),
        ("offset", "abc", "invalid literal for int() with base 10: 'abc'"),
    ],
)
def test_a_bad_external_data_entry_is_named_not_the_deserializers_wrapper(tmp_path, key, value, said):
    """review37: "is not a readable ONNX model (Error calling _deserialize_graph with: main_graph)"
    named nothing; the line now says what the deserializer found."""
    import onnx

    ir.save(build_decoder(num_layers=2, vocab_size=300), tmp_path / "m.onnx", external_data="m.onnx.data")
    proto = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.external_data)
    entry = next((e for e in tensor.external_data if e.key == key), None) or tensor.external_data.add(key=key)
    entry.value = value
    onnx.save(proto, str(tmp_path / "m.onnx"))
    for argv in (["inspect", tmp_path / "m.onnx"], ["convert", tmp_path / "m.onnx", tmp_path / "o.onnx"]):
        code, out, err = run(argv)
        assert code == 2 and out == ""
        assert "is not a readable ONNX model (" in one_line(err) and said in err
        assert "_deserialize_graph" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
