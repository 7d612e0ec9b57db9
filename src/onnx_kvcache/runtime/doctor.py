"""Check the capability table against the onnxruntime installed here: ``onnx-kvcache doctor``.

Two checks, both read from the runtime itself:

1. **Schemas.** For each operator row of :data:`~onnx_kvcache.cache.operators.ATTENTION_OPS`
   the installed onnxruntime's schema (``get_all_operator_schema()``) must name the row's
   inputs at the row's slots, admit every cache format's element type for the caches and
   float32 for the scales, define the quantization attributes the pass writes (and, for
   PagedAttention, no ``kv_cache_bit_width``), and admit the query dtypes of every provider
   row.
2. **Sessions.** For every provider row of :data:`~onnx_kvcache.capabilities.table.CAPABILITIES`,
   one tiny node per cache (float, and each format x granularity, converted by
   :class:`~onnx_kvcache.KvCacheQuantizationPass`; PagedAttention's LATENT layout too) is
   given to an InferenceSession on that provider alone, when the provider is present (CUDA:
   listed *and* a GPU answers). A created session proves the kernel exists; a session that
   fails only with NOT_IMPLEMENTED proves the graph's types resolve and that there is no
   kernel. A provider that is not present is checked for type resolution only, on the CPU
   provider: the row is then *only in the schema*.
3. **Attention sinks.** On each present provider whose GroupQueryAttention row says it honors
   ``head_sink`` (input 11), one node per cache it lists (float, each such format per tensor) is
   run on a one-token prompt whose key is zero, with and without sinks: the sink ``s`` of a head
   must scale that head's output by ``1 / (1 + exp(s))`` (the key's score is 0), which proves the
   kernel adds it to the softmax's denominator.

Each row ends as ``proven`` (this machine shows what the table says), ``schema only`` (the
types resolve here; the kernel could not be run) or ``disagrees`` (the runtime says
otherwise than the table). What no session proves: numerics, speed, minimum versions other
than the installed one, compute-capability gates, build options (int4 KV), nor any provider
this machine lacks.
"""

from __future__ import annotations

__all__ = ["DoctorReport", "ProbeResult", "SchemaCheck", "check_schemas", "run_doctor"]

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CACHE_FORMATS, SCALE_GRANULARITIES, scale_granularity
from onnx_kvcache.cache.operators import ATTENTION_OPS, GQA, PAGED, AttentionOp, GqaInput
from onnx_kvcache.capabilities.device import cuda_compute_capability
from onnx_kvcache.capabilities.table import CAPABILITIES, EpCapabilities, get_capabilities
from onnx_kvcache.errors import Function, KvCacheError, KvCacheWarning
from onnx_kvcache.model_io import create_session, import_onnxruntime, installed_ort_version
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass

Verdict = Literal["proven", "schema only", "disagrees"]


def _type_name(dtype: ir.DataType) -> str:
    """onnxruntime's name of a tensor type: ``tensor(float)``, ``tensor(float8e4m3fn)``."""
    return f"tensor({dtype.name.lower()})"


