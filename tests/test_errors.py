"""errors.py's messages: parameters and functions as parts, said in Python's words or the command's."""

from __future__ import annotations

import ast
import pathlib
import pickle
import warnings

import pytest

import onnx_kvcache
from onnx_kvcache.cli.commands import _wording
from onnx_kvcache.errors import (
    PYTHON,
    Function,
    KvCacheError,
    KvCacheTypeError,
    KvCacheWarning,
    Message,
    Param,
    Wording,
    render,
    warn,
)

SRC = pathlib.Path(onnx_kvcache.__file__).parent
PARTS = (
    "Pass ",
    Param("scales", placeholder="PATH"),
    " or ",
    Param("in_place", True),
    " (",
    Function("calibrate_kv_cache"),
    ").",
)


@pytest.mark.parametrize(
    ("wording", "said"),
    [
        (PYTHON, "Pass scales=PATH or in_place=True (calibrate_kv_cache())."),
        (None, "Pass --scales PATH or --in-place (onnx-kvcache calibrate)."),  # the command's
    ],
)
def test_a_message_is_said_in_each_audiences_words(wording, said):
    message = Message(*PARTS)
    assert message.render(wording or _wording()) == said
    assert render(KvCacheError(*PARTS), wording or _wording()) == said


@pytest.mark.parametrize(
    ("param", "python", "cli"),
    [
        (Param("in_place", True), "in_place=True", "--in-place"),
        (Param("in_place", False), "in_place=False", "in_place=False"),  # no option gives it
        (Param("rope_envelope", False), "rope_envelope=False", "--no-rope-envelope"),
        (Param("rope_envelope", True), "rope_envelope=True", "rope_envelope=True"),
        (Param("granularity", "per_channel"), "granularity='per_channel'", "--granularity per_channel"),
        (Param("seq_len", placeholder="N"), "seq_len=N", "--seq-len N"),
        (Param("margin", 2.0), "margin=2.0", "--margin 2.0"),
        (Param("scales"), "scales", "--scales"),
        (Param("io_binding", False), "io_binding=False", "io_binding=False"),  # no option at all
        (Param("verify", True), "verify=True", "--verify"),  # --verify / --no-verify: each its own
        (Param("verify", False), "verify=False", "--no-verify"),
    ],
)
def test_a_parameter_is_its_option_only_where_one_sets_it(param, python, cli):
    assert PYTHON.param(param) == python
    assert _wording().param(param) == cli


def test_a_function_is_the_command_that_does_the_same():
    calibrate = Function("calibrate_kv_cache", (Param("format", "int8"), Param("method", "mse")))
    assert PYTHON.function(calibrate) == "calibrate_kv_cache(format='int8', method='mse')"
    assert _wording().function(calibrate) == "onnx-kvcache calibrate --format int8 --method mse"
    assert _wording().function(Function("optimize_model")) == "optimize_model()"  # no command runs it
    commands = {
        "convert_model",
        "inspect_kv_cache",
        "calibrate_kv_cache",
        "evaluate_kv_cache",
        "compare_continuations",
        "run_doctor",
    }
    assert set(_wording().commands) == commands
    assert all(hasattr(onnx_kvcache, name) for name in commands)


def test_one_vocabulary_across_the_python_api():
    """optimize_model, convert_model and calibrate_kv_cache name a parameter alike; the command's
    options are those names (``format``: ``--format``)."""
    import inspect

    signatures = {
        f: inspect.signature(getattr(onnx_kvcache, f)).parameters
        for f in ("optimize_model", "convert_model", "calibrate_kv_cache")
    }
    for name in ("format", "granularity"):
        assert all(name in params for params in signatures.values()), name
    for name in ("scales", "ep"):
        assert name in signatures["optimize_model"] and name in signatures["convert_model"], name
    words = ("kv_cache_format", "kv_cache_granularity", "kv_cache_scales", "execution_provider")
    assert not {n for params in signatures.values() for n in params} & set(words)
    assert "fp8_kv_cache" in signatures["optimize_model"]  # the card's shorthand for format="fp8"
    for name in ("format", "granularity", "scales", "ep"):
        assert _wording().param(Param(name)) == f"--{name}"


def test_optimize_model_and_convert_model_say_the_same_words(tmp_path):
    """Both refuse int8 without scales in one vocabulary: ``scales=PATH``."""
    import onnx_ir as ir

    from onnx_kvcache.models.decoder import build_decoder

    model_file = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2), model_file)
    with pytest.raises(KvCacheError) as info:
        onnx_kvcache.optimize_model(model_file, format="int8", ep=None)
    assert " scales=PATH" in str(info.value) and "kv_cache_" not in str(info.value)
    with pytest.raises(KvCacheError) as info:
        onnx_kvcache.convert_model(model_file, tmp_path / "o.onnx", format="int8")
    assert " scales=PATH" in str(info.value) and "kv_cache_" not in str(info.value)


def test_composing_keeps_the_parts():
    first, second = Message("a ", Param("in_place", True)), Message(Param("overwrite", True), " b")
    for made in (first + "; " + second, Message.joined([first, second], "; "), "x " + first):
        assert isinstance(made, Message)
    assert (first + "; " + second).render(_wording()) == "a --in-place; --overwrite b"
    assert (
        Message.joined([first, "plain", second], "; ").render(_wording())
        == "a --in-place; plain; --overwrite b"
    )
    assert ("x " + first).render(_wording()) == "x a --in-place"


