"""Model files and folders: load the graph only, convert, and write atomically.

A conversion changes a few graph inputs and outputs and no weight, so weights are
never read: the output graph refers to the existing external data. Beside the input
it points at the same data files; in another folder the data files are hard linked
(falling back to a symbolic link), or copied when asked. Every write goes to a
temporary name in the target folder and is renamed into place, so a failure leaves
no partial output and the input untouched.
"""

from __future__ import annotations

__all__ = [
    "ConvertResult",
    "atomic_write_bytes",
    "atomic_write_text",
    "convert_model",
    "external_data_files",
    "load_model",
    "resolve_model_path",
]

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache.capabilities import get_capabilities
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.formats import get_format
from onnx_kvcache.gqa import find_attention_sites
from onnx_kvcache.optimize import optimize_model
from onnx_kvcache.scales import as_kv_cache_scales

logger = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
_SMALL_FILE = 16 * 1024 * 1024


def resolve_model_path(path: str | os.PathLike) -> tuple[pathlib.Path, dict[str, Any] | None]:
    """The ``.onnx`` file for a file or onnxruntime-genai folder, and the genai config."""
    p = pathlib.Path(path)
    if p.is_dir():
        config_path = p / GENAI_CONFIG
        if not config_path.is_file():
            onnx_files = sorted(p.glob("*.onnx"))
            if len(onnx_files) == 1:
                return onnx_files[0], None
            raise KvCacheError(
                f"{p} is a folder without {GENAI_CONFIG} and with {len(onnx_files)} .onnx "
                "files; pass the .onnx file itself."
            )
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            filename = config["model"]["decoder"]["filename"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise KvCacheError(f"{config_path}: cannot read model.decoder.filename ({e}).") from None
        model_file = p / filename
        if not model_file.is_file():
            raise KvCacheError(f"{config_path} names {filename!r}, which is not in {p}.")
        return model_file, config
    if not p.exists():
        raise FileNotFoundError(f"Model {p} does not exist.")
    return p, None


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load a model's graph from a file or genai folder; weights stay on disk."""
    model_file, _ = resolve_model_path(path)
    try:
        model = ir.load(model_file)
    except Exception as e:  # protobuf raises several unrelated types
        raise KvCacheError(f"{model_file} is not a readable ONNX model ({e}).") from None
    external_data_files(model, model_file.parent)
    return model


def _iter_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    graphs: list[ir.Graph] = [model.graph]
    for graph in graphs:
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)
                elif attr.type == ir.AttributeType.TENSOR:
                    yield attr.value


