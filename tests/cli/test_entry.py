"""The executable: a signal at any moment from import to exit is one line and exit 128 + N.

Each case runs ``onnx-kvcache convert`` in a child process that sends itself the signal at
one exact moment (a hook on an import, on the commit, on a printed line, on exit), so the
moment is never left to timing.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache.models.decoder import build_decoder

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]

_CHILD = """
import atexit, os, signal, sys
moment, signum = sys.argv[1], int(sys.argv[2])
sys.argv = ["onnx-kvcache", *sys.argv[3:]]

def fire(*args, **kwargs):
    os.kill(os.getpid(), signum)

if moment == "importing":  # while the command imports onnx-ir
    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == "onnx_ir":
                fire()
            return None
    sys.meta_path.insert(0, Hook())
elif moment == "exiting":  # after the command returned: in the exit functions
    atexit.register(fire)
else:  # set up (imports done here, before the handlers: the hooks need the modules)
    from onnx_kvcache.files import conversion as model_files
    from onnx_kvcache.model_io import _atomic as _file_io
    def after(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            fire()
            return result
        return call
    if moment == "committed":  # the output is complete; the conversion still has work to do
        _file_io.publish_as_one = after(_file_io.publish_as_one)
    elif moment == "printing":  # the summary lines
        model_files.ConvertResult.weights_summary = after(model_files.ConvertResult.weights_summary)
from onnx_kvcache.cli._entry import main
main()
"""

EXPECTED = {  # what the one line says after "stopped by SIGNAL"
    "importing": "; nothing was written.",
    "committed": "; the output is complete: {out}.",
    "printing": "; the conversion completed ({out}).",
    "exiting": " as it exited; the conversion completed ({out}).",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("entry")
    model = build_decoder(num_layers=2, vocab_size=300)
    ir.save(model, folder / "model.onnx", external_data="model.onnx.data")
    scales = {"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}
    (folder / "scales.json").write_text(json.dumps(scales))
    return folder


@pytest.mark.parametrize("moment", EXPECTED)
def test_a_signal_at_any_moment_is_one_line_and_exit_128_plus_n(model, tmp_path, moment):
    """Ctrl-C while importing printed a KeyboardInterrupt traceback; a signal after the commit,
    once main had returned, killed the process silently (the default handler was back)."""

    def run(signum):
        out = tmp_path / signal.Signals(signum).name / "m.onnx"
        argv = ["convert", str(model / "model.onnx"), str(out), "--scales", str(model / "scales.json")]
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, moment, str(int(signum)), *argv, "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return out, proc

    with concurrent.futures.ThreadPoolExecutor(len(SIGNALS)) as pool:
        runs = list(pool.map(run, SIGNALS))
    for signum, (out, proc) in zip(SIGNALS, runs):
        line = f"onnx-kvcache: stopped by {signal.Signals(signum).name}" + EXPECTED[moment].format(
            out=out, model=model / "model.onnx"
        )
        assert (proc.returncode, proc.stderr) == (128 + signum, line + "\n"), (proc.returncode, proc.stderr)
        assert out.exists() == (moment != "importing")
        assert not [p for p in out.parent.glob(".onnx-kvcache-tmp-*")] if out.parent.exists() else True


def test_the_package_imports_nothing_heavy_before_the_handlers():
    """What makes the import-time case possible: the entry point loads in milliseconds."""
    code = (
        "import sys, onnx_kvcache.cli._entry; print(sorted({'onnx_ir', 'numpy', 'onnx'} & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


_AS_THE_CONSOLE_SCRIPT = """
import _signal, atexit, json, os, sys
signum = int(sys.argv[1])
sys.argv = ["/usr/local/bin/onnx-kvcache", "--version"]  # as pip's script runs
looked_up = []  # (module, whether the entry point's record was in place)
started_with = _signal.getsignal(_signal.SIGINT)  # SIG_IGN in a shell's background job

class Hook:  # every module the import system looks for from the script's import line on
    def find_spec(self, name, path=None, target=None):
        recording = _signal.getsignal(_signal.SIGINT) is not started_with
        looked_up.append((name, recording))
        if recording and signum and sum(r for _, r in looked_up) == 1:  # the first moment covered
            os.kill(os.getpid(), signum)
        return None

atexit.register(lambda: print(json.dumps(looked_up)))
sys.meta_path.insert(0, Hook())
from onnx_kvcache.cli._entry import main
main()
"""


def _as_the_console_script(signum: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _AS_THE_CONSOLE_SCRIPT, str(int(signum))],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_console_script_runs_no_code_of_the_package_before_the_signal_record():
    """pip's script imports onnx_kvcache/__init__.py and cli/__init__.py before _entry's first line:
    they import nothing, so the record starts as _entry is found (the root __init__ once read
    sys.argv[0] and imported _entry itself, a 0.x module finder after it)."""
    proc = _as_the_console_script(0)
    assert proc.returncode == 0, proc.stderr
    looked_up = json.loads(proc.stdout.splitlines()[-1])
    before = [name for name, recording in looked_up if not recording]
    assert before == ["onnx_kvcache", "onnx_kvcache.cli", "onnx_kvcache.cli._entry"]
    assert [name for name, recording in looked_up if recording][:1] != []  # the hook sees the rest


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_console_script_imports_the_package_is_one_line(signum):
    """At the first import after the package's __init__s (the earliest moment a hook sees): a
    Ctrl-C while the console script imported the package was a KeyboardInterrupt traceback
    (SIGTERM: killed without a word)."""
    proc = _as_the_console_script(signum)
    name = signal.Signals(signum).name
    assert (proc.returncode, proc.stderr) == (
        128 + signum,
        f"onnx-kvcache: stopped by {name}; nothing was written.\n",
    ), proc.stderr


@pytest.mark.parametrize("argv0", ["-c", "/usr/bin/python", "/usr/local/bin/onnx-kvcache", "onnx-kvcache"])
def test_importing_the_package_installs_no_handler_and_imports_nothing(argv0):
    """Signal handling starts in the entry point, never on import, even in the console script.

    Compared with what the interpreter started with: a shell's background job starts with
    SIGINT ignored, and Python then keeps SIG_IGN rather than its default_int_handler."""
    code = (
        f"import signal, sys; sys.argv[0] = {argv0!r}; before = signal.getsignal(signal.SIGINT); "
        "import onnx_kvcache; print(signal.getsignal(signal.SIGINT) is before, "
        "sorted(m for m in sys.modules if m.startswith('onnx')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True ['onnx_kvcache']"


_INSIDE_AN_EXTENSION = """
import os, sys
record, signum, held = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "held"
sys.argv = ["onnx-kvcache", *sys.argv[4:]]

def initializing(extension):
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name in ("create_module", "exec_module") and extension in (
            getattr(frame.f_locals.get("spec"), "name", None),
            getattr(frame.f_locals.get("module"), "__name__", None),
        ):
            return True
        frame = frame.f_back
    return False

class Hook:  # numpy's C extension imports datetime from its initialization (PyCapsule_Import)
    def find_spec(self, name, path=None, target=None):
        if name == "datetime" and initializing("numpy._core._multiarray_umath"):
            open(record, "w").write("fired")
            os.kill(os.getpid(), signum)
        return None

sys.meta_path.insert(0, Hook())
if not held:  # what the command did before: the imports under the handlers, none held
    import contextlib
    from onnx_kvcache import _signals
    _signals.extension_imports_held = _signals.held = contextlib.nullcontext
from onnx_kvcache.cli._entry import main
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_c_extension_initializes_is_raised_after_it(model, tmp_path, signum):
    """The handler raised inside numpy's (or onnx's nanobind) module initialization: numpy
    printed a 50-line ImportError traceback, onnx aborted (134) or crashed (139)."""

    def run(held: str) -> subprocess.CompletedProcess[str]:
        record = tmp_path / f"{held}.txt"
        argv = [record, int(signum), held, "inspect", model / "model.onnx"]
        proc = subprocess.run(
            [sys.executable, "-c", _INSIDE_AN_EXTENSION, *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert record.read_text() == "fired", "numpy no longer imports datetime as it initializes"
        return proc

    held, unheld = run("held"), run("unheld")
    name = signal.Signals(signum).name
    assert (held.returncode, held.stderr) == (
        128 + signum,
        f"onnx-kvcache: stopped by {name}; nothing was written.\n",
    )
    assert "Traceback" in unheld.stderr  # the case is real: unheld, it is not one line