def test_an_error_keeps_its_class_and_parts_through_pickling():
    error = KvCacheTypeError("got ", Param("seq_len", "64"))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is KvCacheTypeError and str(again) == "got seq_len='64'"
    assert render(again, _wording()) == "got --seq-len 64"
    assert str(KvCacheError("plain text")) == "plain text" and KvCacheError("plain").args == ("plain",)
    assert str(pickle.loads(pickle.dumps(Message(Param("scales"))))) == "scales"


def test_a_warning_carries_the_parts():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        warn(Message("use ", Param("overwrite", True)))
        warn(said[0].message)  # said again, as a recorded warning is replayed: same class, same parts
    assert [w.category for w in said] == [KvCacheWarning, KvCacheWarning]
    for w in said:
        assert str(w.message) == "use overwrite=True"
        assert render(w.message, _wording()) == "use --overwrite"


def test_the_base_wording_is_python():
    assert Wording().param(Param("ep", "cuda")) == "ep='cuda'" == PYTHON.param(Param("ep", "cuda"))


# -- no code reads or rewrites message text ---------------------------------------------

#: Names a message's text travels under (a refusal's reasons, a note), and an error's or a
#: warning's (read as ``str(e)``).
_MESSAGE_NAMES = {"message", "messages", "reason", "reasons", "note", "notes", "said", "warning"}
_RAISED_NAMES = {"e", "error", "exc", "warning"}
#: What reads message text today in files other helpers own, and what replaces it: an entry
#: that no longer reads text fails the test, so the list only shrinks.
_ELSEWHERE: dict[str, str] = {}  # every module: none reads a message's text
_REGEX = {"sub", "subn", "match", "search", "fullmatch", "findall", "finditer", "split"}


def _message_like(node: ast.expr) -> bool:
    """``message``, ``e.message``, ``result.reasons``, ``str(e)``, ``r`` for ``r in reasons``..."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        inner = node.args[0]
        return _message_like(inner) or (isinstance(inner, ast.Name) and inner.id in _RAISED_NAMES)
    if isinstance(node, ast.Subscript):
        return _message_like(node.value)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in _MESSAGE_NAMES


def _loop_names(tree: ast.AST) -> set[str]:
    """Names bound by iterating over a message-like sequence (``for r in result.reasons``)."""
    bound = set()
    for node in ast.walk(tree):
        loops = [node] if isinstance(node, ast.For) else getattr(node, "generators", [])
        for loop in loops:
            if _message_like(loop.iter) and isinstance(loop.target, ast.Name):
                bound.add(loop.target.id)
    return bound


def _text(node: ast.expr) -> bool:
    """One message's text (``"x" in str(e)``, ``in message``), not a list of them (``r not in
    reasons`` compares whole messages: a duplicate)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
        return _message_like(node)
    return _message_like(node) and not (isinstance(node, (ast.Name, ast.Attribute)) and _plural(node))


def _plural(node: ast.Name | ast.Attribute) -> bool:
    return (node.id if isinstance(node, ast.Name) else node.attr).endswith("s")


def _reads_of_message_text(tree: ast.AST) -> list[tuple[int, str]]:
    loops = _loop_names(tree)

    def message(node: ast.expr) -> bool:
        return _message_like(node) or (isinstance(node, ast.Name) and node.id in loops)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, subject = node.func.attr, node.func.value
            if attr in ("startswith", "endswith", "replace", "removeprefix", "removesuffix") and message(
                subject
            ):
                found.append((node.lineno, attr))
            if attr in _REGEX and any(message(a) for a in node.args):  # re.sub(p, r, text), p.match(text)
                found.append((node.lineno, f"regex {attr}"))
        if (
            isinstance(node, ast.Compare)
            and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops)
            and _text(node.comparators[0])
        ):
            found.append((node.lineno, "in"))
    return found


def test_no_source_reads_or_rewrites_message_text():
    """A startswith/endswith/replace, a regular expression or an ``in`` over an error's, a
    warning's or a reason's text: code that depends on wording (the parts say it instead)."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        reads = _reads_of_message_text(ast.parse(path.read_text()))
        if reads:
            found[path.relative_to(SRC).as_posix()] = [f"{line} {what}" for line, what in reads]
    assert set(found) == set(_ELSEWHERE), found


@pytest.mark.parametrize(
    ("code", "caught"),
    [
        ("if any(r.startswith('check_device') for r in result.reasons): pass", True),
        ("if str(e).startswith('Output'): pass", True),
        ("text = re.sub(r'scales=', 'kv_cache_scales=', str(error))", True),
        ("if 'in_place' in str(e): pass", True),
        ("if message.endswith('.'): pass", True),
        ("if str(out_path).endswith('/'): pass", False),  # a path, not a message
        ("if 'CUDA' in str(p): pass", False),
        ("if any(reason is NO_GPU for reason in result.reasons): pass", False),  # identity: structure
    ],
)
def test_the_message_text_check_catches_what_it_should(code, caught):
    assert bool(_reads_of_message_text(ast.parse(code))) is caught


def test_no_warning_filter_names_message_text():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(k.arg == "message" for k in node.keywords):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("filterwarnings", "catch_warnings"):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found


def test_a_pickled_message_keeps_its_text_and_parts():
    """An error raised in one process says the same, and renders the same, in another."""
    error = KvCacheError(Param("scales"), " were given without ", Param("format"), ".")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) == "scales were given without format."
    assert again.args[0].parts == error.args[0].parts
    assert render(again, _wording()) == "--scales were given without --format."
