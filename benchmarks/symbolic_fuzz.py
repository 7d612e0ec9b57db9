"""A differential fuzz of the fusions' symbolic evaluator against onnxruntime.

    python benchmarks/symbolic_fuzz.py --cases N --seed S [--jobs J] [--start I] [--op OP]
        [--only K] [--quiet]

Each case is a random graph over symbolic dimensions (float ``x [A, B, C]``, integer inputs
``m [R, K]`` (int64) and ``n [R, K]`` (int32) read by entries, ``ids [S]``) built from the
operators of the evaluator's rule table
(:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES`: shape arithmetic, index ranges,
masks, casts, gathers, slices, reductions, ...), one builder per row (:data:`BUILDERS`), at
one opset of 12 to 24, each operator in the form that opset defines (``axes`` an attribute or
an input, ``Split``'s sizes, ``num_outputs``, ``Shape``'s ``start``/``end``, a softmax's
default axis). Constants are drawn small, negative, at the narrow types' boundaries and at
int64's extremes; half are initializers, half ``Constant`` nodes. Every node's output is a
graph output. One evaluator evaluates them all; onnxruntime (CPU, no graph optimizations)
then runs the graph at four sizes of the dimensions (some 0, all 1, small, one of 1000) and
entries of ``m``/``n`` (0/1, small signed, boundaries, the type's extremes), and every claim
the evaluator makes is compared with what onnxruntime computed: each shape and element type
(fresh dimensions bound on first sight), an integer tensor's element form and small vectors'
values (exact integers), a boolean's condition, an index stack, a float mask (0 where kept,
its fill elsewhere) and a float constant. A claim that differs is a disagreement: it is
printed with the case's graph, the sizes and the inputs, reproducible with
``--seed S --only K``. The last line reads ``N cases, D disagreements``. ``--jobs`` shares the
same cases among processes, ``--start`` begins at a later case (a long run in parts); ``--op``
begins every case with one operator (one rule's fuzz).

What is not a disagreement, and why:

- the evaluator declines (Unprovable, or a value left opaque): a refusal is always sound;
- onnxruntime does not load the graph (a form the opset does not define, types that do not
  match): the graph computes nothing, so nothing the evaluator says of it is wrong;
- a node onnxruntime refuses at some sizes (an index past an empty axis, shapes that do not
  broadcast): it and what reads it compute nothing there; the rest of the graph is run
  without them and compared;
- a run in which an int64 ``Add``, ``Sub``, ``Mul``, ``Neg``, ``CumSum`` or ``ReduceSum``
  overflowed (checked against the same operation in exact integers on the run's own
  values): onnxruntime wraps, while the evaluator's integers are exact. Its claims hold for
  every run without an overflow (the premise a length or token count satisfies); such a run
  is counted apart. A narrowing ``Cast`` is no overflow: it wraps by definition and is
  compared.

An evaluator exception other than Unprovable is a disagreement too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import multiprocessing
import pathlib
import re
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion._symbolic_values import (
    MASKED_BELOW,
    Additive,
    Affine,
    Conj,
    FloatConst,
    Le,
    MaskAt,
    SymbolKind,
    SymTensor,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import symbolic_fuzz_graphs as graphs
from symbolic_fuzz_graphs import (
    BOUNDARIES,
    BUILDERS,
    DIMS,
    INT64_MAX,
    LARGE,
    build_case,
)

# ---- the evaluator's claims made concrete ----


class Mismatch(Exception):
    """A claim that differs from what onnxruntime computed."""


class Unbound(Exception):
    """A claim reads a symbol with no concrete value here (a fresh dimension not yet seen)."""


@dataclasses.dataclass
class Run:
    """One onnxruntime run: the sizes, the inputs, fresh dimensions bound so far."""

    dims: dict[str, int]
    feeds: dict[str, np.ndarray]
    exact: bool
    fresh: dict[str, int] = dataclasses.field(default_factory=dict)


def _array(x, exact: bool) -> np.ndarray:
    return np.asarray(x, dtype=object if exact else np.int64)


def concrete(form: Affine, run: Run, grid: list[np.ndarray]) -> np.ndarray:
    """``form``'s value (at every index of ``grid``), in exact integers where they may be large."""
    exact = run.exact or abs(form.const) > 2**31 or any(abs(c) > 2**31 for _, c in form.terms)
    total = _array(form.const, exact)
    for symbol, c in form.terms:
        total = total + _array(c, exact) * _array(_symbol(symbol, run, grid), exact)
    return total


