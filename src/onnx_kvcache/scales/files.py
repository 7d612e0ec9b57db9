"""Where scales come from: the in-memory :class:`KvCacheScales` and scale files.

File format (onnxruntime-genai's, the de facto standard), as written here::

    {"scales": {"k_scales": [0.0019, 0.0022], "v_scales": [0.0018, 0.0020]},
     "qmax": 448.0, "layer_ids": [0, 1]}

A per-tensor scale is written as a number, a per-channel one as a list of
``kv_num_heads * head_size`` numbers: the form every reader takes (onnxruntime-genai's
builder reads an entry as ``np.asarray(entry).reshape(-1)``; mobius's
``--kv-cache-scale-file`` takes ``float(entry)``, so numbers only).

Variants read here: entries as numbers or lists (one element per tensor, as
onnxruntime-genai's calibrator writes ``[[0.0019], [0.0022]]``, or
``kv_num_heads * head_size`` per channel), optional sparse ``layer_ids``, optional
``qmax`` (the file is retargeted to another format by ``file_qmax / target_qmax``),
optional ``format`` and ``granularity`` (written by us), one section per model file keyed
by the file's stem, and the older flat form
``{"scales": {"k_scales": [0.1, 0.2], "v_scales": [...]}}``.

A rotated cache's scales record it (written by calibration): ``rotation`` (``keys`` or
``keys_and_values``) and ``rotation_matrix``, the ``H`` they were measured with (a row of
:data:`~onnx_kvcache.cache.rotation.MATRICES`); a file that records a rotation but no matrix
was written before the record, with ``walsh_dct`` (:data:`UNRECORDED_MATRIX`). Converting
rotates by the recorded ``H``.

The granularity is a recorded fact: calibration records the one it measured, a file the
one it states. A file that states none (onnxruntime-genai's) leaves it ``None``: the
converter takes the first row of :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES` whose
size fits the model's caches (:func:`~onnx_kvcache.cache.formats.granularity_of`).

A scale is a dequantization scale: the cache stores ``x / scale`` and reads
``q * scale``, so ``scale = threshold / qmax``.
"""

from __future__ import annotations

__all__ = [
    "KvCacheScales",
    "ScalesLike",
    "UNRECORDED_MATRIX",
    "as_kv_cache_scales",
    "load_kv_cache_scale_file",
    "resolve_granularity",
]

import dataclasses
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np

from onnx_kvcache.cache.formats import CACHE_FORMATS, get_format, get_granularity, scale_granularity
from onnx_kvcache.cache.rotation import (
    DEFAULT_MATRIX,
    MATRICES,
    ROTATIONS,
    RotationMatrix,
    get_matrix,
    get_rotation,
)
from onnx_kvcache.errors import (
    Function,
    KvCacheError,
    KvCacheTypeError,
    Message,
    Param,
    ScalesAdjustedWarning,
    warn,
)
from onnx_kvcache.model_io import load_json, stamp_json, write_output

ScalesLike = Union["KvCacheScales", Mapping[int, tuple[Any, Any]], str, os.PathLike, None]


UNRECORDED_MATRIX = "walsh_dct"
"""The ``H`` of a rotated cache's scale file that records no ``rotation_matrix``: files
written before the record were measured with it (:data:`~onnx_kvcache.cache.rotation.MATRICES`)."""

_FLOAT32 = np.finfo(np.float32)
_SMALLEST = float(_FLOAT32.smallest_subnormal)
_MAX_LAYER_ID = 2**31 - 1
QMAX_RANGE = (1.0, 65504.0)
"""The ``qmax`` a scale file may state: from 1 to float16's largest value (every cache
format's is inside: 7/8 int4, 127/128 int8, 448 fp8 E4M3, 57344 fp8 E5M2)."""

logger = logging.getLogger(__name__)


