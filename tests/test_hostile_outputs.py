"""Issue 20, outputs: every file the tool writes follows one rule (onnx_kvcache.model_io._outputs).

Each test replays a finding of a hostile run: what the output may replace (a file
onnx-kvcache wrote, as the file proves; anything else only with --overwrite / overwrite=True;
never a model, link, device, FIFO or folder), checks before the long work, names that are
not UTF-8, a closed or full stdout, and what refuses hard-linked data.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_kvcache import KvCacheScales, convert_model, load_kv_cache_scale_file
from onnx_kvcache.cli import _demo as demo
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.files.conversion import LINK_WARNING
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io import _outputs as outputs
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCALES = KvCacheScales.from_mapping({0: (0.1, 0.05), 1: (0.1, 0.05)}, format="int8")


def tree(root: pathlib.Path) -> dict[str, object]:
    """Every entry under ``root``: a file's SHA-256, a link's target, other types by kind."""
    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            st = os.lstat(p)
            key = os.fsencode(p.relative_to(root)).hex()
            if stat.S_ISLNK(st.st_mode):
                found[key] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                found[key] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                found[key] = stat.S_IFMT(st.st_mode)
    return found


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2), path)
    return path


def _calibrate_argv(model, out, *extra):
    small = ["--format", "int8", "--seq-len", "64", "--num-seqs", "2", "--min-tokens", "64", "--no-progress"]
    return ["calibrate", str(model), "--out", str(out), *small, *extra]


def _evaluate_argv(model, *extra):
    small = ["--num-seqs", "1", "--seq-len", "32", "--max-new-tokens", "2", "--no-progress"]
    return ["evaluate", str(model), str(model), *small, *extra]


# -- findings 3 and 4: KvCacheScales.save and calibrate --out -----------------------------


def _fifo(p):
    os.mkfifo(p)


def _model(p):
    ir.save(build_decoder(num_layers=1), p)


def _model_without_suffix(p):
    ir.save(build_decoder(num_layers=1), p.with_suffix(".onnx"))
    p.with_suffix(".onnx").rename(p)


VICTIMS = {
    "a model": ("m.onnx", _model, "is an ONNX model"),
    "a model named .json": ("m.json", _model_without_suffix, "is an ONNX model"),
    "a FIFO": ("f.json", _fifo, "not a regular file"),
    "a link to a file": ("l.json", lambda p: p.symlink_to(p.with_name("target.txt")), "symbolic link"),
    "a dangling link": ("d.json", lambda p: p.symlink_to("nowhere.json"), "symbolic link"),
    "a folder": ("dir.json", lambda p: p.mkdir(), "is a folder"),
}


@pytest.mark.parametrize("victim", list(VICTIMS))
@pytest.mark.parametrize("overwrite", [False, True])
def test_save_never_replaces_a_model_device_fifo_link_or_folder(tmp_path, victim, overwrite):
    name, make, message = VICTIMS[victim]
    (tmp_path / "target.txt").write_text("mine")
    path = tmp_path / name
    make(path)
    before = tree(tmp_path)
    with pytest.raises(KvCacheError, match=message):
        SCALES.save(path, **({"overwrite": True} if overwrite else {}))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_never_replaces_a_device(tmp_path, overwrite):
    """A device of our own (as root), never the system's: on a build without the check, this
    test would replace whatever device it names, as save("/dev/null") once did."""
    device = tmp_path / "null.json"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    except PermissionError:
        os.mkfifo(device)  # not root: the other kind of special file save must not replace
    with pytest.raises(KvCacheError, match="not a regular file"):
        SCALES.save(device, **({"overwrite": True} if overwrite else {}))
    assert not stat.S_ISREG(os.lstat(device).st_mode)
    with pytest.raises(KvCacheError, match="not a regular file"):  # the check alone writes nothing
        outputs.check_output("/dev/null", "scales", overwrite=True)


def test_save_replaces_its_own_file_and_a_foreign_one_only_with_overwrite(tmp_path):
    path = tmp_path / "s.json"
    SCALES.save(path)
    SCALES.retarget("fp8").save(path)  # ours: replaced, no overwrite needed
    assert load_kv_cache_scale_file(path).format == "fp8"
    doc = json.loads(path.read_text())
    assert doc[outputs.WRITTEN_KEY]["kind"] == "scales"
    doc["note"] = "measured on the eval set"  # finding 4: a hand edit makes it the user's
    path.write_text(json.dumps(doc))
    with pytest.raises(KvCacheError, match=r"edited since onnx-kvcache wrote it.*overwrite=True"):
        SCALES.save(path)
    assert json.loads(path.read_text())["note"] == "measured on the eval set"
    SCALES.save(path, overwrite=True)
    assert "note" not in path.read_text() and load_kv_cache_scale_file(path).format == "int8"


def test_an_old_scale_file_without_the_record_still_loads_but_is_the_users(tmp_path, model_file):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    assert load_kv_cache_scale_file(old).layer_ids == (0, 1)  # an input: read as before
    convert_model(model_file, tmp_path / "o.onnx", format="int8", scales=old)
    with pytest.raises(KvCacheError, match=r"has no 'onnx_kvcache\.written' record"):
        SCALES.save(old)


def test_calibrate_refuses_a_hand_edited_scale_file_and_names_overwrite(tmp_path, model_file, capsys):
    out = tmp_path / "s.json"
    assert main(_calibrate_argv(model_file, out)) == 0
    assert main(_calibrate_argv(model_file, out)) == 0  # its own file: replaced
    capsys.readouterr()
    doc = json.loads(out.read_text())
    doc["note"] = "keep me"
    out.write_text(json.dumps(doc, indent=2))
    assert main(_calibrate_argv(model_file, out)) == 2
    assert "--overwrite" in one_line(capsys)
    assert json.loads(out.read_text())["note"] == "keep me"
    assert main(_calibrate_argv(model_file, out, "--overwrite")) == 0
    scales = load_kv_cache_scale_file(out)
    assert "note" not in out.read_text() and scales.layer_ids == (0, 1)
    result = convert_model(model_file, tmp_path / "o.onnx", format="int8", scales=out)
    session = ort.InferenceSession(str(result.model_file), providers=["CPUExecutionProvider"])
    assert session.get_inputs()


# -- finding 2: evaluate --json / --plot ------------------------------------------------


def test_evaluate_json_never_replaces_a_config_or_a_scale_file(tmp_path, model_file, capsys, monkeypatch):
    victim = save_genai_folder(tmp_path / "victim", num_layers=2, vocab_size=300)
    scale_file = tmp_path / "s.json"
    SCALES.save(scale_file)  # ours, but a scale file: no report replaces it
    before = tree(tmp_path)
    for path, message in [
        (victim / "genai_config.json", "has no 'onnx_kvcache.written' record"),
        (scale_file, "wrote it as a scale file"),
    ]:
        monkeypatch.setattr("onnx_kvcache.runtime.evaluation.evaluate_kv_cache", pytest.fail)  # refused first
        assert main(_evaluate_argv(model_file, "--json", str(path))) == 2
        err = one_line(capsys)
        assert message in err and "--overwrite" in err
    assert tree(tmp_path) == before


def test_evaluate_writes_replaces_its_own_report_and_plot(tmp_path, model_file, capsys):
    pytest.importorskip("matplotlib")
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    for _ in range(2):  # the second run replaces its own files
        assert main(_evaluate_argv(model_file, "--json", str(report), "--plot", str(plot))) == 0
    doc = json.loads(report.read_text())
    assert doc["kl_mean"] == 0 and doc[outputs.WRITTEN_KEY]["kind"] == "report"
    assert plot.read_bytes().startswith(b"\x89PNG") and outputs._png_written_by_us(plot, "plot") is None
    import matplotlib.image

    assert matplotlib.image.imread(plot).ndim == 3  # still an image
    capsys.readouterr()

    holiday = tmp_path / "holiday.png"  # a PNG of the user's
    holiday.write_bytes(plot.read_bytes().replace(b"onnx_kvcache.written", b"my.holiday.photo...."))
    edited = json.loads(report.read_text())
    edited["kl_mean"] = 1.0
    report.write_text(json.dumps(edited))
    before = tree(tmp_path)
    for option, path in (("--plot", holiday), ("--json", report)):
        assert main(_evaluate_argv(model_file, option, str(path))) == 2
        assert "--overwrite" in one_line(capsys)
    assert tree(tmp_path) == before
    assert main(_evaluate_argv(model_file, "--plot", str(holiday), "--overwrite")) == 0
    assert outputs._png_written_by_us(holiday, "plot") is None


# -- finding 8: checked before the long work ---------------------------------------------


def test_plot_name_matplotlib_and_writability_are_checked_before_evaluating(
    tmp_path, model_file, capsys, monkeypatch
):
    monkeypatch.setattr("onnx_kvcache.runtime.evaluation.evaluate_kv_cache", pytest.fail)
    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if pathlib.Path(p) == tmp_path / "ro" else real_access(p, mode)
    )
    for extra, message in [
        (["--plot", str(tmp_path / "plot.txt")], "a PNG plot is written as .png"),
        (["--plot", str(tmp_path / "ro" / "p.png")], "Cannot write in"),
        (["--json", str(tmp_path / "ro" / "r.json")], "Cannot write in"),
        (["--json", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")], "name two files"),
    ]:
        assert main(_evaluate_argv(model_file, *extra)) == 2, extra
        assert message in one_line(capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert main(_evaluate_argv(model_file, "--plot", str(tmp_path / "p.png"))) == 2
    assert "pip install 'onnx-kvcache[plot]'" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "ro"]


# -- finding 1: demo --keep ---------------------------------------------------------------


def test_demo_keep_refuses_a_folder_it_did_not_fill(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_VARIANTS", demo.DEMO_VARIANTS[2:3])  # int8 per_tensor
    genai = save_genai_folder(tmp_path / "mymodel", num_layers=2, vocab_size=300)
    (tmp_path / "link").symlink_to(genai)
    (tmp_path / "file").write_text("x")
    before = tree(tmp_path)
    for keep, message in [
        (genai, "genai_config.json, model.onnx"),
        (tmp_path / "link", "symbolic link"),
        (tmp_path / "file", "not a folder"),
    ]:
        assert main(["demo", "--keep", str(keep), "--no-progress"]) == 2
        assert message in one_line(capsys)
    assert tree(tmp_path) == before

    stopped = tmp_path / "stopped"

    def stop(*args, **kwargs):  # Ctrl-C once the first model is converted
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(demo, "evaluate_kv_cache", stop)
        assert main(["demo", "--keep", str(stopped), "--no-progress"]) == 130
    assert (stopped / "model.int8.per_tensor.onnx").is_file()
    outputs.check_demo_folder(stopped)  # what a stopped demo left, the next one accepts
    capsys.readouterr()

    kept = tmp_path / "kept"
    assert main(["demo", "--keep", str(kept), "--no-progress"]) == 0
    capsys.readouterr()
    outputs.check_demo_folder(kept)  # a second run would be accepted (the record lists it all)
    assert sorted(os.listdir(kept)) == sorted(
        [outputs.DEMO_RECORD, "model.int8.per_tensor.onnx", "model.onnx"]
    )
    for name in ("model.onnx", "model.int8.per_tensor.onnx"):
        proto = onnx.load(kept / name)
        assert [v.const_value.numpy() for v in ir.load(kept / name).graph.initializers.values()]
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (kept / "notes.txt").write_text("mine")
    assert main(["demo", "--keep", str(kept), "--no-progress"]) == 2
    assert "notes.txt" in one_line(capsys)
    (kept / "notes.txt").unlink()
    ir.save(build_decoder(num_layers=1), kept / "model.onnx")  # changed since the demo wrote it
    assert main(["demo", "--keep", str(kept), "--no-progress"]) == 2
    assert "model.onnx" in one_line(capsys)


def test_the_demo_record_lists_what_the_demo_wrote(tmp_path):
    folder = tmp_path / "d"
    outputs.check_demo_folder(folder)  # new: fine
    folder.mkdir()
    outputs.check_demo_folder(folder)  # empty: fine
    (folder / "model.onnx").write_bytes(b"graph")
    with pytest.raises(KvCacheError, match=r"model\.onnx"):
        outputs.check_demo_folder(folder)
    outputs.record_demo_folder(folder)
    outputs.check_demo_folder(folder)
    record = json.loads((folder / outputs.DEMO_RECORD).read_text())
    assert record["entries"] == {"model.onnx": hashlib.sha256(b"graph").hexdigest()}
    (folder / "model.onnx").write_bytes(b"graph, edited")
    with pytest.raises(KvCacheError, match=r"model\.onnx"):
        outputs.check_demo_folder(folder)
    outputs.record_demo_folder(folder, {"converted.onnx": outputs.CONVERTED})  # about to convert
    (folder / "converted.onnx").write_bytes(b"graph")  # not what a conversion writes
    with pytest.raises(KvCacheError, match=r"converted\.onnx"):
        outputs.check_demo_folder(folder)
    ir.save(build_decoder(num_layers=2), folder / "model.onnx")
    (folder / "converted.onnx").unlink()
    outputs.record_demo_folder(folder, {"converted.onnx": outputs.CONVERTED})
    convert_model(
        folder / "model.onnx", folder / "converted.onnx", format="int8", scales=SCALES, overwrite=True
    )
    outputs.check_demo_folder(folder)  # what a conversion wrote is the demo's
    record = json.loads((folder / outputs.DEMO_RECORD).read_text())
    record["entries"]["other.onnx"] = "0" * 64
    (folder / outputs.DEMO_RECORD).write_text(json.dumps(record))  # a forged record is no record
    with pytest.raises(KvCacheError, match=outputs.DEMO_RECORD):
        outputs.check_demo_folder(folder)


# -- the writer itself --------------------------------------------------------------------


def test_a_json_record_proves_the_content_and_its_kind(tmp_path):
    path = tmp_path / "r.json"
    outputs.write_output(path, outputs.stamp_json({"a": [1, 2.5, None], "b": "é"}, "report"), "report")
    assert outputs._json_written_by_us(path, "report") is None
    assert "wrote it as a JSON report" in str(outputs._json_written_by_us(path, "demo record"))
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc, sort_keys=True))  # reformatted, same content: still ours
    assert outputs._json_written_by_us(path, "report") is None
    doc["a"][0] = 2
    path.write_text(json.dumps(doc))
    assert "edited" in outputs._json_written_by_us(path, "report")
    for text in ("[" * 100_000, "not json", "[]", ""):
        path.write_text(text)
        assert outputs._json_written_by_us(path, "report") is not None


def test_the_writer_checks_again_and_removes_what_it_created(tmp_path, monkeypatch):
    path = tmp_path / "new" / "r.json"
    path.parent.mkdir()
    real = outputs.check_output

    def check_then_plant(p, kind, **kw):  # a FIFO appears between the check and the rename
        identity = real(p, kind, **kw)
        os.mkfifo(path)
        return identity

    monkeypatch.setattr(outputs, "check_output", check_then_plant)
    with pytest.raises(KvCacheError, match="created by something else"):
        outputs.write_output(path, b"{}", "report")
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(path.parent) == ["r.json"]
    monkeypatch.undo()
    os.unlink(path)

    def failing_publish(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.file_io.TempFile, "publish", failing_publish)
    with pytest.raises(OSError, match="No space"):
        outputs.write_output(path, b"{}", "report")
    assert os.listdir(tmp_path / "new") == []  # no temporary left


# -- finding 9: names that are not UTF-8 --------------------------------------------------


def test_output_names_that_are_not_utf8_work(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    ir.save(build_decoder(num_layers=2), src, external_data="m.onnx.data")
    scales = tmp_path / "s.json"
    SCALES.save(scales)
    folder = tmp_path / os.fsdecode(b"out\xff")
    out = folder / os.fsdecode(b"bad\xff\xfe.onnx")
    assert main(["convert", str(src), str(out), "--format", "int8", "--scales", str(scales)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    data = [p for p in os.listdir(folder) if p.endswith(".data")]
    assert data == ["bad\ufffd\ufffd.onnx.data"]  # a graph names its data in UTF-8
    weights = [v.const_value.numpy() for v in ir.load(out).graph.initializers.values()]
    assert weights and all(np.isfinite(w).all() for w in weights)
    monkeypatch.chdir(folder)  # onnx and onnxruntime take only UTF-8 paths (their bindings' str)
    with open(out, "rb") as f:
        proto = onnx.load(f, load_external_data=False)
    onnx.external_data_helper.load_external_data_for_model(proto, ".")
    ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    bad_json = tmp_path / os.fsdecode(b"s\xff.json")
    assert main(_calibrate_argv(src, bad_json)) == 0
    assert load_kv_cache_scale_file(bad_json).layer_ids == (0, 1)


# -- finding 10: a closed or full stdout after the work ------------------------------------


def _run(argv, stdout):
    kwargs = {"preexec_fn": lambda: os.close(1)} if stdout == "closed" else {}
    target = {"closed": None, "full": open("/dev/full", "w"), "pipe": subprocess.PIPE}[stdout]  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_kvcache", *argv], stdout=target, stderr=subprocess.PIPE, **kwargs
    )
    if stdout == "pipe":
        proc.stdout.close()  # `| head` gone before anything is printed
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=300)
    if stdout == "full":
        target.close()
    return code, err


@pytest.mark.parametrize("stdout", ["closed", "full", "pipe"])
def test_a_closed_or_full_stdout_after_the_work_is_a_success(tmp_path, model_file, stdout):
    scales, report, converted = tmp_path / "s.json", tmp_path / "r.json", tmp_path / "o.onnx"
    runs = [
        (_calibrate_argv(model_file, scales), scales),
        (
            ["convert", str(model_file), str(converted), "--format", "int8", "--scales", str(scales)],
            converted,
        ),
        (_evaluate_argv(model_file, "--json", str(report)), report),
    ]
    for argv, output in runs:
        code, err = _run(argv, stdout)
        assert code == 0 and "Traceback" not in err, (argv[0], err)
        assert output.is_file(), argv[0]
        if stdout != "closed":
            assert err.splitlines()[-1].startswith("onnx-kvcache: warning: ") and str(output) in err
    assert load_kv_cache_scale_file(scales).layer_ids == (0, 1)
    assert json.loads(report.read_text())["kl_mean"] == 0
    assert onnx.load(converted).graph.node  # a closed stdout's number was not given to a file
    ort.InferenceSession(str(converted), providers=["CPUExecutionProvider"])


def test_a_closed_stderr_is_not_given_to_an_output_file(tmp_path):
    """With fd 2 closed, the first file opened would take its number, and every warning
    (fp8 without scales warns) would be written into the model."""
    model_file, out = tmp_path / "m16.onnx", tmp_path / "o.onnx"
    ir.save(build_decoder(num_layers=2, dtype="float16"), model_file)
    argv = ["convert", str(model_file), str(out), "--format", "fp8"]
    proc = subprocess.run(
        [sys.executable, "-m", "onnx_kvcache", *argv],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: os.close(2),
        timeout=300,
    )
    assert proc.returncode == 0 and b"converted" in proc.stdout
    proto = onnx.load(out)
    assert b"warning" not in out.read_bytes() and proto.graph.node


def test_inspect_with_stdout_closed_or_full(model_file):
    code, err = _run(["inspect", str(model_file)], "closed")
    assert (code, err) == (0, "")  # nothing asked to be seen
    code, err = _run(["inspect", str(model_file)], "full")
    assert code == 2 and err == (  # its output was lost
        "onnx-kvcache: error: could not write to standard output (No space left on device).\n"
    )


# -- finding 15: what refuses hard-linked data ---------------------------------------------


def test_what_refuses_hard_linked_data_is_what_the_warning_says(tmp_path, monkeypatch):
    """onnx.load with its data and onnx.checker refuse; onnx-ir refuses reading a weight
    unless the model was loaded by a bare file name (no folder, so no checks); the graph
    alone, onnxruntime and onnxruntime-genai load."""
    src = save_genai_folder(tmp_path / "in", num_layers=2, vocab_size=300)
    model = ir.load(src / "model.onnx")
    ir.save(model, src / "model.onnx", external_data="model.onnx.data")
    with pytest.warns(Warning, match="hard links"):
        convert_model(src, tmp_path / "out", format="int8", scales=SCALES, weights="link")
    for graph in (src / "model.onnx", tmp_path / "out" / "model.onnx"):
        assert (graph.parent / "model.onnx.data").stat().st_nlink == 2
        with pytest.raises(onnx.checker.ValidationError, match="multiple hard links"):
            onnx.load(graph)
        with pytest.raises(onnx.checker.ValidationError, match="multiple hard links"):
            onnx.checker.check_model(str(graph))
        assert onnx.load(graph, load_external_data=False).graph.node  # the graph alone loads
        with pytest.raises(ValueError, match="multiple hard links"):
            [v.const_value.numpy() for v in ir.load(graph).graph.initializers.values()]
        monkeypatch.chdir(graph.parent)
        assert [v.const_value.numpy() for v in ir.load(graph.name).graph.initializers.values()]
        ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        og = pytest.importorskip("onnxruntime_genai")
        og.Model(str(graph.parent))
    for text in (LINK_WARNING, (ROOT / "docs" / "converting.md").read_text()):  # README: a link to it
        flat = " ".join(text.split())
        assert "onnx.checker" in flat and "onnx.load" in flat and "bare file name" in flat


# -- finding 16: the demo's duration is a measured figure ----------------------------------


def test_the_demo_duration_quoted_names_its_command_and_spread():
    for page in ("README.md", "docs/choosing-a-format.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert "about 8 s" not in text
        assert "`python benchmarks/demo.py`" in text, page
    assert (ROOT / "benchmarks" / "demo.py").is_file()


# -- review of issue 20: an output is never a file an input model uses ---------------------


@pytest.fixture
def genai(tmp_path):
    g, gq = tmp_path / "g", tmp_path / "gq"
    save_genai_folder(g, num_layers=2)
    save_genai_folder(gq, num_layers=2)
    for folder in (g, gq):
        (folder / "tokenizer.json").write_text('{"model": {}}\n')
        (folder / "tokenizer_config.json").write_text("{}\n")
    return g, gq


@pytest.mark.parametrize(
    ("command", "output"),
    [
        ("calibrate g", "g/model.onnx.data"),
        ("calibrate g/model.onnx", "g/model.onnx.data"),
        ("calibrate g", "g/tokenizer.json"),
        ("calibrate g", "g/tokenizer_config.json"),
        ("evaluate g gq", "gq/model.onnx.data"),
        ("evaluate g gq", "gq/tokenizer.json"),
        ("evaluate g gq", "g/tokenizer_config.json"),
        ("evaluate g gq", "g/genai_config.json"),
    ],
)
def test_overwrite_never_replaces_a_file_an_input_model_uses(tmp_path, genai, capsys, command, output):
    before = tree(tmp_path)
    name, *models = command.split()
    argv = [str(tmp_path / m) for m in models]
    out = str(tmp_path / output)
    if name == "calibrate":
        argv = _calibrate_argv(argv[0], out, "--overwrite")
    else:
        argv = ["evaluate", *argv, "--num-seqs", "1", "--seq-len", "32", "--max-new-tokens", "2"]
        argv += ["--no-progress", "--json", out, "--overwrite"]
    assert main(argv) == 2
    assert "input's files" in one_line(capsys)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("data", ["model.onnx.data", "weights.bin"])
def test_save_never_replaces_the_external_data_of_a_model_beside_it(tmp_path, data):
    ir.save(build_decoder(num_layers=2), tmp_path / "model.onnx", external_data=data)
    (tmp_path / "model.onnx").rename(tmp_path / "backup.bin")  # any name: the graph is found by its content
    before = tree(tmp_path)
    with pytest.raises(KvCacheError, match=r"external data \(backup.bin"):
        SCALES.save(tmp_path / data, overwrite=True)
    assert tree(tmp_path) == before
    (tmp_path / "notes.txt").write_text("mine")
    SCALES.save(tmp_path / "notes.txt", overwrite=True)  # a file no graph names: overwrite replaces it


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        (5, TypeError, "path must be a path"),
        (None, TypeError, "path must be a path"),
        ("{d}/new.json/", KvCacheError, "names a folder"),
    ],
)
def test_save_refuses_what_is_no_file_path(tmp_path, path, error, match):
    with pytest.raises(error, match=match):
        SCALES.save(path.format(d=tmp_path) if isinstance(path, str) else path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overwrite", ["no", 1, None])
def test_save_overwrite_must_be_a_bool(tmp_path, overwrite):
    from onnx_kvcache.errors import KvCacheTypeError

    with pytest.raises(KvCacheTypeError, match="overwrite must be True or False"):
        SCALES.save(tmp_path / "s.json", overwrite=overwrite)
    assert os.listdir(tmp_path) == []


def test_calibrate_out_into_a_missing_folder_creates_it_as_convert_does(tmp_path, model_file, capsys):
    """Issue 37: one folder rule for every output (convert created its folder, calibrate refused)."""
    assert main(_calibrate_argv(model_file, tmp_path / "a" / "b" / "s.json")) == 0
    assert load_kv_cache_scale_file(tmp_path / "a" / "b" / "s.json").layer_ids == (0, 1)
    out, scales = tmp_path / "c" / "d" / "m.onnx", tmp_path / "a" / "b" / "s.json"
    assert main(["convert", str(model_file), str(out), "--scales", str(scales)]) == 0
    assert out.is_file()


def test_a_run_that_writes_nothing_removes_the_folders_it_created(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_io.TempFile, "write", full)
    with pytest.raises(KvCacheError, match="No space left on device"):
        SCALES.save(tmp_path / "a" / "b" / "s.json")
    assert os.listdir(tmp_path) == []


def test_an_output_under_a_file_is_refused_before_the_work(tmp_path, model_file, capsys):
    (tmp_path / "afile").write_text("mine")
    assert main(_calibrate_argv(model_file, tmp_path / "afile" / "s.json")) == 2
    assert "is not a folder, so nothing can be written" in one_line(capsys)


# -- review of issue 20: evaluate's report and plot are one unit ---------------------------


def _fail_second(monkeypatch, owner, name, error):
    real = getattr(owner, name)
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize(
    ("where", "error", "code", "said"),
    [
        ("write", OSError(28, "No space left on device"), 2, "Cannot write {plot}: No space left on device"),
        ("write", "SIGINT", 130, "stopped by SIGINT; no partial output was left"),
        ("publish", OSError(5, "Input/output error"), 2, "Input/output error"),
    ],
)
def test_evaluate_writes_its_report_and_plot_or_neither(
    tmp_path, model_file, capsys, monkeypatch, where, error, code, said
):
    from onnx_kvcache._signals import Interrupted

    report, plot = tmp_path / "ev.json", tmp_path / "ev.png"
    error = Interrupted(signal.SIGINT) if error == "SIGINT" else error
    _fail_second(monkeypatch, outputs.file_io.TempFile, where, error)
    before = tree(tmp_path)
    assert main(_evaluate_argv(model_file, "--json", str(report), "--plot", str(plot))) == code
    assert said.format(plot=plot) in one_line(capsys)
    assert tree(tmp_path) == before  # neither file, no temporary


def test_evaluate_json_and_plot_naming_one_file_through_a_link_are_refused(
    tmp_path, model_file, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    os.symlink(".", "selfdir")
    before = tree(tmp_path)
    assert main(_evaluate_argv(model_file, "--json", "y.png", "--plot", "selfdir/y.png")) == 2
    assert "name one file" in one_line(capsys)
    assert tree(tmp_path) == before


def test_a_full_disk_names_the_scale_file(tmp_path, model_file, capsys, monkeypatch):
    out = tmp_path / "s.json"

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.file_io.TempFile, "write", full)
    before = tree(tmp_path)
    assert main(_calibrate_argv(model_file, out)) == 2
    err = capsys.readouterr().err.splitlines()
    assert f"Cannot write {out}: No space left on device" in err[-1] and "Traceback" not in str(err)
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("argv", "stdout", "code", "said"),
    [
        (["inspect", "{m}"], "pipe", 0, ""),  # `| true`, `| head -1`: the reader's choice
        (["inspect", "{m}", "--json"], "pipe", 0, ""),
        (["--help"], "pipe", 0, ""),
        (["--version"], "full", 2, "could not write to standard output (No space left on device)"),
        (["--help"], "full", 2, "could not write to standard output (No space left on device)"),
        (["inspect", "--help"], "full", 2, "could not write to standard output (No space left on device)"),
        (["--version"], "closed", 0, ""),  # >&-: nothing asked to be seen
    ],
)
def test_stdout_failures_follow_one_rule(model_file, argv, stdout, code, said):
    got, err = _run([a.format(m=model_file) for a in argv], stdout)
    assert got == code and "Traceback" not in err, err
    if said:
        assert err.count("\n") == 1 and said in err, err
    else:
        assert err == ""


def test_an_interrupted_demo_keep_says_what_it_kept(tmp_path, capsys, monkeypatch):
    from onnx_kvcache._signals import Interrupted

    real, calls = demo.record_demo_folder, []

    def stop_at_the_third_record(folder, pending=None):
        calls.append(1)
        if len(calls) == 3:  # the baseline and the first converted model are written
            raise Interrupted(signal.SIGINT)
        real(folder, pending)

    monkeypatch.setattr(demo, "record_demo_folder", stop_at_the_third_record)
    keep = tmp_path / "demo9"
    assert main(["demo", "--keep", str(keep), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert f"stopped by SIGINT; the models written so far stay in {keep}" in err, err
    assert "no partial output" not in err
    outputs.check_demo_folder(keep)  # a later demo accepts what it kept


@pytest.mark.parametrize("kind", ["genai_folder", "a_file", "a_link", "one_stray_file"])
def test_save_genai_folder_never_writes_over_what_is_there(tmp_path, kind):
    """The documented builder writes a new folder: one that holds anything is refused untouched."""
    target = tmp_path / "model"
    if kind == "genai_folder":
        save_genai_folder(target, num_layers=1)
    elif kind == "a_file":
        target.write_bytes(b"mine")
    elif kind == "a_link":
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(KvCacheError, match="not an empty folder"):
        save_genai_folder(target, num_layers=2)
    assert tree(tmp_path) == before