def _symbol(symbol, run: Run, grid: list[np.ndarray]):
    kind = symbol.kind
    if kind is SymbolKind.DIM:
        return run.dims[symbol.name]
    if kind is SymbolKind.FRESH:
        if symbol.name not in run.fresh:
            raise Unbound(str(symbol))
        return run.fresh[symbol.name]
    if kind is SymbolKind.AXIS:
        return grid[int(symbol.name)]
    if kind is SymbolKind.MAX:
        inner = concrete(symbol.form, run, grid)
        return np.where(inner > 0, inner, 0)
    if kind is SymbolKind.PRODUCT:
        total = 1
        for factor, power in symbol.form.terms:
            total = total * _symbol(factor, run, grid) ** power
        return total
    if kind in (SymbolKind.ENTRY, SymbolKind.COUNT):
        return _lookup(symbol.at.source, symbol.at.row, symbol.at.col, run, grid, kind is SymbolKind.COUNT)
    raise Unbound(str(symbol))


def _lookup(source: str, row: Affine, col: Affine, run: Run, grid, count: bool = False) -> np.ndarray:
    data = run.feeds[source].astype(object if run.exact else np.int64)
    r, k = (concrete(f, run, grid) for f in (row, col))
    if count:
        data = np.concatenate([np.zeros((data.shape[0], 1), data.dtype), np.cumsum(data, axis=1)], axis=1)
        k = k + 1
    r, k = np.broadcast_arrays(r, k)
    if r.size and (r.min() < 0 or r.max() >= data.shape[0] or k.min() < 0 or k.max() >= data.shape[1]):
        raise Mismatch(f"it reads {source}[{row}, {col}] outside {source}'s {list(run.feeds[source].shape)}")
    return data[r.astype(np.int64), k.astype(np.int64)]


