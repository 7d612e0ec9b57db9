"""Hostile inputs (issue 20, findings 5-7 and 12-14): every file the tool reads is a regular
file before it is opened, its parsers are bounded, and each problem is one line that names
the file; the library's errors keep Python's conventions. Then a fuzz test over the
command's file arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import os
import pathlib
import shutil
import signal
import stat
import sys
import warnings

import numpy as np
import onnx_ir as ir
import pytest

import onnx_kvcache
from onnx_kvcache import (
    KvCacheError,
    KvCacheQuantizationPass,
    KvCacheRunner,
    KvCacheScales,
    calibrate_kv_cache,
    convert_model,
    evaluate_kv_cache,
    load_kv_cache_scale_file,
)
from onnx_kvcache.cli import commands as cli
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import KvCacheFileNotFoundError, KvCacheTypeError
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder


class _Hung(BaseException):
    """A read blocked (a FIFO opened for reading waits for a writer)."""


@pytest.fixture(autouse=True)
def no_hang():
    """Fail, rather than hang, when a read blocks."""

    def hung(signum, frame):
        raise _Hung("a read blocked for 20 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 2-layer model file and genai folder (vocab 300), built once."""
    root = tmp_path_factory.mktemp("models")
    ir.save(build_decoder(num_layers=2, vocab_size=300), root / "model.onnx")
    save_genai_folder(root / "genai", num_layers=2, vocab_size=300)
    return root


def scales_doc(layers: int = 2, k: object = 0.1) -> dict:
    return {"scales": {"k_scales": [k] * layers, "v_scales": [0.05] * layers}, "qmax": 128}