@dataclasses.dataclass(frozen=True)
class SchemaCheck:
    """One operator's schema in the installed onnxruntime against its row."""

    op: str
    found: bool
    facts: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def agrees(self) -> bool:
        return self.found and not self.problems


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One provider row x cache: what the table says, what this machine did, the verdict."""

    op: str
    provider: str
    cache: str
    """``float``, or ``<format> <granularity>`` (``LATENT`` appended for the single cache)."""
    table: str
    outcome: str
    verdict: Verdict

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    ort_version: str | None
    providers: tuple[str, ...]
    """Providers sessions were created on (present on this machine)."""
    absent: tuple[str, ...]
    """Providers of the table checked for type resolution only, and why."""
    schemas: tuple[SchemaCheck, ...]
    rows: tuple[ProbeResult, ...]

    @property
    def disagreements(self) -> list[str]:
        found = [f"{s.op} schema: {p}" for s in self.schemas for p in s.problems]
        found += [f"{s.op}: not in this onnxruntime" for s in self.schemas if not s.found]
        found += [
            f"{r.op} on {r.provider}, {r.cache}: {r.outcome}" for r in self.rows if r.verdict == "disagrees"
        ]
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "onnxruntime": self.ort_version,
            "providers": list(self.providers),
            "absent": list(self.absent),
            "schemas": [dataclasses.asdict(s) for s in self.schemas],
            "rows": [r.to_json() for r in self.rows],
            "disagreements": self.disagreements,
        }

    def format_table(self) -> str:
        lines = [f"onnxruntime {self.ort_version}; sessions on: {', '.join(self.providers) or 'none'}"]
        lines += [f"  not present: {a}" for a in self.absent]
        lines.append("operator schemas:")
        for s in self.schemas:
            state = "agrees with the table" if s.agrees else ("missing" if not s.found else "DISAGREES")
            lines.append(f"  {s.op}: {state}")
            lines += [f"    - {f}" for f in s.facts]
            lines += [f"    ! {p}" for p in s.problems]
        header = ("operator", "provider", "cache", "table", "this machine", "verdict")
        shown = [r for r in self.rows if r.verdict != "schema only"]
        rows = [header] + [(r.op, r.provider, r.cache, r.table, r.outcome, r.verdict) for r in shown]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines.append("rows run here:")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        grouped: dict[tuple[str, str], list[ProbeResult]] = {}
        for r in self.rows:
            if r.verdict == "schema only":
                grouped.setdefault((r.op, r.provider), []).append(r)
        if grouped:
            lines.append("rows only in the schema (types resolve on CPU; the kernel was not run here):")
        for (op, provider), found in grouped.items():
            says = sorted(
                {f"{r.cache.split()[0]}: {r.table}" for r in found if r.cache.split()[0] != "float"}
            )
            kernel = next((r.table for r in found if r.cache == "float"), "")
            lines.append(
                f"  {op} on {provider} ({len(found)} caches; float: {kernel}; " + "; ".join(says) + ")"
            )
        counts = {v: sum(r.verdict == v for r in self.rows) for v in ("proven", "schema only", "disagrees")}
        lines.append(", ".join(f"{n} {v}" for v, n in counts.items()))
        return "\n".join(lines)


# -- schemas -------------------------------------------------------------------------


def _schemas() -> dict[tuple[str, str], Any]:
    import_onnxruntime()
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return {(s.domain, s.name): s for s in state.get_all_operator_schema()}


def check_schemas() -> list[SchemaCheck]:
    """Each operator row against the installed onnxruntime's schema; see the module."""
    schemas = _schemas()
    return [_check_schema(op, schemas.get((op.domain, op.op_type))) for op in ATTENTION_OPS.values()]


def _check_schema(op: AttentionOp, schema: Any | None) -> SchemaCheck:
    if schema is None:
        return SchemaCheck(op.op_type, False, (), ())
    reading = _Reading(op, schema, _allowed_types(schema))
    for check in _SCHEMA_CHECKS:
        check(reading)
    return SchemaCheck(op.op_type, True, tuple(reading.facts), tuple(reading.problems))


def _allowed_types(schema: Any) -> list[set[str]]:
    """The type strings each of the schema's inputs admits."""
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return [constraints.get(i.typeStr, {i.typeStr}) for i in schema.inputs]


@dataclasses.dataclass
class _Reading:
    """One operator row, its installed schema, and the facts and problems found so far."""

    op: AttentionOp
    schema: Any
    types: list[set[str]]
    facts: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def allowed(self, slot: int) -> set[str]:
        return self.types[slot] if slot < len(self.types) else set()


def _check_input_names(r: _Reading) -> None:
    op, names = r.op, [i.name for i in r.schema.inputs]
    wrong = [f"{i} {want}!={have}" for i, (want, have) in enumerate(zip(op.inputs, names)) if want != have]
    if len(names) < len(op.inputs):
        wrong.append(f"the schema has {len(names)} inputs, the row {len(op.inputs)}")
    if wrong:
        r.problems.append("input names differ: " + "; ".join(wrong))
    else:
        r.facts.append(f"inputs 0-{len(op.inputs) - 1} as the row names them")


def _check_scale_types(r: _Reading) -> None:
    for side in r.op.sides:
        scale_slot = r.op.slot(side.scale)
        if "tensor(float)" not in r.allowed(scale_slot):
            r.problems.append(f"{side.scale} (input {scale_slot}) does not take float32")