def condition(cond: Conj, run: Run, grid: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    out = np.ones(shape, bool)
    for atom in cond.atoms:
        if isinstance(atom, Le):
            out &= np.broadcast_to(np.asarray(concrete(atom.lhs, run, grid) <= 0, bool), shape)
        else:
            assert isinstance(atom, MaskAt)
            found = _lookup(atom.source, atom.row, atom.col, run, grid)
            out &= np.broadcast_to(np.asarray(found != 0, bool), shape)
    return out


def _same(claimed: np.ndarray, got: np.ndarray, what: str) -> None:
    claimed = np.broadcast_to(claimed, got.shape)
    if got.dtype == bool or claimed.dtype == bool:
        equal = np.asarray(claimed, bool) == got
    else:
        equal = np.asarray(claimed == got.astype(object), bool)
    if not equal.all():
        at = tuple(int(i) for i in np.argwhere(~equal)[0])
        raise Mismatch(f"{what} at {list(at)}: said {claimed[at]}, onnxruntime {got[at]}")


_KINDS = {"int": "iu", "bool": "b", "float": "f", "data": "f"}


def check_shape(tensor: SymTensor, got: np.ndarray, run: Run) -> None:
    if "?" not in (kinds := _KINDS.get(tensor.kind, "?")) and got.dtype.kind not in kinds:
        raise Mismatch(f"said {tensor.kind} elements, onnxruntime's are {got.dtype}")
    if tensor.rank != got.ndim:
        raise Mismatch(
            f"said rank {tensor.rank} ({_shown(tensor.shape)}), onnxruntime's shape is {list(got.shape)}"
        )
    for k, dim in enumerate(tensor.shape):
        if len(dim.terms) == 1 and dim.terms[0][0].kind is SymbolKind.FRESH and dim.terms[0][1] == 1:
            name = dim.terms[0][0].name
            run.fresh.setdefault(name, got.shape[k] - dim.const)
        try:
            size = int(concrete(dim, run, []))
        except Unbound:
            continue
        if size != got.shape[k]:
            raise Mismatch(f"said shape {_shown(tensor.shape)}, onnxruntime's is {list(got.shape)}")


def _shown(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_elements(tensor: SymTensor, got: np.ndarray, run: Run) -> int:
    """Compare what ``tensor`` says of the elements with ``got``; how many claims it made."""
    said = 0
    if tensor.values is not None and tensor.rank <= 1:
        if len(tensor.values) != got.size:
            raise Mismatch(f"said {len(tensor.values)} values, onnxruntime has {got.size}")
        if got.size:
            claimed = np.array([concrete(v, run, []) for v in tensor.values], dtype=object)
            _same(claimed.reshape(got.shape), got, "values")
        said += 1
    if tensor.conds is not None:
        claimed = np.array([condition(c, run, [], ()) for c in tensor.conds]).reshape(-1)
        if claimed.size != got.size:
            raise Mismatch(f"said {claimed.size} conditions, onnxruntime has {got.size}")
        _same(claimed.reshape(got.shape), got, "conditions")
        said += 1
    if tensor.stack is not None and got.size:
        inner = list(np.indices(got.shape[:-1], dtype=np.int64))
        forms = [np.broadcast_to(concrete(f, run, inner), got.shape[:-1]) for f in tensor.stack]
        if got.shape[-1] != len(forms):
            raise Mismatch(f"said a stack of {len(forms)}, onnxruntime's last axis is {got.shape[-1]}")
        _same(np.stack(forms, -1), got, "index stack")
        said += 1
    if tensor.elem is not None and got.size:
        said += _check_elem(tensor.elem, got, run)
    return said


def _check_elem(elem, got: np.ndarray, run: Run) -> int:
    grid = list(np.indices(got.shape, dtype=np.int64))
    if isinstance(elem, Affine):
        _same(concrete(elem, run, grid), got, f"element {elem}")
    elif isinstance(elem, Conj):
        _same(condition(elem, run, grid, got.shape), got, "condition")
    elif isinstance(elem, Additive):
        keep = condition(elem.cond, run, grid, got.shape)
        if not np.all(got[keep] == 0) or not np.all(got[~keep] <= MASKED_BELOW):
            raise Mismatch(f"said a mask (0 where kept), onnxruntime {got.reshape(-1)[:8]} ...")
        if elem.fill is not None and not np.all(got[~keep] == elem.fill):
            raise Mismatch(f"said a mask filled with {elem.fill}, onnxruntime {got[~keep][:4]}")
    elif isinstance(elem, FloatConst) and not np.array_equal(
        got, np.full(got.shape, elem.value, got.dtype), equal_nan=True
    ):
        raise Mismatch(f"said {elem.value} everywhere, onnxruntime {got.reshape(-1)[:4]}")
    return 1


# ---- onnxruntime's runs ----


def sizes(rng: np.random.Generator) -> list[dict[str, int]]:
    """The runs' sizes: some 0, all 1, small, and one dimension large."""
    small = {d: int(rng.integers(1, 6)) for d in DIMS}
    zeros = dict(small, **{str(d): 0 for d in rng.choice(DIMS, int(rng.integers(1, 3)), replace=False)})
    ones = {d: 1 for d in DIMS}
    large = dict({d: int(rng.integers(1, 4)) for d in DIMS}, **{str(rng.choice(DIMS)): LARGE})
    return [zeros, ones, small, large]


def entries(rng: np.random.Generator, shape: tuple[int, ...], dtype=np.int64) -> np.ndarray:
    """An integer input's entries: 0/1 mostly, else small signed, boundaries or the extremes."""
    mode = rng.random()
    if mode < 0.5:
        return rng.integers(0, 2, shape).astype(dtype)
    if mode < 0.7:
        return rng.integers(-3, 4, shape).astype(dtype)
    info = np.iinfo(dtype)
    extremes = (int(info.max), int(info.min), int(info.max) - 1, int(info.min) + 1) if mode > 0.85 else ()
    values = [v for v in (0, 1, -1, *BOUNDARIES, *(-b for b in BOUNDARIES)) if info.min <= v <= info.max]
    return rng.choice(np.array([*values, *extremes], object), shape).astype(dtype)


def feeds_for(rng: np.random.Generator, dims: dict[str, int]) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((dims["A"], dims["B"], dims["C"])).astype(np.float32),
        "m": entries(rng, (dims["R"], dims["K"])),
        "ids": rng.integers(0, 9, dims["S"]).astype(np.int64),
        "n": entries(rng, (dims["R"], dims["K"]), np.int32),
    }


_WRAPS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


def overflowed(model: ir.Model, values: dict[str, np.ndarray]) -> bool:
    """Whether an int64 Add, Sub, Mul or Neg of the run wrapped (its exact result differs), or a
    CumSum or ReduceSum may have (the sum of its input's magnitudes exceeds int64)."""
    for node in model.graph:
        out = values.get(node.outputs[0].name)
        if out is None or out.dtype != np.int64:
            continue
        inputs = [values.get(v.name) if v is not None else None for v in node.inputs]
        if node.op_type in _WRAPS and all(i is not None for i in inputs[:2]):
            exact = _WRAPS[node.op_type](inputs[0].astype(object), inputs[1].astype(object))
        elif node.op_type == "Neg" and inputs[0] is not None:
            exact = -inputs[0].astype(object)
        elif node.op_type in ("CumSum", "ReduceSum") and inputs[0] is not None:
            if sum(abs(int(v)) for v in inputs[0].reshape(-1)) > INT64_MAX:
                return True
            continue
        else:
            continue
        if np.shape(exact) == out.shape and not np.all(exact == out.astype(object)):
            return True
    return False


def _session(model: onnx.ModelProto, names: list[str] | None = None):
    """A one-thread CPU session without graph optimizations; with ``names``, of the graph that
    computes only those outputs."""
    proto = model
    if names is not None:
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        kept = set(names)
        outputs = [o for o in proto.graph.output if o.name in kept]
        needed = set(kept)
        nodes = []
        for node in reversed(proto.graph.node):
            if any(o in needed for o in node.output):
                nodes.append(node)
                needed.update(node.input)
        del proto.graph.output[:]
        proto.graph.output.extend(outputs)
        del proto.graph.node[:]
        proto.graph.node.extend(reversed(nodes))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


# ---- a case: the evaluator's claims against onnxruntime's runs ----


@dataclasses.dataclass
class Tally:
    cases: int = 0
    loaded: int = 0
    runs: int = 0
    refused_runs: int = 0
    overflowed_runs: int = 0
    shapes: int = 0
    elements: int = 0
    declined: int = 0
    disagreements: int = 0
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class Disagreement:
    case: int
    value: str
    text: str
    dims: dict[str, int] | None = None
    feeds: dict[str, np.ndarray] | None = None


def claims(model: ir.Model) -> tuple[dict[str, SymTensor | None], list[Disagreement]]:
    """The evaluator's answer for every node output (None: declined), one evaluator for the graph."""
    ev = SymbolicEvaluator()
    found: dict[str, SymTensor | None] = {}
    crashed = []
    for node in model.graph:
        for value in node.outputs:
            try:
                found[value.name] = ev.eval(value)
            except Unprovable:
                found[value.name] = None
            except Exception as error:  # a rule that breaks is a finding too
                found[value.name] = None
                crashed.append(
                    Disagreement(-1, value.name, f"the evaluator raised {type(error).__name__}: {error}")
                )
    return found, crashed


def run_case(seed: int, index: int, tally: Tally) -> list[Disagreement]:
    case = build_case(seed, index)
    model = case.model()
    tally.cases += 1
    said, found = claims(model)
    try:
        proto = ir.to_proto(model)
        session = _session(proto)
    except Exception:
        return [dataclasses.replace(d, case=index) for d in found]
    tally.loaded += 1
    tally.ops.update((n.domain, n.op_type) for n in model.graph if n.op_type != "Constant")
    tally.declined += sum(1 for t in said.values() if t is None or not t.known)
    names = [o.name for o in session.get_outputs()]
    for d in found:
        d.case = index
    for dims in sizes(case.rng):
        found += _compare_run(case, model, proto, session, names, said, dims, tally)
    return found


_FAILED_NODE = re.compile(r"running \S+ node\. Name:'([^']*)'")


def _without(model: ir.Model, name: str, names: list[str]) -> list[str]:
    """``names`` less the outputs of node ``name`` and of every node that reads them."""
    lost: set[str] = set()
    for node in model.graph:  # in order: a reader comes after what it reads
        if node.name == name or any(v is not None and v.name in lost for v in node.inputs):
            lost.update(o.name for o in node.outputs)
    return [n for n in names if n not in lost]


def run_pruned(model: ir.Model, proto, session, names: list[str], feeds) -> dict[str, np.ndarray] | None:
    """onnxruntime's outputs at ``feeds``; where a node refuses these sizes, the outputs that do not
    depend on it, from the graph without it (onnxruntime runs every node of a graph, fetched or
    not). None: nothing could be computed."""
    for _ in range(8):
        if not names:
            return None
        try:
            return dict(zip(names, (np.asarray(o) for o in session.run(names, feeds))))
        except Exception as error:
            failed = _FAILED_NODE.search(str(error))
            if failed is None:
                return None
            names = _without(model, failed.group(1), names)
            try:
                session = _session(proto, names)
            except Exception:
                return None
    return None


def _compare_run(case, model, proto, session, names, said, dims, tally: Tally) -> list[Disagreement]:
    feeds = feeds_for(case.rng, dims)
    values = run_pruned(model, proto, session, names, feeds)
    if values is None:
        tally.refused_runs += 1
        return []
    values |= {v.name: np.asarray(v.const_value.numpy()) for v in model.graph.initializers.values()}
    values |= feeds
    if overflowed(model, values):
        tally.overflowed_runs += 1
        return []
    tally.runs += 1
    large = max(int(np.abs(feeds[k].astype(object)).max(initial=0)) for k in ("m", "n"))
    run = Run(dims, feeds, exact=large >= 2**31)
    found = []
    ordered = sorted(said.items(), key=lambda kv: kv[1] is None)
    for phase in ("shape", "elements"):
        for name, tensor in ordered:
            if tensor is None or name not in values or name in {d.value for d in found}:
                continue
            try:
                if phase == "shape":
                    check_shape(tensor, values[name], run)
                    tally.shapes += 1
                else:
                    tally.elements += check_elements(tensor, values[name], run)
            except Unbound:
                continue
            except Mismatch as why:
                found.append(Disagreement(0, name, str(why), dims, feeds))
    return found


def _op_option() -> str:
    first = graphs.FIRST
    return "" if first is None else f" --op {'.'.join(p for p in first if p)}"


def report(seed: int, index: int, d: Disagreement) -> str:
    case = build_case(seed, index)
    model = case.model()
    node = next((n for n in model.graph if any(o.name == d.value for o in n.outputs)), None)
    where = f"{node.op_type} node {node.name!r}" if node is not None else "?"
    lines = [
        f"disagreement: case {index} (--seed {seed} --only {index}{_op_option()}), opset {case.opset}: "
        f"value {d.value!r} of {where}: {d.text}"
    ]
    if d.dims is not None:
        lines.append(f"  sizes {d.dims}")
        lines.append(f"  m = {d.feeds['m'].tolist() if d.feeds['m'].size <= 64 else '(large)'}")
        lines.append(f"  ids = {d.feeds['ids'].tolist() if d.feeds['ids'].size <= 64 else '(large)'}")
    text = onnx.printer.to_text(ir.to_proto(model).graph)
    lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines)