def run(argv: list[str]) -> tuple[int, str]:
    """The command in this process: its exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("onnx-kvcache: error: "), err
    assert "Traceback" not in err
    return err


# -- finding 5: FIFOs never block and are called FIFOs ---------------------------------------


def test_a_fifo_named_genai_config_is_refused_without_blocking(tmp_path, models):
    folder = tmp_path / "in"
    shutil.copytree(models / "genai", folder)
    (folder / "genai_config.json").unlink()
    os.mkfifo(folder / "genai_config.json")
    code, err = run(["convert", folder, tmp_path / "out", "--format", "int8"])
    assert code == 2 and "is a FIFO (named pipe)" in one_line(err) and "genai_config.json" in err


@pytest.mark.parametrize(
    "option, name",
    [("--scales", "s.json"), ("--text", "t.txt"), ("--token-ids", "ids.json"), ("--tokenizer", "tok.json")],
)
def test_fifos_given_as_files_are_called_fifos(tmp_path, models, option, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    if option == "--scales":
        argv = ["convert", models / "model.onnx", tmp_path / "o.onnx", "--format", "int8", option, fifo]
    else:
        (tmp_path / "good.txt").write_text("text " * 100)
        extra = ["--text", tmp_path / "good.txt"] if option == "--tokenizer" else []
        argv = ["calibrate", models / "genai", "--out", tmp_path / "s.json", option, fifo, *extra]
    code, err = run(argv)
    assert code == 2 and "a FIFO (named pipe)" in one_line(err)
    assert "missing" not in err and "does not exist" not in err


def test_a_fifo_tokenizer_beside_the_model_is_said_not_skipped(tmp_path, models):
    folder = tmp_path / "in"
    shutil.copytree(models / "genai", folder)
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    code, err = run(["calibrate", folder, "--out", tmp_path / "s.json"])
    assert code == 2 and "tokenizer.json is a FIFO (named pipe)" in one_line(err)


# -- finding 6: bounded JSON ------------------------------------------------------------------


DEEP = "[" * 100000


def test_deep_nesting_is_one_line_for_each_json_input(tmp_path, models):
    folder = tmp_path / "in"
    shutil.copytree(models / "genai", folder)
    (folder / "genai_config.json").write_text(DEEP)
    (tmp_path / "deep.json").write_text(DEEP)
    deep = tmp_path / "deep.json"
    argvs = [
        ["inspect", folder],
        ["convert", models / "model.onnx", tmp_path / "o.onnx", "--format", "int8", "--scales", deep],
        ["calibrate", models / "genai", "--out", tmp_path / "s.json", "--token-ids", deep],
    ]
    for argv in argvs:
        code, err = run(argv)
        assert code == 2 and "nested more than 64 levels deep" in one_line(err), argv
    with pytest.raises(KvCacheError, match="nested more than 64 levels deep"):
        load_kv_cache_scale_file(tmp_path / "deep.json")


@pytest.mark.parametrize(
    "doc, message",
    [
        ("[" * 65 + "]" * 65, "nested more than 64 levels deep"),  # valid JSON, still too deep
        ('["' + '\\"' * 1000000, "not valid JSON"),  # an unterminated string of escaped quotes: linear
    ],
)
def test_json_bounds_are_checked_in_linear_time(tmp_path, doc, message):
    (tmp_path / "s.json").write_text(doc)
    with pytest.raises(KvCacheError, match=message):
        load_kv_cache_scale_file(tmp_path / "s.json")


@pytest.mark.parametrize(
    "doc, message",
    [
        ('{"scales": {"k_scales": [1%s], "v_scales": [1]}}' % ("0" * 5000), "an integer of 5001 digits"),
        ('{"scales": {"k_scales": [1], "v_scales": [1]}, "layer_ids": [9%s]}' % ("9" * 4999), "5000 digits"),
    ],
)
def test_huge_integers_in_a_scale_file_are_one_line(tmp_path, models, doc, message):
    (tmp_path / "s.json").write_text(doc)
    code, err = run(["convert", models / "model.onnx", tmp_path / "o.onnx", "--scales", tmp_path / "s.json"])
    assert code == 2 and message in one_line(err) and "s.json" in err


def test_token_ids_beyond_int32_are_refused_naming_the_file(tmp_path, models):
    (tmp_path / "ids.json").write_text(json.dumps([[1, 2, 2**70]]))
    code, err = run(
        ["calibrate", models / "genai", "--out", tmp_path / "s.json", "--token-ids", tmp_path / "ids.json"]
    )
    assert code == 2 and "token id 1180591620717411303424" in one_line(err) and "ids.json" in err


# -- finding 7: .npy files ---------------------------------------------------------------------


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


NPY = {
    "object array": (_npy(np.array([[1, 2], [3, "x"]], dtype=object)), "Python objects"),
    "garbage header": (b"\x93NUMPY\x01\x00\x10\x00{'descr': <>}\n     ", "not a readable .npy array"),
    "truncated": (_npy(np.arange(1000, dtype=np.int64))[:500], "truncated"),
    "empty": (b"", "empty (0 bytes)"),
    "3 bytes": (b"\x93NU", "not a readable .npy array"),
    "floats": (_npy(np.full((1, 64), 1.5)), "token ids are integers"),
    "3-D": (_npy(np.zeros((2, 2, 64), np.int64)), "a 3-D array"),
}


@pytest.mark.parametrize("case", list(NPY))
def test_hostile_npy_token_ids_are_one_line(tmp_path, models, case):
    data, message = NPY[case]
    (tmp_path / "ids.npy").write_bytes(data)
    code, err = run(
        ["calibrate", models / "genai", "--out", tmp_path / "s.json", "--token-ids", tmp_path / "ids.npy"]
    )
    assert code == 2 and message in one_line(err) and "ids.npy" in err


def test_a_npy_header_declaring_more_data_than_the_file_holds_allocates_nothing(tmp_path, models):
    header = b"{'descr': '<i8', 'fortran_order': False, 'shape': (1000000000000,), }"
    header += b" " * (63 - len(header) % 64) + b"\n"
    (tmp_path / "ids.npy").write_bytes(
        b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 64
    )
    code, err = run(
        ["calibrate", models / "genai", "--out", tmp_path / "s.json", "--token-ids", tmp_path / "ids.npy"]
    )
    assert code == 2 and "truncated: its header declares shape (1000000000000,)" in one_line(err)


# -- finding 12: error classes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda t, m: convert_model(t / "nope.onnx", t / "o.onnx"),
        lambda t, m: calibrate_kv_cache(t / "nope"),
        lambda t, m: KvCacheRunner(t / "nope.onnx"),
        lambda t, m: evaluate_kv_cache(t / "nope", m / "model.onnx"),
        lambda t, m: load_kv_cache_scale_file(t / "nope.json"),
        lambda t, m: calibrate_kv_cache(m / "model.onnx", t / "nope.txt"),
        lambda t, m: calibrate_kv_cache(m / "model.onnx", tokenizer=t / "nope.json"),
        lambda t, m: convert_model(m / "model.onnx", t / "o.onnx", format="int8", scales=t / "nope.json"),
    ],
)
def test_a_missing_path_is_a_file_not_found_error(tmp_path, models, call):
    with pytest.raises(FileNotFoundError) as info:
        call(tmp_path, models)
    assert isinstance(info.value, KvCacheFileNotFoundError) and isinstance(info.value, KvCacheError)
    assert "nope" in str(info.value) and "[Errno" not in str(info.value)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: KvCacheQuantizationPass("int8")(ir.to_proto(m)), "takes an onnx_ir.Model, got ModelProto"),
        (lambda m: KvCacheQuantizationPass("int8")("model.onnx"), "got str"),
        (lambda m: KvCacheQuantizationPass("int8")(None), "got NoneType"),
        (lambda m: KvCacheQuantizationPass(ir.to_proto(m)), "format must be a name"),
        (lambda m: convert_model("model.onnx", "o.onnx", ep=3), "ep must be a provider name"),
        (lambda m: calibrate_kv_cache(m, seq_len="64"), "seq_len must be an integer, got str"),
        (lambda m: calibrate_kv_cache(m, margin="2"), "margin must be a number"),
        (lambda m: evaluate_kv_cache(m, m, num_seqs=2.5), "num_seqs must be an integer or None"),
        (lambda m: KvCacheRunner(m, providers=7), "providers must be a list"),
        (lambda m: KvCacheRunner(ir.to_proto(m)), "model_or_path must be an onnx_ir.Model or a path"),
        (lambda m: load_kv_cache_scale_file(None), "A scale file is a path"),
        (lambda m: convert_model(ir.to_proto(m), "o.onnx"), "The model must be a path"),
        (lambda m: convert_model("m.onnx", 5), "out_path must be a path or None"),
        (lambda m: onnx_kvcache.load_model(None), "The model must be a path"),
    ],
)
def test_a_wrong_type_is_a_type_error(call, message):
    with pytest.raises(TypeError, match=message) as info:
        call(build_decoder(num_layers=2, vocab_size=300))
    assert isinstance(info.value, KvCacheTypeError) and isinstance(info.value, KvCacheError)


def test_a_str_of_providers_is_one_provider(models):
    runner = KvCacheRunner(models / "model.onnx", providers="CPUExecutionProvider")
    assert runner.providers == ["CPUExecutionProvider"]


def test_the_new_errors_are_exported():
    assert {"KvCacheFileNotFoundError", "KvCacheTypeError"} <= set(onnx_kvcache.errors.__all__)


# -- finding 13: no silent coercion ------------------------------------------------------------


def test_float_token_ids_are_refused_not_truncated(models):
    with pytest.raises(KvCacheTypeError, match=r"holds 1\.5; token ids are integers"):
        calibrate_kv_cache(models / "model.onnx", [[1.5] * 64], min_tokens=1)
    with pytest.raises(KvCacheTypeError, match="float64 array"):
        calibrate_kv_cache(models / "model.onnx", np.full((1, 64), 1.5), min_tokens=1)


def test_a_3d_id_array_is_named_3d(models):
    for data in (np.zeros((1, 2, 300), np.int64), [[[1, 2], [3, 4]]]):
        with pytest.raises(KvCacheError, match=r"3-D|holds a list"):
            calibrate_kv_cache(models / "model.onnx", data, min_tokens=1)


def test_a_scale_mapping_with_three_values_is_refused():
    with pytest.raises(KvCacheError, match="layer 0 has 3 values"):
        KvCacheScales.from_mapping({0: (0.1, 0.2, 0.3)})


def test_scales_for_more_layers_than_the_model_has_are_refused(tmp_path, models):
    (tmp_path / "s.json").write_text(json.dumps(scales_doc(layers=3)))
    code, err = run(
        [
            "convert",
            models / "model.onnx",
            tmp_path / "o.onnx",
            "--format",
            "int8",
            "--scales",
            tmp_path / "s.json",
        ]
    )
    assert code == 2 and "cover layer(s) [2] that this model does not have" in one_line(err)
    assert not (tmp_path / "o.onnx").exists()


# -- finding 14: messages that say what happened -----------------------------------------------


@pytest.mark.parametrize("slot", ["model", "scales", "text"])
def test_a_symlink_loop_is_called_a_loop(tmp_path, models, slot):
    loop = tmp_path / ("loop.json" if slot == "scales" else "loop.txt" if slot == "text" else "loop.onnx")
    os.symlink(loop.name, loop)
    if slot == "model":
        argv = ["convert", loop, tmp_path / "o.onnx", "--format", "int8"]
    elif slot == "scales":
        argv = ["convert", models / "model.onnx", tmp_path / "o.onnx", "--format", "int8", "--scales", loop]
    else:
        argv = ["calibrate", models / "genai", "--out", tmp_path / "s.json", "--text", loop]
    code, err = run(argv)
    assert code == 2 and "a symbolic link loop" in one_line(err) and "broken" not in err


def test_an_unknown_provider_in_provider_options_is_named(tmp_path, models):
    folder = tmp_path / "in"
    shutil.copytree(models / "genai", folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"tpu": {}}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_model(folder, tmp_path / "out", format="int8", scales={0: (0.1, 0.1), 1: (0.1, 0.1)})
    assert "'tpu', which is no provider onnx-kvcache knows" in result.target_source


@pytest.mark.parametrize(
    "doc, message",
    [
        (scales_doc(k=1e39), "must fit float32.*round to inf"),
        (scales_doc(k=1e-46), "must fit float32.*round to 0"),
        ({**scales_doc(), "qmax": 1e308}, "'qmax' must be a number from 1 to 65504"),
    ],
)
def test_out_of_range_scales_name_the_file_without_numpy_warnings(tmp_path, doc, message):
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" would raise here
        with pytest.raises(KvCacheError, match=message) as info:
            load_kv_cache_scale_file(tmp_path / "s.json", format="int8")
    assert str(tmp_path / "s.json") in str(info.value)


def test_the_loser_of_two_converts_into_one_new_folder_is_told_so(tmp_path, models, monkeypatch):
    out = tmp_path / "out"
    publish = file_io.TempDir.publish

    def someone_else_first(self, target, *, replace=False):
        os.mkdir(target)  # the other conversion's output appears just before our rename
        (pathlib.Path(target) / "theirs.onnx").write_bytes(b"theirs")
        return publish(self, target, replace=replace)

    monkeypatch.setattr(file_io.TempDir, "publish", someone_else_first)
    (tmp_path / "s.json").write_text(json.dumps(scales_doc()))
    code, err = run(["convert", models / "genai", out, "--format", "int8", "--scales", tmp_path / "s.json"])
    assert code == 2 and f"Output {out} was created by someone else" in one_line(err)
    assert "File exists" not in err and file_io.TEMP_PREFIX not in err
    assert [p.name for p in out.iterdir()] == ["theirs.onnx"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(file_io.TEMP_PREFIX)]


def test_the_loser_of_two_converts_to_one_new_file_is_told_so_without_a_temporary_path(
    tmp_path, models, monkeypatch
):
    """Issue 37, row 6: both planned a new output; the other published first, so this run's data
    file (the same free name) exists: once said as a rename of an internal temporary path."""
    from onnx_kvcache.files import conversion as model_files

    src, out = models / "genai" / "model.onnx", tmp_path / "out" / "model.onnx"
    (tmp_path / "s.json").write_text(json.dumps(scales_doc()))
    real, started, other = model_files._write_file, [], []

    def someone_else_first(*args, **kwargs):
        if not started:  # once: the other run goes through this function too
            started.append(True)
            other.append(convert_model(src, out, format="int8", scales=tmp_path / "s.json"))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_files, "_write_file", someone_else_first)
    code, err = run(["convert", src, out, "--format", "int8", "--scales", tmp_path / "s.json"])
    assert code == 2 and other[0].converted
    assert f"Output {out} was created by someone else" in one_line(err)
    assert "its data file model.onnx.data appeared" in err and file_io.TEMP_PREFIX not in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_an_os_error_never_names_a_temporary_entry(tmp_path):
    from onnx_kvcache.cli._output import _describe_os_error

    temp = tmp_path / f"{file_io.TEMP_PREFIX}123-abc" / "0"
    error = FileExistsError(17, "File exists", str(temp), None, str(tmp_path / "o.onnx.data"))
    assert _describe_os_error(error) == f"File exists: {tmp_path / 'o.onnx.data'}"
    assert _describe_os_error(OSError(28, "No space left on device", str(temp))) == "No space left on device"


# -- the fuzz test -----------------------------------------------------------------------------


def _tree_state(root: pathlib.Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): kind, size, inode, times, link target."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            state[os.path.relpath(path, root)] = (
                st.st_mode,
                st.st_size,
                st.st_ino,
                st.st_mtime_ns,
                st.st_ctime_ns,
                target,
            )
    return state


def _tree_hash(root: pathlib.Path) -> dict[str, str]:
    """The content of every regular file under ``root`` (links not followed)."""
    found = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                with open(path, "rb") as f:
                    found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


def pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))]


def _content(rng: np.random.Generator, kind: str) -> bytes:
    """A hostile file body: never a valid input of any of the slots it is given to."""
    n = int(rng.integers(1, 2000))
    if kind == "random":
        return rng.bytes(n)
    if kind == "deep":
        opener = "[" if rng.random() < 0.5 else '{"a":'
        return (opener * int(rng.integers(65, 100000 if rng.random() < 0.05 else 5000))).encode()
    if kind == "huge":
        digits = "".join(map(str, rng.integers(0, 10, int(rng.integers(31, 6000)))))
        body = pick(
            rng,
            [
                '{"scales": {"k_scales": [1%s], "v_scales": [1]}}',
                '{"scales": {"k_scales": [1], "v_scales": [1]}, "layer_ids": [1%s]}',
                "[[1, 2, 1%s]]",
                '{"model": {"decoder": {"filename": "model.onnx"}, "eos_token_id": 1%s}}',
                "[1e%s]",
            ],
        )
        return (body % digits).encode()
    if kind == "numbers":  # values out of range: floats, negatives, beyond int32 / float32
        value = pick(rng, ["1.5", "-1", "2147483648", "1e39", "1e-46", "NaN", "Infinity", "true", '"7"'])
        return pick(
            rng,
            [
                f"[[{value}, 1, 2]]",
                f'{{"scales": {{"k_scales": [{value}], "v_scales": [{value}]}}, "qmax": 1e308}}',
            ],
        ).encode()
    if kind == "npy":
        good = _npy(rng.integers(0, 300, (2, 64)))
        cut = int(rng.integers(0, len(good) - 1))
        return pick(rng, [good[:cut], good[:10] + rng.bytes(n), _npy(np.array([1, "x"], dtype=object))])
    if kind == "not utf-8":
        return b"\xff" + rng.bytes(n)
    raise AssertionError(kind)


SPECIAL = ["fifo", "loop", "dangling", "folder", "empty", "devnull"]
CONTENT = ["random", "deep", "huge", "numbers", "npy", "not utf-8"]
TEXT = [*SPECIAL, "not utf-8"]
"""What a text file may be and stay hostile: any readable UTF-8 is text to tokenize."""


def _place(rng: np.random.Generator, path: pathlib.Path, kind: str) -> pathlib.Path:
    """Make ``path`` the hostile entry ``kind``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "dangling":
        os.symlink("nowhere/" + path.name, path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "devnull":
        os.symlink(os.devnull, path)
    else:
        path.write_bytes(_content(rng, kind))
    return path


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


#: Command lines with one hostile file: ``{h}`` is it (named with the suffix given), ``{m}`` the
#: model file, ``{g}`` the genai folder, ``{c}`` a copy of it whose genai_config.json is ``{h}``,
#: ``{o}`` the output; ``{t}`` a good text file. Cheap ones (refused before a session) come often.
SLOTS = [
    (8, ".onnx", ["convert", "{h}", "{o}.onnx", "--format", "int8"]),
    (8, ".onnx", ["inspect", "{h}"]),
    (8, "genai_config.json", ["convert", "{c}", "{o}", "--format", "int8"]),
    (6, "genai_config.json", ["inspect", "{c}"]),
    (8, ".json", ["convert", "{m}", "{o}.onnx", "--format", "int8", "--scales", "{h}"]),
    (6, ".json", ["convert", "{m}", "{o}.onnx", "--scales", "{h}"]),
    (0.6, ".json", ["calibrate", "{g}", "--out", "{o}.json", "--token-ids", "{h}", "--min-tokens", "1"]),
    (0.6, ".npy", ["calibrate", "{g}", "--out", "{o}.json", "--token-ids", "{h}", "--min-tokens", "1"]),
    (0.6, ".txt", ["calibrate", "{g}", "--out", "{o}.json", "--text", "{h}", "--min-tokens", "1"]),  # TEXT
    (0.6, ".json", ["calibrate", "{m}", "--out", "{o}.json", "--text", "{t}", "--tokenizer", "{h}"]),
    (0.3, ".npy", ["evaluate", "{m}", "{m}", "--token-ids", "{h}", "--json", "{o}.json"]),
]
CASES = 3000


def test_fuzz_the_commands_file_arguments(tmp_path, models, monkeypatch):
    """Hostile files in every file argument: exit 1 or 2, one line on stderr, no traceback,
    nothing written, nothing else changed. Entry states (inode, size, times) are compared
    around every case and the content of every file before and after the whole run.

    The parser is built once (building it is most of a refused run's time); parsing is the
    command's own."""
    signal.alarm(0)  # the per-test alarm is set per case below
    monkeypatch.setattr(cli, "build_parser", functools.cache(cli.build_parser))
    root = tmp_path / "tree"
    shutil.copytree(models, root / "models")
    config_copy = root / "c"
    shutil.copytree(models / "genai", config_copy)
    (config_copy / "genai_config.json").unlink()
    (root / "good.txt").write_text("some text to tokenize " * 20)
    out = root / "out"
    before_all = _tree_hash(root)
    rng = np.random.default_rng(20)
    weights = np.array([w for w, _, _ in SLOTS], float)
    kinds = SPECIAL + CONTENT
    seen = {}
    for case in range(CASES):
        _, suffix, template = SLOTS[rng.choice(len(SLOTS), p=weights / weights.sum())]
        kind = pick(rng, TEXT if suffix == ".txt" else kinds)
        if suffix == "genai_config.json":
            hostile = _place(rng, config_copy / "genai_config.json", kind)
        else:
            hostile = _place(rng, root / f"h{suffix}", kind)
        values = {"h": hostile, "m": root / "models/model.onnx", "g": root / "models/genai", "c": config_copy}
        values |= {"o": out, "t": root / "good.txt"}
        argv = [a.format(**values) for a in template]
        state = _tree_state(root)
        signal.alarm(20)
        try:
            code, err = run(argv)
        finally:
            signal.alarm(0)
        where = f"case {case} ({kind}): {' '.join(argv)}"
        assert code in (1, 2), f"{where}: exit {code}: {err}"
        assert err.count("\n") == 1 and err.startswith("onnx-kvcache: "), f"{where}: {err}"
        assert "Traceback" not in err
        assert _tree_state(root) == state, f"{where}: the tree changed"
        assert not any(os.path.lexists(f"{out}{s}") for s in ("", ".onnx", ".json")), where
        seen[kind, template[0]] = seen.get((kind, template[0]), 0) + 1
        _remove(hostile)
    assert _tree_hash(root) == {k: v for k, v in before_all.items()}
    assert len(seen) >= len(kinds) * 3  # every kind of file met several commands


# -- review of issue 20: a signal during an optional import is no missing dependency -------


def _import_onnxruntime():
    from onnx_kvcache.model_io._sessions import import_onnxruntime

    import_onnxruntime()


def _import_matplotlib():
    from onnx_kvcache.runtime._plots import _pyplot

    _pyplot()


def _import_tokenizers(tmp_path):
    from onnx_kvcache.scales.data import tokenize_text

    tokenize_text("some text", tmp_path / "tokenizer.json")


_GUARDS = {
    "onnxruntime": lambda tmp_path: _import_onnxruntime(),
    "matplotlib": lambda tmp_path: _import_matplotlib(),
    "tokenizers": _import_tokenizers,
}


@pytest.mark.parametrize("module", list(_GUARDS))
@pytest.mark.parametrize("how", ["missing", "interrupted", "interrupted inside"])
def test_an_interrupt_during_an_optional_import_propagates(tmp_path, monkeypatch, module, how):
    import builtins

    from onnx_kvcache._signals import Interrupted
    from onnx_kvcache.errors import MissingRuntimeError

    real = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.split(".")[0] != module:
            return real(name, *args, **kwargs)
        if how == "missing":
            raise ImportError(f"No module named {module!r}")
        try:  # an extension module's init stopped by the handler: reported as an ImportError
            raise Interrupted(signal.SIGINT)
        except Interrupted as e:
            if how == "interrupted":
                raise ImportError("initialization failed") from e
            raise ImportError("initialization failed")  # noqa: B904 (the context chain only)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    for name in list(sys.modules):
        if name.split(".")[0] == module:
            monkeypatch.delitem(sys.modules, name)
    expected = MissingRuntimeError if how == "missing" else Interrupted
    with pytest.raises(expected):
        _GUARDS[module](tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{d}/m.onnx", "{d}/o.onnx", "--scales", "{d}/no\nsuch.json"],
        ["inspect", "{d}/bad\x1b[31mred"],
        ["inspect", "{d}/new\nline\rand\x07bell"],
        ["calibrate", "{d}/m.onnx", "--out", "{d}/x\n.json"],
    ],
)
def test_a_path_with_control_characters_prints_as_one_inert_line(tmp_path, capsys, argv):
    ir.save(build_decoder(num_layers=2), tmp_path / "m.onnx")
    os.mkdir(tmp_path / "x\n.json")  # a folder: refused
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onnx-kvcache: error: "), err
    assert not any(c in err[:-1] for c in "\n\r\x1b\x07"), err
    assert "\\n" in err or "\\x1b" in err, err