def _check_cache_types(r: _Reading) -> None:
    op = r.op
    cache_types = r.allowed(op.slot(op.key.past))
    missing = [
        f"{f.name} ({f.dtype.name.lower()})"
        for f in CACHE_FORMATS.values()
        if _type_name(f.dtype) not in cache_types
    ]
    if missing:
        r.problems.append("the cache type constraint lacks " + ", ".join(missing))
    else:
        r.facts.append(
            f"caches ({r.schema.inputs[op.slot(op.key.past)].typeStr}) take "
            + ", ".join(f"{f.name} as {f.dtype.name.lower()}" for f in CACHE_FORMATS.values())
            + f"; scales at inputs {'/'.join(str(op.slot(s.scale)) for s in op.sides)} float32"
        )


def _check_attributes(r: _Reading) -> None:
    absent = [a for a in r.op.quant_attribute_names if a not in set(r.schema.attributes)]
    if absent:
        r.problems.append("the schema lacks attributes " + ", ".join(absent))
    else:
        r.facts.append("attributes " + ", ".join(r.op.quant_attribute_names))


def _check_bit_width(r: _Reading) -> None:
    if r.op.bit_width_attr is not None:
        return
    if "kv_cache_bit_width" in set(r.schema.attributes):
        r.problems.append("the schema has kv_cache_bit_width, the row none")
    else:
        r.facts.append("no kv_cache_bit_width attribute (the element type names the format)")


def _check_single_cache(r: _Reading) -> None:
    if r.op.single_cache is None:
        return
    attr, value = r.op.single_cache
    if attr in set(r.schema.attributes) and value in r.schema.attributes[attr].description:
        r.facts.append(f"{attr}={value!r}: one cache (value inputs/attributes unset)")
    else:
        r.problems.append(f"the schema does not describe {attr}={value!r}")


def _check_query_types(r: _Reading) -> None:
    query = r.allowed(r.op.slot("query"))
    for row in CAPABILITIES[r.op.op_type].values():
        bad = sorted(t.name.lower() for t in row.query_dtypes if _type_name(t) not in query)
        if bad and row.runtime == "onnxruntime":
            r.problems.append(f"row {row.name} lists query dtypes {bad} the schema's T does not admit")
    r.facts.append(
        "query T admits " + ", ".join(sorted(t.removeprefix("tensor(").rstrip(")") for t in query))
    )


#: The schema checks, in the order their facts and problems are listed.
_SCHEMA_CHECKS: tuple[Callable[[_Reading], None], ...] = (
    _check_input_names,
    _check_scale_types,
    _check_cache_types,
    _check_attributes,
    _check_bit_width,
    _check_single_cache,
    _check_query_types,
)


# -- probe nodes -----------------------------------------------------------------------

_HEADS, _KV, _HEAD = 4, 2, 64


def _probe_model(op: AttentionOp, dtype: ir.DataType, latent: bool = False) -> ir.Model:
    """One attention node of ``op`` whose tensors are graph inputs (rotary caches inside)."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 21, op.domain: 1}, name="doctor")
    kv = 1 if latent else _KV
    tables = _rotary_tables(graph, dtype, 8 if latent else _HEAD // 2)
    paged = op is PAGED
    rows: list[str | int] = ["num_tokens"] if paged else ["batch", "sequence"]
    cache: list[str | int] = (
        ["num_blocks", "block_size", kv, _HEAD] if paged else ["batch", kv, "past", _HEAD]
    )
    q = ir.val("query", dtype, [*rows, _HEADS * _HEAD])
    k = ir.val("key", dtype, [*rows, kv * _HEAD])
    v = None if latent else ir.val("value", dtype, [*rows, kv * _HEAD])
    pk = ir.val("past_key_values.0.key", dtype, cache)
    pv = None if latent else ir.val("past_key_values.0.value", dtype, cache)
    lengths = _length_inputs(paged)
    graph.inputs.extend(x for x in (q, k, v, pk, pv, *lengths) if x is not None)
    attrs = _probe_attributes(kv, latent)
    width = _HEADS * (attrs.get("v_head_size") or _HEAD)
    outputs = [ir.val("output", dtype, [*rows, width]), ir.val("present.0.key", dtype, cache)]
    if not latent:
        outputs.append(ir.val("present.0.value", dtype, cache))
    node = ir.Node(
        op.domain,
        op.op_type,
        [q, k, v, pk, pv, *lengths, *tables],
        attributes=ir.convenience.convert_attributes(attrs),
        outputs=outputs,
        name="probe",
    )
    graph.append(node)
    graph.outputs.extend(outputs)
    return ir.Model(graph, ir_version=10)


def _rotary_tables(graph: ir.Graph, dtype: ir.DataType, half: int) -> list[ir.Value]:
    """``cos_cache`` and ``sin_cache`` of 16 positions, registered as ``graph``'s initializers."""
    angles = np.outer(np.arange(16), np.ones(half))
    tables = []
    for name, fn in (("cos_cache", np.cos), ("sin_cache", np.sin)):
        value = ir.Value(name=name, const_value=ir.tensor(fn(angles).astype(dtype.numpy()), name=name))
        value.dtype, value.shape = dtype, ir.Shape([16, half])
        graph.register_initializer(value)
        tables.append(value)
    return tables