def _chunk(job: tuple[int, int, int, bool]) -> tuple[Tally, list[str]]:
    """Cases ``start`` to ``stop`` of ``seed``: their tally and the reports of their disagreements."""
    seed, start, stop, quiet = job
    tally, reports = Tally(), []
    for index in range(start, stop):
        for d in run_case(seed, index, tally):
            tally.disagreements += 1
            if not quiet:
                reports.append(report(seed, index, d))
    return tally, reports


def _add(total: Tally, part: Tally) -> None:
    for field in dataclasses.fields(Tally):
        if field.name != "ops":
            setattr(total, field.name, getattr(total, field.name) + getattr(part, field.name))
    total.ops.update(part.ops)


def fuzz(
    cases: int,
    seed: int,
    only: int | None = None,
    out=None,
    quiet: bool = False,
    jobs: int = 1,
    start: int = 0,
) -> Tally:
    """Cases ``start .. start + cases - 1`` of ``seed`` (or case ``only``), over ``jobs``
    processes, in order: the same cases and the same reports whatever ``jobs``."""
    out = out or sys.stdout
    tally = Tally()
    first, last = (only, only + 1) if only is not None else (start, start + cases)
    chunks = [(seed, k, min(k + _CHUNK, last), quiet) for k in range(first, last, _CHUNK)]
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        parts = pool.imap(_chunk, chunks) if pool is not None else map(_chunk, chunks)
        for (_, _, stop, _), (part, reports) in zip(chunks, parts):
            _add(tally, part)
            for text in reports:
                print(text, file=out)
            if stop % 10000 == 0:
                print(
                    f"{tally.cases} cases (to case {stop - 1}), {tally.disagreements} disagreements so far",
                    file=sys.stderr,
                    flush=True,
                )
    return tally


