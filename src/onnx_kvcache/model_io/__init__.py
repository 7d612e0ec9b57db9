"""Models and files in and out, below everything: reading a model, onnxruntime-genai folders, the
converted marker, safe input reads and guarded output writes, and importing onnxruntime.

The names other folders use are this package's public names, read from their private modules
(PEP 562: importing one module of the folder imports nothing else of it, so the command starts
before onnxruntime, onnx-ir and numpy are imported). The file writers use them as
``model_io.copy_data(...)``: a test that patches ``_atomic.copy_data`` reaches them."""

from __future__ import annotations

__all__ = [
    "CONVERTED",
    "Identity",
    "MARKER_KEY",
    "TEMP_PREFIX",
    "TempDir",
    "allocated_bytes",
    "atomic_write_bytes",
    "calibrated_by",
    "check_demo_folder",
    "check_input_file",
    "check_output",
    "check_replaceable_file",
    "check_replaceable_folder",
    "check_writable_folder",
    "clone_file",
    "converted_for",
    "copy_data",
    "create_session",
    "fed_as_bits",
    "format_bytes",
    "free_bytes",
    "host_array",
    "import_onnxruntime",
    "installed_ort_version",
    "installed_version",
    "is_mount_point",
    "is_output_folder",
    "keep_mode_and_owner",
    "load_json",
    "load_npy_integers",
    "locked_output",
    "make_dirs",
    "marker",
    "ort_error_text",
    "own_data_files",
    "publish_as_one",
    "publish_into_empty",
    "read_input_bytes",
    "read_input_chunks",
    "record_demo_folder",
    "remove_empty_dirs",
    "run_on_host",
    "same_output",
    "shown_shape",
    "stamp_json",
    "stamp_png",
    "sweep_stale",
    "to_ort_value",
    "tokenizer_file",
    "unloadable_header",
    "write_new_file",
    "write_output",
    "write_outputs",
]

TYPE_CHECKING = False  # typing is not imported: importing the folder stays cheap

_EXPORTS = {  # where each name lives; imported on first use
    "onnx_kvcache.model_io._atomic": (
        "Identity",
        "TEMP_PREFIX",
        "TempDir",
        "allocated_bytes",
        "atomic_write_bytes",
        "check_writable_folder",
        "clone_file",
        "copy_data",
        "format_bytes",
        "free_bytes",
        "is_mount_point",
        "keep_mode_and_owner",
        "locked_output",
        "make_dirs",
        "publish_as_one",
        "publish_into_empty",
        "remove_empty_dirs",
        "sweep_stale",
        "write_new_file",
    ),
    "onnx_kvcache.model_io._inputs": (
        "check_input_file",
        "load_json",
        "load_npy_integers",
        "read_input_bytes",
        "read_input_chunks",
        "shown_shape",
        "tokenizer_file",
    ),
    "onnx_kvcache.model_io._marker": (
        "MARKER_KEY",
        "calibrated_by",
        "check_replaceable_file",
        "check_replaceable_folder",
        "converted_for",
        "is_output_folder",
        "marker",
        "own_data_files",
    ),
    "onnx_kvcache.model_io._outputs": (
        "CONVERTED",
        "check_demo_folder",
        "check_output",
        "record_demo_folder",
        "same_output",
        "stamp_json",
        "stamp_png",
        "write_output",
        "write_outputs",
    ),
    "onnx_kvcache.model_io._sessions": (
        "create_session",
        "fed_as_bits",
        "host_array",
        "import_onnxruntime",
        "installed_ort_version",
        "installed_version",
        "ort_error_text",
        "run_on_host",
        "to_ort_value",
        "unloadable_header",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """A public name, read from its private module at each use (PEP 562): imported on first
    use, never copied here, so ``monkeypatch.setattr(<private module>, name, ...)`` reaches
    every caller that says ``folder.name``."""
    import importlib

    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from onnx_kvcache.model_io._atomic import (
        TEMP_PREFIX,
        Identity,
        TempDir,
        allocated_bytes,
        atomic_write_bytes,
        check_writable_folder,
        clone_file,
        copy_data,
        format_bytes,
        free_bytes,
        is_mount_point,
        keep_mode_and_owner,
        locked_output,
        make_dirs,
        publish_as_one,
        publish_into_empty,
        remove_empty_dirs,
        sweep_stale,
        write_new_file,
    )
    from onnx_kvcache.model_io._inputs import (
        check_input_file,
        load_json,
        load_npy_integers,
        read_input_bytes,
        read_input_chunks,
        shown_shape,
        tokenizer_file,
    )
    from onnx_kvcache.model_io._marker import (
        MARKER_KEY,
        calibrated_by,
        check_replaceable_file,
        check_replaceable_folder,
        converted_for,
        is_output_folder,
        marker,
        own_data_files,
    )
    from onnx_kvcache.model_io._outputs import (
        CONVERTED,
        check_demo_folder,
        check_output,
        record_demo_folder,
        same_output,
        stamp_json,
        stamp_png,
        write_output,
        write_outputs,
    )
    from onnx_kvcache.model_io._sessions import (
        create_session,
        fed_as_bits,
        host_array,
        import_onnxruntime,
        installed_ort_version,
        installed_version,
        ort_error_text,
        run_on_host,
        to_ort_value,
        unloadable_header,
    )