def _length_inputs(paged: bool) -> list[ir.Value]:
    """The sequence-length inputs: PagedAttention's three, or GroupQueryAttention's two."""
    int32 = ir.DataType.INT32
    if paged:
        return [
            ir.val("cumulative_sequence_lengths", int32, ["batch + 1"]),
            ir.val("past_sequence_lengths", int32, ["batch"]),
            ir.val("block_table", int32, ["batch", "max_blocks"]),
        ]
    return [ir.val("seqlens_k", int32, ["batch"]), ir.val("total_sequence_length", int32, [])]


def _probe_attributes(kv: int, latent: bool) -> dict[str, Any]:
    attrs: dict[str, Any] = {"num_heads": _HEADS, "kv_num_heads": kv, "do_rotary": 1}
    if latent:
        attrs |= {"kv_cache_layout": "LATENT", "v_head_size": _HEAD - 16, "rotary_offset": _HEAD - 16}
        attrs["scale"] = float(1 / np.sqrt(_HEAD))
    return attrs


def _converted(
    op: AttentionOp, dtype: ir.DataType, fmt: str | None, granularity: str, latent: bool
) -> ir.Model:
    model = _probe_model(op, dtype, latent)
    if fmt is not None:
        n = scale_granularity(granularity).size(1 if latent else _KV, _HEAD)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KvCacheWarning)
            KvCacheQuantizationPass(fmt, granularity, {0: (np.full(n, 0.05), np.full(n, 0.05))})(model)
    return model


def _session(model: ir.Model, provider: str) -> tuple[str, str]:
    """``(kind, message)``: ``created``, ``not implemented`` (onnxruntime's NOT_IMPLEMENTED
    status, raised as its own class) or ``rejected``."""
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedStatus

    try:
        create_session(model, [provider])
    except Exception as e:  # onnxruntime raises several unrelated types
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, NotImplementedStatus):
            return "not implemented", message
        return "rejected", message[:160]
    return "created", ""


def _onnxruntime_names(requested: Sequence[str]) -> list[str]:
    """onnxruntime's names for ``requested``: table row names (``cpu``, ``cuda``) or its own."""
    ort = import_onnxruntime()
    known = set(ort.get_all_providers())
    names = []
    for name in requested:
        row = get_capabilities(name)
        if row.name != "default" and row.runtime != "onnxruntime":
            raise KvCacheError(
                f"The {row.name} row is run by {row.runtime}, not onnxruntime: ",
                Function("run_doctor"),
                " checks onnxruntime's providers (the test suite checks that row against the "
                f"installed {row.runtime}).",
            )
        if row.name != "default" and row.provider:
            names.append(row.provider)
        elif name in known:
            names.append(name)
        else:
            rows = sorted({r.name for t in CAPABILITIES.values() for r in t.values() if r.provider})
            raise KvCacheError(
                f"Unknown execution provider {name!r}: give a row name ({', '.join(rows)}) or an "
                "onnxruntime provider name (CPUExecutionProvider, CUDAExecutionProvider, ...)."
            )
    return list(dict.fromkeys(names))


