"""What the commands that read a model and write files share: the options passed through as
library parameters, the files an output must never replace, publishing the outputs as one
unit, and the ``wrote``/``replaced`` words that end a run.

Imports the standard library and the package's light modules at import time; the model's
readers are imported when a command runs.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from onnx_kvcache import _signals
from onnx_kvcache.cli._output import _printable
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io import write_outputs


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``{name: args.name}``: options passed as the library parameters of the same name."""
    return {name: getattr(args, name) for name in names}


def _model_inputs(model: str, *files: str | None) -> list[pathlib.Path]:
    """Files an output must never replace: every file of the model as ``convert`` finds them
    (its graph, each external data file it names, and every file of a genai folder:
    ``genai_config.json``, tokenizer files), and the data files given."""
    from onnx_kvcache.model_io.genai_folder import GENAI_CONFIG, resolve_model_path
    from onnx_kvcache.model_io.reading import open_model_source

    model_file, config = resolve_model_path(model)
    inputs = [model_file, *(pathlib.Path(f) for f in files if f)]
    if config is not None:
        inputs.append(pathlib.Path(model) / GENAI_CONFIG)
    try:
        inputs += sorted(open_model_source(model, follow_symlinks=True).input_files())
    except (KvCacheError, OSError):  # a model convert refuses: the run says why, or reads no more
        folder = pathlib.Path(model)
        if folder.is_dir():
            inputs += sorted(p for p in folder.iterdir() if p.is_file())
    return inputs


def _write_completely(
    args: argparse.Namespace,
    outputs: list[tuple[str, bytes, str]],
    done: str,
    inputs: list[pathlib.Path],
    seen: list[Any] | None = None,
) -> list[pathlib.Path]:
    """Publish ``outputs`` as one unit; a signal held over the publication says they were
    written. ``seen``: the outputs' identities before the work (one changed since: refused).
    The files that replaced one."""
    try:
        replaced = write_outputs(outputs, overwrite=args.overwrite, inputs=inputs, seen=seen)
    except _signals.Interrupted as e:
        if e.completed and e.detail is None:
            e.detail = done
        raise
    args.done = done
    return replaced


def _wrote(path: str, replaced: list[pathlib.Path]) -> str:
    """``wrote PATH``, or ``replaced PATH`` when it replaced a file (the path one inert line,
    as in errors)."""
    return f"{'replaced' if pathlib.Path(path) in replaced else 'wrote'} {_printable(str(path))}"