@pytest.mark.parametrize("ndim", [3, 40, 2000])
def test_a_long_npy_shape_is_shown_shortened(tmp_path, capsys, ndim):
    ids = tmp_path / "ids.npy"
    with open(ids, "wb") as f:
        header = {"descr": "<i8", "fortran_order": False, "shape": (1,) * ndim}
        np.lib.format.write_array_header_2_0(f, header)
        f.write(b"\0" * 8)
    model = tmp_path / "m.onnx"
    ir.save(build_decoder(num_layers=2), model)
    assert main(["calibrate", str(model), "--out", str(tmp_path / "s.json"), "--token-ids", str(ids)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"a {ndim}-D array" in err and len(err) < 400, err


# -- issue 45, rows 3 to 5: a yes/no argument is True or False, never a truthy string ------------


def _flags() -> list[tuple[str, str]]:
    """Every (public callable, yes/no parameter): annotated ``bool`` or ``bool | None``, results
    (dataclasses the library returns) left out."""
    found = []
    for name in onnx_kvcache.__all__:
        obj = getattr(onnx_kvcache, name)
        if dataclasses.is_dataclass(obj) or not callable(obj):
            continue
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            continue
        found += [(name, p.name) for p in parameters if str(p.annotation) in ("bool", "bool | None")]
    return found


#: Valid values for the parameters a call needs before its flags (by name).
_REQUIRED = dict.fromkeys(
    ("model", "model_or_path", "in_path", "path", "baseline", "candidate"), "model.onnx"
)


def test_every_public_yes_no_argument_is_found():
    flags = set(_flags())
    assert {
        ("convert_model", "in_place"),
        ("optimize_model", "fp8_kv_cache"),
        ("KvCacheRunner", "quantized_io"),
    } <= flags
    assert {
        ("calibrate_kv_cache", "rope_envelope"),
        ("evaluate_kv_cache", "progress"),
        ("load_model", "follow_symlinks"),
    } <= flags


@pytest.mark.parametrize("name, flag", _flags())
@pytest.mark.parametrize("value", ["no", "false", 0, 1.0])
def test_a_yes_no_argument_that_is_no_bool_is_a_type_error(models, monkeypatch, name, flag, value):
    monkeypatch.chdir(models)
    obj = getattr(onnx_kvcache, name)
    target = obj.__init__ if inspect.isclass(obj) else obj
    required = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD and p.name != "self"
    ]
    before = (models / "model.onnx").read_bytes()
    with pytest.raises(
        KvCacheTypeError, match=rf"^{flag} must be True or False(, or None)?|^{flag} must be True, False"
    ):
        obj(*[_REQUIRED[p] for p in required], **{flag: value})
    assert (models / "model.onnx").read_bytes() == before
    assert sorted(p.name for p in models.iterdir()) == ["genai", "model.onnx"]


def test_in_place_false_as_a_string_leaves_the_input_untouched(models, monkeypatch, tmp_path):
    source = tmp_path / "model.onnx"
    shutil.copy(models / "model.onnx", source)
    before = source.read_bytes()
    with pytest.raises(KvCacheTypeError, match=r"^in_place must be True or False, got str \('false'\)"):
        convert_model(source, None, in_place="false", scales=scales_doc(), format="int8")
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda r: r.generate([1, 2, 3], "3"), r"^max_new_tokens must be an integer, got str"),
        (lambda r: r.generate([1, 2, 3], 2, eos_token_id="2"), r"^eos_token_id must be a token id or None"),
        (lambda r: r.step("3"), r"^Token ids must be integers, got <U1"),
        (lambda r: r.step(2.0), r"^Token ids must be integers, got float64"),
        (lambda r: r.reset("2"), r"^batch must be an integer, got str"),
    ],
)
def test_runner_arguments_of_the_wrong_type_are_one_type_error(models, call, message):
    with pytest.raises(KvCacheTypeError, match=message):
        call(KvCacheRunner(models / "model.onnx"))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda m: onnx_kvcache.optimize_model(m, format="int8", fuse_attention="false"),
            KvCacheTypeError,
            "fuse_attention",
        ),
        (lambda m: KvCacheRunner(m).generate("abc", 2), KvCacheTypeError, "^Token ids must be a list"),
        (lambda m: KvCacheRunner(m).generate(5, 2), KvCacheTypeError, "^Token ids must be a list"),
        (lambda m: KvCacheRunner(m).prefill([[1, 2], [3]]), KvCacheError, "rows of one length"),
        (lambda m: KvCacheRunner(m).reset(-1), KvCacheError, "batch >= 1"),
    ],
)
def test_the_hostile_users_type_findings_are_one_line(call, error, message):
    """Hostile user of issue 45, finding 9."""
    with pytest.raises(error, match=message):
        call(build_decoder(num_layers=2, vocab_size=300))


def test_an_empty_model_path_is_said_to_be_empty(capsys):
    """Hostile user of issue 45, finding 15: "" was read as the current folder."""
    with pytest.raises(KvCacheError, match=r"^The model.s path is empty"):
        onnx_kvcache.load_model("")
    assert main(["inspect", ""]) == 2 and "path is empty" in capsys.readouterr().err


def test_a_numpy_bool_is_named_as_numpys():
    with pytest.raises(
        KvCacheTypeError, match=r"^progress must be True or False, got numpy\.bool \(np\.True_\)"
    ):
        onnx_kvcache.calibrate_kv_cache("model.onnx", progress=np.True_)