_CHUNK = 500
"""Cases a process takes at a time."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="how many random graphs")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the cases")
    parser.add_argument("--only", type=int, default=None, help="run only case K of the seed (a reproduction)")
    parser.add_argument("--start", type=int, default=0, help="the first case (the cases of a longer run)")
    parser.add_argument("--quiet", action="store_true", help="print only the counts")
    parser.add_argument("--jobs", type=int, default=1, help="processes that share the cases")
    parser.add_argument("--op", default=None, help="begin every case with this operator (com.microsoft.X)")
    args = parser.parse_args(argv)
    graphs.FIRST = None if args.op is None else (args.op.rpartition(".")[0], args.op.rpartition(".")[2])
    if graphs.FIRST is not None and graphs.FIRST not in BUILDERS:
        parser.error(f"--op {args.op}: not an operator of the rule table")
    start = time.perf_counter()
    tally = fuzz(args.cases, args.seed, args.only, quiet=args.quiet, jobs=args.jobs, start=args.start)
    seconds = time.perf_counter() - start
    print(
        f"{tally.loaded} of {tally.cases} graphs loaded by onnxruntime, {tally.runs} runs compared "
        f"({tally.refused_runs} refused by onnxruntime, {tally.overflowed_runs} with an int64 overflow), "
        f"{tally.shapes} shapes and {tally.elements} element claims checked, {tally.declined} values "
        f"declined, {len(tally.ops)} operators, {seconds:.1f} s"
    )
    print(f"{tally.cases} cases, {tally.disagreements} disagreements")
    return 1 if tally.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
