"""Never a traceback: every export form the builder writes, and random mutations of them.

Each form of :mod:`builders.exported` (every architecture preset, with each
``ExportStyle`` option and dtype varied one at a time, so forms added later flow in) is
built small, then mutated (nodes deleted or rewired, shapes and ranks changed, static and
symbolic dimensions, wrong dtypes, attributes and small constants changed) and fed to
``optimize_model`` and the conversion. The only exceptions allowed out are the library's
documented ones (:class:`KvCacheError` and its subclasses); a fusion that cannot match a
node must refuse it with a reason. A fixed numpy seed: the same graphs every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import traceback
import typing
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, convert_model, inspect_kv_cache, optimize_model

from builders.exported import EXPORT_PRESETS, build_decoder, exported_config
from builders.style import ExportStyle

SMALL = {
    "num_layers": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "kv_num_heads": 1,
    "head_size": 16,
    "intermediate_size": 32,
    "vocab_size": 64,
}
VARIANTS = {
    "static_shapes": ((1, 3, 5),),
    "query_scale": (0.25,),
    "attn_softcap": (20.0,),
    "qk_matmul_output": (3, 0),
}
"""Values to try for options that are not a Literal or a bool."""
MUTANTS_PER_FORM = 12
SEED = 20261201


def _option_values(field: dataclasses.Field) -> tuple:
    hint = typing.get_type_hints(ExportStyle)[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if hint is bool:
        return (True, False)
    return VARIANTS.get(field.name, ())


def export_forms() -> dict[str, ir.Model]:
    """Every architecture preset, and each style option and dtype varied one at a time."""
    forms: dict[str, ir.Model] = {
        "genai[gqa]": build_decoder(**SMALL),
        "genai[gqa,window]": build_decoder(**SMALL, sliding_window_layers=(0,), sliding_window=4),
        "genai[paged]": build_decoder(**SMALL, paged=True),
    }
    for arch, (_, style) in EXPORT_PRESETS.items():
        changes: list[tuple[str, dict, dict]] = [("", {}, {})]
        changes += [(f"dtype={d}", {}, {"dtype": d}) for d in ("float16",)]
        for field in dataclasses.fields(ExportStyle):
            for value in _option_values(field):
                if getattr(style, field.name) != value:
                    changes.append((f"{field.name}={value}", {field.name: value}, {}))
        # the forms the issue names: opset 20 with the options that need it
        changes.append(("opset=20,static", {"opset": 20, "static_shapes": (1, 3, None)}, {}))
        changes.append(("opset=20,static-past", {"opset": 20, "static_shapes": (1, 3, 5)}, {}))
        changes.append(("cropped,eager", {"window_cache": "cropped", "attention": "eager"}, {}))
        changes.append(("cropped,opset20", {"window_cache": "cropped", "opset": 20}, {}))
        for label, style_change, config_change in changes:
            try:
                config = exported_config(
                    arch,
                    **SMALL | {"sliding_window": 4} | config_change,
                    exported=dataclasses.replace(style, **style_change),
                )
                forms[f"{arch}[{label}]"] = build_decoder(config)
            except KvCacheError:
                continue  # a combination the builder refuses (e.g. softcap at opset 20)
    return forms


class Mutator:
    """Random, seeded graph mutations."""

    DTYPES = (
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.INT64,
        ir.DataType.INT32,
        ir.DataType.BOOL,
        ir.DataType.UINT8,
        ir.DataType.DOUBLE,
    )

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def dim(self):
        choice = self.rng.integers(5)
        return [None, int(self.rng.integers(0, 9)), "batch", "past", f"d{self.rng.integers(3)}"][choice]

    def mutate(self, model: ir.Model) -> str:
        graph = model.graph
        nodes = list(graph)
        kind = ["delete", "rewire", "shape", "rank", "dtype", "attribute", "constant", "output"][
            self.rng.integers(8)
        ]
        node = nodes[self.rng.integers(len(nodes))]
        if kind == "delete":
            replacement = next((v for v in node.inputs if v is not None), None)
            for output in node.outputs:
                if replacement is not None and self.rng.random() < 0.7:
                    output.replace_all_uses_with(replacement, replace_graph_outputs=True)
            for output in node.outputs:  # what is still read now has no producer
                if output.is_graph_output():
                    graph.outputs.remove(output)
            graph.remove(node, safe=False)
        elif kind == "rewire" and node.inputs:
            earlier = [v for n in nodes[: nodes.index(node)] for v in n.outputs]
            earlier += list(graph.inputs) + list(graph.initializers.values())
            node.replace_input_with(
                int(self.rng.integers(len(node.inputs))), earlier[self.rng.integers(len(earlier))]
            )
        elif kind in ("shape", "rank"):
            values = [v for v in node.outputs] + [v for v in graph.inputs]
            value = values[self.rng.integers(len(values))]
            if kind == "rank" or value.shape is None:
                rank = int(self.rng.integers(0, 6))
                value.shape = None if self.rng.random() < 0.2 else ir.Shape([self.dim() for _ in range(rank)])
            else:
                dims = list(value.shape)
                if dims:
                    dims[self.rng.integers(len(dims))] = self.dim()
                value.shape = ir.Shape(dims)
        elif kind == "dtype":
            values = [v for v in node.outputs] + [v for v in graph.inputs]
            value = values[self.rng.integers(len(values))]
            if self.rng.random() < 0.9:
                value.dtype = self.DTYPES[self.rng.integers(len(self.DTYPES))]
            else:
                value.type = None  # no type information (as a file without value_info has)
        elif kind == "attribute" and node.attributes:
            name = list(node.attributes)[self.rng.integers(len(node.attributes))]
            attr = node.attributes[name]
            if attr.type == ir.AttributeType.INT:
                node.attributes[name] = ir.AttrInt64(name, int(self.rng.integers(-4, 5)))
            elif attr.type == ir.AttributeType.INTS:
                size = int(self.rng.integers(0, 6))
                node.attributes[name] = ir.AttrInt64s(name, [int(x) for x in self.rng.integers(-4, 5, size)])
            elif attr.type == ir.AttributeType.FLOAT:
                node.attributes[name] = ir.AttrFloat32(name, float(self.rng.choice([0.0, -1.0, np.nan, 3.0])))
            else:
                del node.attributes[name]
        elif kind == "constant":
            small = [
                v
                for v in graph.initializers.values()
                if v.const_value is not None and v.const_value.size <= 8
            ]
            if small:
                value = small[self.rng.integers(len(small))]
                array = np.asarray(value.const_value.numpy())
                if array.dtype.kind in "iu":
                    changed = self.rng.integers(-9, 2**40 if self.rng.random() < 0.1 else 9, array.shape)
                else:
                    changed = self.rng.choice([0.0, -np.inf, np.nan, 2.0, -1e4], array.shape)
                if self.rng.random() < 0.2:  # a different rank
                    changed = np.asarray(changed).reshape(-1)[:1].reshape(())
                value.const_value = ir.tensor(np.asarray(changed, array.dtype), name=value.name)
        elif kind == "output" and graph.outputs:
            graph.outputs.pop(int(self.rng.integers(len(graph.outputs))))
        return kind


ALLOWED = (KvCacheError,)


def _run(model: ir.Model, convert: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _optimize(model, convert)


def _optimize(model: ir.Model, convert: bool) -> None:
    if True:
        try:
            optimize_model(model)
        except ALLOWED:
            return
        if convert:
            try:
                optimize_model(model, fp8_kv_cache=True, ep=None)
            except ALLOWED:
                return


WALK = 3
"""Mutations applied one after another to one copy, each step a graph of its own (a step
after a fusion mutates the fused graph, which the conversion then reads)."""


def _mutants(name: str, proto: bytes, rng: np.random.Generator, count: int):
    mutator = Mutator(rng)
    for k in range(0, count, WALK):
        model = ir.from_proto(onnx.ModelProto.FromString(proto))
        steps: list[str] = []
        for _ in range(WALK):
            steps.append(mutator.mutate(model))
            yield f"{name} #{k} ({', '.join(steps)})", model


@pytest.fixture(scope="module")
def forms() -> dict[str, bytes]:
    return {name: ir.to_proto(model).SerializeToString() for name, model in export_forms().items()}


def test_every_form_is_built(forms):
    archs = {name.split("[")[0] for name in forms}
    assert archs == {*EXPORT_PRESETS, "genai"}
    assert any("static" in name for name in forms) and any("window_cache=cropped" in name for name in forms)
    assert len(forms) >= 40


def test_every_form_fuses_or_refuses_without_a_traceback(forms):
    failures = []
    for name, proto in forms.items():
        try:
            _run(ir.from_proto(onnx.ModelProto.FromString(proto)), convert=True)
        except Exception:
            failures.append(f"{name}: {traceback.format_exc(limit=-3)}")
    assert not failures, "\n".join(failures[:5])


TOOLS_EVERY = 40
"""One graph in this many also goes through convert_model (a file), inspect_kv_cache and
KvCacheRunner (an onnxruntime session and two decode steps)."""


def _tools(model: ir.Model, folder: pathlib.Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (
            lambda: inspect_kv_cache(model),
            lambda: KvCacheRunner(model).generate([1, 2, 3], 2),
        ):
            with contextlib.suppress(ALLOWED):
                step()
        try:
            source = folder / "model.onnx"
            ir.save(model, source)
        except Exception:
            return  # not a file at all: nothing to convert
        with contextlib.suppress(ALLOWED):
            convert_model(source, folder / "model.fp8.onnx", format="fp8", ep=None, overwrite=True)


def test_mutated_graphs_give_no_traceback(forms, tmp_path):
    rng = np.random.default_rng(SEED)
    failures: dict[str, str] = {}
    seen = 0
    for name, proto in forms.items():
        for label, model in _mutants(name, proto, rng, MUTANTS_PER_FORM):
            seen += 1
            try:
                if seen % TOOLS_EVERY == 0:
                    _tools(model, tmp_path)
                _run(model, convert=seen % 4 == 0)
            except Exception as error:
                where = traceback.extract_tb(error.__traceback__)[-1]
                key = f"{type(error).__name__} at {where.filename.split('/')[-1]}:{where.lineno}"
                failures.setdefault(key, f"{label}: {traceback.format_exc(limit=-4)}")
    assert seen >= 2000
    assert not failures, f"{len(failures)} distinct traceback(s):\n" + "\n".join(failures.values())