def _as_scale_array(value: Any, where: str) -> np.ndarray:
    """float32 scales, each finite, > 0 and within float32's range (the cast neither
    overflows nor rounds to 0; calibration gives an all-zero channel a subnormal one)."""
    if isinstance(value, (str, bytes)):
        raise KvCacheError(
            f"{where}: scale must be a number or a list of numbers, got {type(value).__name__}."
        )
    try:
        wide = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise KvCacheError(f"{where}: scale must be a number or a list of numbers ({e}).") from None
    if wide.size == 0:
        raise KvCacheError(f"{where}: scale is empty.")
    good = np.isfinite(wide) & (wide >= _SMALLEST) & (wide <= _FLOAT32.max)
    if not np.all(good):
        bad = float(wide[~good][0])
        why = (
            "must be finite and > 0"
            if not (math.isfinite(bad) and bad > 0)
            else f"must fit float32, from {_SMALLEST:.3g} to {_FLOAT32.max:.3g} (it would round to "
            + ("0)" if bad < _SMALLEST else "inf)")
        )
        raise KvCacheError(f"{where}: scales {why}, found {bad:g}.")
    return wide.astype(np.float32)


def _qmax_problem(qmax: Any) -> str | None:
    """Why ``qmax`` is no largest quantized value (None when it is one), after its name."""
    low, high = QMAX_RANGE
    if (
        isinstance(qmax, bool)
        or not isinstance(qmax, (int, float, np.integer, np.floating))
        or not low <= float(qmax) <= high
    ):
        return (
            f"must be a number from {low:g} to {high:g} (the largest quantized value of the "
            f"cache format), got {qmax!r}."
        )
    return None


def _check_qmax(qmax: Any) -> float:
    problem = _qmax_problem(qmax)
    if problem is not None:
        raise KvCacheError(f"qmax {problem}")
    return float(qmax)