def external_data_files(model: ir.Model, base_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the external data files; refuses any outside ``base_dir``."""
    base = pathlib.Path(base_dir).resolve()
    files: set[str] = set()
    for tensor in _iter_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        location = str(tensor.location)
        target = (base / location).resolve()
        if (
            os.path.isabs(location)
            or ".." in pathlib.PurePath(location).parts
            or (base not in target.parents)
        ):
            raise KvCacheError(
                f"Tensor {tensor.name!r} keeps its data at {location!r}, outside the model's "
                f"folder {base}. Refusing to read or write it: external data must be a "
                "relative path inside the model's folder."
            )
        files.add(location)
    return sorted(files)


# -- atomic writes --------------------------------------------------------------------


def _temp_path(target: pathlib.Path, suffix: str = ".tmp") -> pathlib.Path:
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return pathlib.Path(name)


def atomic_write_bytes(target: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a temporary file and a rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: pathlib.Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def _serialize(model: ir.Model) -> bytes:
    proto = ir.to_proto(model)
    try:
        return proto.SerializeToString()
    except ValueError as e:
        raise KvCacheError(
            f"The model is too large to write in one file ({e}); keep its weights in "
            "external data (onnx_ir.save(model, path, external_data=...))."
        ) from None


# -- conversion -----------------------------------------------------------------------

WeightsMode = Literal["link", "copy"]


@dataclasses.dataclass
class ConvertResult:
    """What a conversion wrote."""

    output: pathlib.Path
    model_file: pathlib.Path
    nodes: int
    granularity: str = "per_tensor"
    bytes_written: int = 0
    linked: list[str] = dataclasses.field(default_factory=list)
    copied: list[str] = dataclasses.field(default_factory=list)
    converted: bool = True
    reasons: list[str] = dataclasses.field(default_factory=list)
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    """Converted nodes per operator (``{"PagedAttention": 32}``)."""


def _place_file(src: pathlib.Path, dst: pathlib.Path, mode: WeightsMode, result: ConvertResult) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if mode == "link":
        try:
            os.link(src, dst)
        except OSError:
            try:
                os.symlink(src.resolve(), dst)
            except OSError as e:
                raise KvCacheError(
                    f"Cannot link {src} into {dst.parent} ({e}); use --weights copy "
                    "(weights='copy') to copy the data instead."
                ) from None
        result.linked.append(dst.name)
    else:
        shutil.copy2(src, dst)
        result.copied.append(dst.name)
        result.bytes_written += dst.stat().st_size


def _genai_config_for(config: dict[str, Any], ep: str) -> dict[str, Any]:
    """A copy of ``config`` for a quantized cache on ``ep``: CPU cannot share past/present."""
    config = json.loads(json.dumps(config))
    config.setdefault("search", {})["past_present_share_buffer"] = ep != "cpu"
    return config


def convert_model(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    *,
    format: str = "fp8",
    granularity: str | None = None,
    scales: Any = None,
    shared_kv_scale: bool = False,
    weights: WeightsMode = "link",
    in_place: bool = False,
    overwrite: bool = False,
    ep: str | None = None,
    strict: bool = False,
    check_device: bool = False,
) -> ConvertResult:
    """Convert a model file or onnxruntime-genai folder to a quantized KV cache.

    Weights are never read. ``ep`` is where the model will run: when given, gating
    checks it and, when the request cannot run there, nothing is written and the
    result says why (``strict`` raises instead). A genai folder's
    ``search.past_present_share_buffer`` follows it (default: ``cuda`` for fp8 and for
    operators without a CPU kernel (PagedAttention), ``cpu`` otherwise). ``granularity``
    defaults to the scales' own (per channel when they have one element per channel), else
    per tensor.
    """
    fmt = get_format(format)
    scales = as_kv_cache_scales(scales, format=fmt.name)
    if granularity is None:
        granularity = scales.granularity if scales is not None else "per_tensor"
    if weights not in ("link", "copy"):
        raise KvCacheError(f"weights must be 'link' or 'copy', got {weights!r}.")
    src = pathlib.Path(in_path)
    model_file, genai_config = resolve_model_path(src)
    is_folder = src.is_dir()
    if in_place:
        if out_path is not None and pathlib.Path(out_path).resolve() != src.resolve():
            raise KvCacheError("Give either an output path or in_place=True (--in-place), not both.")
        dst = src
    else:
        if out_path is None:
            raise KvCacheError("Give an output path, or in_place=True (--in-place) to rewrite the input.")
        dst = pathlib.Path(out_path)
        if dst.resolve() == src.resolve() or (not is_folder and dst.resolve() == model_file.resolve()):
            raise KvCacheError(f"Output {dst} is the input; use --in-place (in_place=True) to rewrite it.")
        if dst.exists() and not overwrite:
            raise KvCacheError(f"Output {dst} exists; pass --overwrite to replace it.")
        if is_folder and dst.exists() and not dst.is_dir():
            raise KvCacheError(f"Input {src} is a folder, so output {dst} must be a folder.")
    model = load_model(model_file)
    data_files = external_data_files(model, model_file.parent)
    cpu_runs_it = all(get_capabilities("cpu", s.op).has_kernel for s in find_attention_sites(model))
    target = (ep or ("cuda" if fmt.name == "fp8" or not cpu_runs_it else "cpu")).lower()
    model, report = optimize_model(
        model,
        execution_provider=ep.lower() if ep else None,
        kv_cache_format=fmt.name,
        kv_cache_granularity=granularity,
        kv_cache_scales=scales,
        shared_kv_scale=shared_kv_scale,
        fuse_attention=False,
        check_device=check_device,
        strict=strict,
        return_report=True,
    )
    result = ConvertResult(
        dst, model_file, 0, granularity, converted=report.supported, reasons=list(report.reasons)
    )
    if not report.supported:
        return result
    for site in find_attention_sites(model):
        if site.cache_format is not None:
            result.ops[site.op.op_type] = result.ops.get(site.op.op_type, 0) + 1
    result.nodes = sum(result.ops.values())
    data = _serialize(model)

    if is_folder:
        new_config = _genai_config_for(genai_config, target) if genai_config is not None else None
        if in_place:
            atomic_write_bytes(model_file, data)
            if new_config is not None:
                atomic_write_text(src / GENAI_CONFIG, json.dumps(new_config, indent=4) + "\n")
            result.model_file, result.bytes_written = model_file, len(data)
            return result
        _write_folder(src, dst, model_file, data, new_config, data_files, weights, overwrite, result)
        return result

    if in_place or dst.resolve().parent == model_file.resolve().parent:
        atomic_write_bytes(dst, data)
        result.model_file, result.bytes_written = dst, len(data)
        return result
    _write_file_elsewhere(model_file, dst, data, data_files, weights, result)
    return result


def _write_file_elsewhere(
    model_file: pathlib.Path,
    dst: pathlib.Path,
    data: bytes,
    data_files: list[str],
    weights: WeightsMode,
    result: ConvertResult,
) -> None:
    """A model file in another folder: data files placed beside it, then the model.

    On any failure, every file this call created is removed again.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[pathlib.Path, pathlib.Path]] = []
    created: list[pathlib.Path] = []
    try:
        for name in data_files:
            target = dst.parent / name
            tmp = _temp_path(target)
            tmp.unlink()
            staged.append((tmp, target))
            _place_file(model_file.parent / name, tmp, weights, result)
        for tmp, target in staged:
            if not target.exists() and not target.is_symlink():
                created.append(target)
            os.replace(tmp, target)
        staged.clear()
        atomic_write_bytes(dst, data)
    except BaseException:
        for path in created:
            path.unlink(missing_ok=True)
        raise
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    result.model_file = dst
    result.bytes_written += len(data)


def _write_folder(
    src: pathlib.Path,
    dst: pathlib.Path,
    model_file: pathlib.Path,
    data: bytes,
    config: dict[str, Any] | None,
    data_files: list[str],
    weights: WeightsMode,
    overwrite: bool,
    result: ConvertResult,
) -> None:
    """Build the whole output folder under a temporary name, then rename it."""
    dst_parent = dst.resolve().parent
    dst_parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst_parent))
    old: pathlib.Path | None = None
    try:
        rel_model = model_file.relative_to(src)
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            target = tmp_dir / rel
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif rel == rel_model:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                result.bytes_written += len(data)
            elif rel == pathlib.Path(GENAI_CONFIG) and config is not None:
                target.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
            elif str(rel) in data_files or path.stat().st_size >= _SMALL_FILE:
                _place_file(path, target, weights, result)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        if dst.exists():
            if not overwrite:
                raise KvCacheError(f"Output {dst} exists; pass --overwrite to replace it.")
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst_parent))
            old.rmdir()
            os.replace(dst, old)
        os.replace(tmp_dir, dst)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if old is not None and not dst.exists():
            os.replace(old, dst)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    result.model_file = dst / rel_model