def _present_providers(requested: Sequence[str] | None) -> tuple[list[str], list[str]]:
    ort = import_onnxruntime()
    available = list(ort.get_available_providers())
    present, absent = [], []
    for name in _onnxruntime_names(requested) if requested else available:
        if name not in available:
            absent.append(f"{name}: not in this onnxruntime build")
        elif name == "CUDAExecutionProvider" and cuda_compute_capability() is None:
            absent.append(f"{name}: listed, but no CUDA GPU answers (onnxruntime-gpu lists it regardless)")
        else:
            present.append(name)
    return present, absent


def _table_cell(row: EpCapabilities, fmt: str | None, granularity: str) -> tuple[str, bool]:
    """What the table says of ``fmt`` on ``row``, and whether that means a kernel runs it."""
    if not row.has_kernel:
        return "no kernel", False
    if fmt is None:
        return "runs (float cache)", True
    support = row.formats.get(fmt)
    if support is None:
        return "not listed", False
    if granularity not in support.granularities:
        return f"not {granularity}", False
    cell = f"ORT >= {support.min_version}"
    if support.min_compute_capability:
        cell += ", SM {}.{}+".format(*support.min_compute_capability)
    return cell, True


def _query_dtype(row: EpCapabilities) -> ir.DataType:
    """A query dtype the provider takes (fp16 first), else the schema's first (fp16)."""
    if ir.DataType.FLOAT16 in row.query_dtypes or not row.query_dtypes:
        return ir.DataType.FLOAT16
    return sorted(row.query_dtypes, key=lambda t: t.name)[0]


def run_doctor(providers: Sequence[str] | None = None) -> DoctorReport:
    """Check schemas and every onnxruntime provider row on this machine; see the module.

    ``providers`` limits the session checks to those providers: table row names (``cpu``,
    ``cuda``) or onnxruntime's names (default: every provider this onnxruntime lists).
    """
    present, absent = _present_providers(providers)
    schemas = check_schemas()
    provider_of = {row.provider: row.name for table in CAPABILITIES.values() for row in table.values()}
    for name in list(present):
        if name not in provider_of:
            present.remove(name)
            absent.append(f"{name}: no row in the table (not checked)")
    cache: dict[tuple, tuple[str, str]] = {}

    def probe(op: AttentionOp, dtype: ir.DataType, fmt: str | None, g: str, latent: bool, provider: str):
        key = (op.op_type, dtype, fmt, g, latent, provider)
        if key not in cache:
            cache[key] = _session(_converted(op, dtype, fmt, g, latent), provider)
        return cache[key]

    results: list[ProbeResult] = []
    for op in ATTENTION_OPS.values():
        variants = [False, True] if op.single_cache is not None else [False]
        for row in CAPABILITIES[op.op_type].values():
            if row.runtime != "onnxruntime" or not row.provider:
                continue
            dtype = _query_dtype(row)
            on_here = row.provider in present
            caches: list[tuple[str | None, str]] = [(None, "per_tensor")]
            caches += [(f, g) for f in CACHE_FORMATS for g in SCALE_GRANULARITIES]
            for latent in variants:
                for fmt, g in caches:
                    label = "float" if fmt is None else f"{fmt} {g}"
                    label += " LATENT" if latent else ""
                    table, runs = _table_cell(row, fmt, g)
                    provider = row.provider if on_here else "CPUExecutionProvider"
                    kind, message = probe(op, dtype, fmt, g, latent, provider)
                    asked = _Probe(op, row, dtype, label, table, runs, on_here)
                    results.append(_verdict(asked, kind, message))
    for row in CAPABILITIES[GQA.op_type].values():
        if row.runtime == "onnxruntime" and row.provider in present and row.head_sink is not None:
            results += [_sink_probe(row, fmt) for fmt in (None, *sorted(row.head_sink.formats))]
    return DoctorReport(
        installed_ort_version(), tuple(present), tuple(absent), tuple(schemas), tuple(results)
    )