@dataclasses.dataclass(frozen=True)
class KvCacheScales:
    """Per-layer float32 dequantization scales for K and V.

    Attributes:
        k: ``{layer_id: array}`` of K scales (1 element per tensor, or one per channel).
        v: Same for V.
        format: Cache format the scales were computed for (``fp8``/``int8``/``int4``).
        qmax: Divisor the scales were computed against; defaults to the format's.
        granularity: What one scale covers (a :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES`
            name), as whoever made the scales recorded it; None when unknown (a file that
            does not state it): the model's cache shapes then decide.
        metadata: Free-form provenance (method, data, ...), saved with the file.
        stats: Per-layer calibration statistics when the scales were just measured (not
            saved; see ``onnx_kvcache.calibrate.calibration.CalibrationStats``).
    """

    k: Mapping[int, np.ndarray]
    v: Mapping[int, np.ndarray]
    format: str | None = None
    qmax: float | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    granularity: str | None = None
    stats: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __repr__(self) -> str:
        values = [a for table in (self.k, self.v) for a in table.values()]
        low = min((float(np.min(a)) for a in values), default=float("nan"))
        high = max((float(np.max(a)) for a in values), default=float("nan"))
        return (
            f"KvCacheScales({len(self.k)} layers, format={self.format!r}, "
            f"granularity={self.granularity!r}, scales {low:.3g}..{high:.3g})"
        )

    def __post_init__(self) -> None:
        if set(self.k) != set(self.v):
            raise KvCacheError(
                f"K and V scales cover different layers: k={sorted(self.k)}, v={sorted(self.v)}."
            )
        k, v = {}, {}
        for layer in self.k:
            if (
                isinstance(layer, bool)
                or not isinstance(layer, (int, np.integer))
                or not 0 <= layer <= _MAX_LAYER_ID
            ):
                raise KvCacheError(f"Layer id {layer!r} must be an integer from 0 to {_MAX_LAYER_ID}.")
            k[int(layer)] = _as_scale_array(self.k[layer], f"layer {layer} k_scale")
            v[int(layer)] = _as_scale_array(self.v[layer], f"layer {layer} v_scale")
            if (k[int(layer)].size == 1) != (v[int(layer)].size == 1):  # per channel K and V may differ (MLA)
                raise KvCacheError(
                    f"Layer {layer}: k_scale has {k[int(layer)].size} elements but v_scale has "
                    f"{v[int(layer)].size}; both must have the same granularity."
                )
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "v", v)
        if self.format is not None:
            object.__setattr__(self, "format", get_format(self.format).name)
        if self.qmax is None and self.format is not None:
            object.__setattr__(self, "qmax", get_format(self.format).qmax)
        if self.qmax is not None:
            object.__setattr__(self, "qmax", _check_qmax(self.qmax))
        if self.granularity is not None:
            object.__setattr__(self, "granularity", get_granularity(self.granularity))
            sizes = {a.size for a in k.values()}
            if scale_granularity(self.granularity).single and sizes != {1}:
                raise KvCacheError(
                    f"The scales are {self.granularity}, one element each, but have {max(sizes)} "
                    "elements: give the granularity they were measured with."
                )

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[int, tuple[Any, Any]],
        *,
        format: str | None = None,
        qmax: float | None = None,
        granularity: str | None = None,
    ) -> KvCacheScales:
        """Build from ``{layer_id: (k, v)}`` with floats or arrays (a layer id may be a
        string of digits, as ``json.load`` gives)."""
        if not isinstance(mapping, Mapping):
            raise KvCacheTypeError(
                f"Scales must be a {{layer_id: (k, v)}} mapping, got {type(mapping).__name__}."
            )
        k, v = {}, {}
        for layer, pair in mapping.items():
            if isinstance(pair, (str, bytes, Mapping)) or not isinstance(pair, Sequence) or len(pair) != 2:
                got = f"{len(pair)} values" if isinstance(pair, Sequence) else f"a {type(pair).__name__}"
                raise KvCacheError(
                    f"Scales must map each layer id to a (k_scale, v_scale) pair; layer {layer!r} has {got}."
                )
            k[_layer_id(layer)], v[_layer_id(layer)] = pair
        return cls(k, v, format=format, qmax=qmax, granularity=granularity)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.k))

    @property
    def implied_format(self) -> str | None:
        """The format these scales were made for: their ``format``, else the one row whose
        ``qmax`` they record (448 fp8, 128 int8, 8 int4), else None."""
        if self.format is not None:
            return self.format
        rows = [row.name for row in CACHE_FORMATS.values() if row.qmax == self.qmax]
        return rows[0] if len(rows) == 1 else None

    def for_layer(self, layer_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(k, v)`` float32 scale arrays of ``layer_id``."""
        if layer_id not in self.k:
            raise KvCacheError(f"No scales for layer {layer_id}; layers present: {self.layer_ids}.")
        return self.k[layer_id].copy(), self.v[layer_id].copy()

    def retarget(self, format: str) -> KvCacheScales:
        """The same thresholds expressed as scales for ``format``."""
        target = get_format(format)
        if self.qmax is None or self.qmax == target.qmax:
            return dataclasses.replace(self, format=target.name, qmax=target.qmax)
        factor = self.qmax / target.qmax  # in float64: the result is checked, never overflows
        if self.metadata.get("method") == "mse":
            warn(mse_moved(self.implied_format or f"qmax {self.qmax:g}", target.name), ScalesAdjustedWarning)
        return KvCacheScales(
            {i: a.astype(np.float64) * factor for i, a in self.k.items()},
            {i: a.astype(np.float64) * factor for i, a in self.v.items()},
            format=target.name,
            qmax=target.qmax,
            metadata=self.metadata,
            granularity=self.granularity,
        )

    @property
    def rotation_matrix(self) -> RotationMatrix | None:
        """The ``H`` the scales were measured with (a row of
        :data:`~onnx_kvcache.cache.rotation.MATRICES`): ``metadata["rotation_matrix"]``, else
        for scales of a rotated cache the default (a file that records none was read as
        :data:`UNRECORDED_MATRIX`); None for an unrotated cache."""
        if not get_rotation(self.metadata.get("rotation", "none")).rotates:
            return None
        return get_matrix(self.metadata.get("rotation_matrix", DEFAULT_MATRIX))

    def to_json(self) -> dict[str, Any]:
        ids = self.layer_ids
        doc: dict[str, Any] = {
            "scales": {
                "k_scales": [_entry(self.k[i]) for i in ids],
                "v_scales": [_entry(self.v[i]) for i in ids],
            },
            "layer_ids": list(ids),
        }
        if self.qmax is not None:
            doc["qmax"] = float(self.qmax)
        if self.format is not None:
            doc["format"] = self.format
        if self.granularity is not None:
            doc["granularity"] = self.granularity
        doc.update({k: v for k, v in self.metadata.items() if k not in doc})
        if self.rotation_matrix is not None:  # recorded: read back, a file without it is walsh_dct's
            doc["rotation_matrix"] = self.rotation_matrix.name
        return doc

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the onnxruntime-genai format (with ``qmax``, ``layer_ids``, ``format`` and,
        when known, ``granularity``), atomically, with an ``onnx_kvcache.written`` record.

        An existing ``path`` is replaced only when it is a scale file onnx-kvcache wrote and
        nobody edited since (``overwrite=True``: any regular file that is not an ONNX model
        or a file a graph in its folder names as external data); never a folder, a symbolic
        link, a device or a FIFO. A missing folder is created.

        Raises:
            KvCacheError: The path is one of those; the message says which.
            KvCacheTypeError: ``path`` is no str/PathLike, or ``overwrite`` no bool.
        """
        write_output(path, stamp_json(self.to_json(), "scales"), "scales", overwrite=overwrite)


def mse_moved(source: str, target: str, rotation: str = "none") -> Message:
    """The warning for mse thresholds made for ``source`` used as ``target`` scales; a rotated
    model's (``rotation``) advice names the original model and its rotation, since scales
    calibrated otherwise are refused for it."""
    rotated = rotation != "none"
    turned = (Param("rotation", rotation),) if rotated else ()
    return Message(
        f"These KV-cache scales hold mse thresholds chosen for {source}'s levels; as {target} "
        f"scales they keep those thresholds, which are not what mse chooses for {target} "
        f"(an int4 mse threshold clips far more than int8 needs). Calibrate "
        + ("the original model " if rotated else "")
        + f"for {target}: ",
        Function("calibrate_kv_cache", (Param("format", target), Param("method", "mse"), *turned)),
        ".",
    )


def _recorded_matrix(path: Any, matrix: Any, rotation: str | None) -> str | None:
    """A file's ``rotation_matrix``, checked; for a rotated cache's scales that record none
    (written before the record), :data:`UNRECORDED_MATRIX`."""
    if matrix is None:
        return UNRECORDED_MATRIX if rotation is not None and ROTATIONS[rotation].rotates else None
    if matrix not in MATRICES:
        raise _fail(path, f"'rotation_matrix' must be one of {', '.join(MATRICES)}, got {matrix!r}.")
    return matrix


def _layer_id(key: Any) -> Any:
    """A digit string as the layer id it spells; anything else as it is (checked later)."""
    return int(key) if isinstance(key, str) and key.isdecimal() else key


def _entry(scales: np.ndarray) -> float | list[float]:
    """A layer's scales as a file entry: one scale as a number (the form mobius's reader
    takes too), several as a list."""
    values = _shortest(scales)
    return values[0] if len(values) == 1 else values


def _shortest(scales: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to them (0.00665, not
    0.006649999879300594)."""
    return [float(str(np.float32(x))) for x in np.asarray(scales, np.float32).ravel()]


def _fail(path: os.PathLike | str, problem: str) -> KvCacheError:
    return KvCacheError(f"Scale file {os.fspath(path)}: {problem}")


def _parse_entries(path: Any, name: str, entries: Any) -> list[np.ndarray]:
    if not isinstance(entries, list) or not entries:
        got = "an empty list" if isinstance(entries, list) else f"a {type(entries).__name__}"
        raise _fail(path, f"'{name}' must be a non-empty list, got {got}.")
    arrays = []
    for i, entry in enumerate(entries):
        items = entry if isinstance(entry, list) else [entry]
        if not items or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            raise _fail(path, f"'{name}'[{i}] must be a number or a non-empty list of numbers.")
        try:
            arrays.append(_as_scale_array(items, f"'{name}'[{i}]"))
        except KvCacheError as e:
            raise _fail(path, str(e)) from None
    return arrays


def _select_section(
    path: Any, doc: dict[str, Any], model: str | None, stem: str | None = None
) -> dict[str, Any]:
    """The section of ``doc`` to read: all of it, the one named ``model``, else the one named
    ``stem`` (the model file's, as onnxruntime-genai picks it) or the only one."""
    if "scales" in doc:
        return doc
    sections = {k: v for k, v in doc.items() if isinstance(v, dict) and "scales" in v}
    if not sections:
        raise _fail(path, 'no \'scales\' key (expected {"scales": {"k_scales": ..., ...}}).')
    if model is not None and model in sections:
        return sections[model]
    if model is None and stem is not None and stem in sections:
        return sections[stem]
    if len(sections) == 1 and model is None:
        return next(iter(sections.values()))
    if model is not None:
        fix = f"none is named {model!r}."
    else:
        named = f" (none is named {stem!r}, the model file's stem)" if stem is not None else ""
        fix = (
            f"a model is converted with the section named after its file's stem{named}, as "
            "onnxruntime-genai reads it; from Python name one with model=<section>."
        )
    raise _fail(path, f"holds scales for several model files ({', '.join(sorted(sections))}); {fix}")


def load_kv_cache_scale_file(
    path: str | os.PathLike,
    *,
    format: str | None = None,
    model: str | None = None,
    stem: str | None = None,
) -> KvCacheScales:
    """Read a KV-cache scale file (onnxruntime-genai format and its variants).

    Args:
        path: JSON file.
        format: Retarget the scales to this cache format using the file's ``qmax``.
        model: Section to read when the file holds one per model file (the file stem).
        stem: Without ``model``, the stem of the model file the scales are for: its section
            is read when the file holds several (``convert_model`` gives it).

    Raises:
        KvCacheFileNotFoundError: (a ``KvCacheError`` and ``FileNotFoundError``) The file is missing.
        KvCacheError: (a ``ValueError``) The file is not a regular file, or is malformed (bad
            JSON, nested too deeply, a scale outside float32's normal range, ...); the
            message names the file and says how.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise KvCacheTypeError(f"A scale file is a path (str or os.PathLike), got {type(path).__name__}.")
    p = pathlib.Path(path)
    doc = load_json(p, "Scale file", fix="give the path of a JSON scale file")
    if not isinstance(doc, dict):
        raise _fail(p, f"top level must be an object, got {type(doc).__name__}.")
    section = _select_section(p, doc, model, stem)
    scales = section["scales"]
    if not isinstance(scales, dict):
        raise _fail(p, f"'scales' must be an object, got {type(scales).__name__}.")
    for key in ("k_scales", "v_scales"):
        if key not in scales:
            raise _fail(p, f"'scales' has no '{key}' list.")
    k = _parse_entries(p, "k_scales", scales["k_scales"])
    v = _parse_entries(p, "v_scales", scales["v_scales"])
    if len(k) != len(v):
        raise _fail(p, f"'k_scales' has {len(k)} entries but 'v_scales' has {len(v)}.")
    layer_ids = section.get("layer_ids", doc.get("layer_ids"))
    if layer_ids is None:
        layer_ids = list(range(len(k)))
    if not isinstance(layer_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layer_ids
    ):
        raise _fail(p, "'layer_ids' must be a list of integers.")
    if len(layer_ids) != len(k):
        raise _fail(p, f"'layer_ids' has {len(layer_ids)} entries but there are {len(k)} scales.")
    if any(i < 0 for i in layer_ids):
        raise _fail(p, f"'layer_ids' must be >= 0, got {min(layer_ids)}.")
    if any(i > _MAX_LAYER_ID for i in layer_ids):
        raise _fail(p, f"'layer_ids' must be at most {_MAX_LAYER_ID}, got {max(layer_ids)}.")
    if len(set(layer_ids)) != len(layer_ids):
        dup = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
        raise _fail(p, f"'layer_ids' repeats {dup}.")
    sizes = {a.size for a in k + v}
    for i, (ka, va) in enumerate(zip(k, v)):
        if (ka.size == 1) != (va.size == 1):  # per channel, K and V may differ in width (MLA)
            raise _fail(p, f"layer {layer_ids[i]} has {ka.size} k scales but {va.size} v scales.")
    if len({a.size for a in k}) > 1 or len({a.size for a in v}) > 1:
        raise _fail(p, f"entries have different element counts {sorted(sizes)}.")
    file_format = section.get("format", doc.get("format"))
    granularity = section.get("granularity", doc.get("granularity"))
    qmax = section.get("qmax", doc.get("qmax"))
    if qmax is not None:
        problem = _qmax_problem(qmax)
        if problem is not None:
            raise _fail(p, f"'qmax' {problem}")
        qmax = float(qmax)
    method = section.get("method", doc.get("method"))
    rope_positions = section.get("rope_positions", doc.get("rope_positions"))
    if rope_positions is not None and (
        isinstance(rope_positions, bool) or not isinstance(rope_positions, int) or rope_positions < 1
    ):
        raise _fail(p, f"'rope_positions' must be an integer >= 1, got {rope_positions!r}.")
    rotation = section.get("rotation", doc.get("rotation"))
    if rotation is not None and rotation not in ROTATIONS:
        raise _fail(p, f"'rotation' must be one of {', '.join(ROTATIONS)}, got {rotation!r}.")
    recorded = {
        "method": method,
        "rope_positions": rope_positions,
        "rotation": rotation,
        "rotation_matrix": _recorded_matrix(
            p, section.get("rotation_matrix", doc.get("rotation_matrix")), rotation
        ),
    }
    try:
        result = KvCacheScales(
            dict(zip(layer_ids, k)),
            dict(zip(layer_ids, v)),
            format=file_format,
            qmax=qmax,
            metadata={key: value for key, value in recorded.items() if value is not None},
            granularity=granularity,
        )
        return result.retarget(format) if format is not None else result
    except KvCacheError as e:
        raise _fail(p, str(e)) from None


def resolve_granularity(granularity: str | None, scales: KvCacheScales | None) -> str:
    """The granularity to convert with: the one asked for, else the one ``scales`` record,
    else ``per_tensor``. Asking for another than the scales record is an error, but for one
    scale per tensor from finer scales (the conversion takes their max, with a warning, as it
    does a requantized node's own)."""
    recorded = scales.granularity if scales is not None else None
    if granularity is None:
        return recorded or "per_tensor"
    granularity = get_granularity(granularity)
    if recorded is not None and recorded != granularity and not scale_granularity(granularity).single:
        raise KvCacheError(
            f"The scales are {recorded} (as recorded when they were made), not {granularity}: convert with ",
            Param("granularity", recorded),
            f", or give {granularity} scales.",
        )
    return granularity


def as_kv_cache_scales(
    scales: ScalesLike, *, format: str | None = None, stem: str | None = None
) -> KvCacheScales | None:
    """Normalize what users pass as scales (object, mapping or file path; ``stem``: the model
    file's, naming the section a file of several is read from)."""
    if scales is None:
        return None
    if isinstance(scales, KvCacheScales):
        result = scales
    elif isinstance(scales, (str, os.PathLike)):
        result = load_kv_cache_scale_file(scales, stem=stem)
    elif isinstance(scales, Mapping):
        result = KvCacheScales.from_mapping(scales)
    else:
        raise KvCacheTypeError(
            f"Scales must be a KvCacheScales, a {{layer_id: (k, v)}} mapping or a file path, "
            f"got {type(scales).__name__}."
        )
    if format is None or not result.qmax:
        return result
    target = get_format(format)
    if result.qmax != target.qmax:  # said once: the pass, given the retargeted scales, says nothing
        made = result.implied_format or f"qmax {result.qmax:g}"
        logger.warning(
            "The scales were made for %s (qmax %g) and are retargeted to %s (qmax %g): each scale "
            "times %g, the same thresholds.",
            made,
            result.qmax,
            target.name,
            target.qmax,
            result.qmax / target.qmax,
        )
    return result.retarget(format)