def _sink_probe(row: EpCapabilities, fmt: str | None) -> ProbeResult:
    """``head_sink`` on ``row``'s provider with a ``fmt`` cache (None: float); see the module."""
    assert row.head_sink is not None
    dtype = _query_dtype(row)
    label = ("float" if fmt is None else f"{fmt} per_tensor") + " + head_sink"
    table = f"ORT >= {row.head_sink.min_version}"
    sinks = np.linspace(-1.0, 2.0, _HEADS).astype(np.float32)
    outputs = []
    for with_sinks in (False, True):
        model = _converted(GQA, dtype, fmt, "per_tensor", False)
        node = next(n for n in model.graph if n.op_type == GQA.op_type)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 0)
        if with_sinks:
            value = ir.Value(name="head_sink", const_value=ir.tensor(sinks.astype(dtype.numpy())))
            value.dtype, value.shape = dtype, ir.Shape([_HEADS])
            model.graph.register_initializer(value)
            if len(node.inputs) <= GqaInput.HEAD_SINK:
                node.resize_inputs(GqaInput.HEAD_SINK + 1)
            node.replace_input_with(GqaInput.HEAD_SINK, value)
        try:
            outputs.append(_one_token(model, row.provider, dtype))
        except Exception as e:  # onnxruntime raises several unrelated types
            outcome = f"{dtype.name.lower()} node with head_sink rejected: {str(e).splitlines()[0][:160]}"
            return ProbeResult(GQA.op_type, row.name, label, table, outcome, "disagrees")
    ratio = outputs[1].reshape(_HEADS, _HEAD) / outputs[0].reshape(_HEADS, _HEAD)
    want = 1.0 / (1.0 + np.exp(sinks))
    error = float(np.abs(ratio - want[:, None]).max())
    honored = error < 1e-2
    outcome = f"ran ({dtype.name.lower()}): each head scaled by 1 / (1 + exp(sink)) within {error:.1e}"
    if not honored:
        outcome = f"ran ({dtype.name.lower()}): the sinks are not in the softmax (off by {error:.1e})"
    return ProbeResult(GQA.op_type, row.name, label, table, outcome, "proven" if honored else "disagrees")


def _one_token(model: ir.Model, provider: str, dtype: ir.DataType) -> np.ndarray:
    """The output of a one-token prompt with a zero key (its score 0) and values far from 0."""
    session = create_session(model, [provider])
    rng = np.random.default_rng(0)
    t = dtype.numpy()
    names = {i.name: i for i in session.get_inputs()}
    past = names["past_key_values.0.key"]
    zeros = np.zeros((1, _KV, 0, past.shape[3] if isinstance(past.shape[3], int) else _HEAD))
    feeds = {
        "query": rng.standard_normal((1, 1, _HEADS * _HEAD)).astype(t),
        "key": np.zeros((1, 1, _KV * _HEAD), t),
        "value": (1.0 + rng.random((1, 1, _KV * _HEAD))).astype(t),
        "seqlens_k": np.zeros(1, np.int32),
        "total_sequence_length": np.array(1, np.int32),
    }
    for name in ("past_key_values.0.key", "past_key_values.0.value"):
        kind = names[name].type
        feeds[name] = zeros.astype({"tensor(int8)": np.int8, "tensor(uint8)": np.uint8}.get(kind, t))
    return np.asarray(session.run(["output"], feeds)[0], np.float32)


@dataclasses.dataclass(frozen=True)
class _Probe:
    """One provider row x cache as probed: the node's dtype, the table's cell, where it ran."""

    op: AttentionOp
    row: EpCapabilities
    dtype: ir.DataType
    label: str
    table: str
    runs: bool
    on_here: bool

    def result(self, outcome: str, verdict: Verdict) -> ProbeResult:
        return ProbeResult(self.op.op_type, self.row.name, self.label, self.table, outcome, verdict)


def _verdict(probe: _Probe, kind: str, message: str) -> ProbeResult:
    t = probe.dtype.name.lower()
    if kind == "rejected":
        outcome = f"{t} node rejected: {message}"
        return probe.result(outcome, "disagrees")
    if not probe.on_here:
        outcome = f"types resolve ({t}, checked on CPU); kernel not run here"
        return probe.result(outcome, "schema only")
    if kind == "created":
        outcome = f"session created ({t})"
        verdict: Verdict = "proven" if probe.runs else "disagrees"
    else:
        outcome = f"NOT_IMPLEMENTED only ({t}): types resolve, no kernel"
        verdict = "disagrees" if probe.runs else "proven"
    return probe.result(outcome, verdict)
