"""The package root exports what users call and every type those calls return or raise."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import typing

import onnx_ir as ir
import pytest

import onnx_kvcache
from onnx_kvcache import errors, passes
from onnx_kvcache.models.decoder import DecoderConfig, build_decoder


def _library_classes(annotation: object) -> set[type]:
    """Classes of this library named anywhere in a type annotation."""
    found = set()
    if inspect.isclass(annotation) and annotation.__module__.startswith("onnx_kvcache"):
        found.add(annotation)
    for arg in typing.get_args(annotation):
        found |= _library_classes(arg)
    return found


def test_every_exported_name_resolves():
    missing = [name for name in onnx_kvcache.__all__ if not hasattr(onnx_kvcache, name)]
    assert not missing
    assert len(set(onnx_kvcache.__all__)) == len(onnx_kvcache.__all__)


@pytest.mark.parametrize(
    "name", [n for n in onnx_kvcache.__all__ if inspect.isfunction(getattr(onnx_kvcache, n))]
)
def test_the_types_a_public_function_returns_are_exported(name):
    function = getattr(onnx_kvcache, name)
    module = vars(importlib.import_module(function.__module__))
    try:  # names imported only for type checking must then come from the package root
        hints = typing.get_type_hints(function, localns={**vars(onnx_kvcache), **module})
    except NameError as error:
        pytest.fail(f"{name}: {error}, which the package does not export")
    returned = _library_classes(hints.get("return"))
    exported = {n for n in onnx_kvcache.__all__ if inspect.isclass(getattr(onnx_kvcache, n))}
    assert {cls.__name__ for cls in returned} <= exported, f"{name} returns {returned}"


def test_every_error_and_warning_the_library_raises_is_in_onnx_kvcache_errors():
    """The root holds the base types; every kind of error and warning is in ``onnx_kvcache.errors``."""
    raised = [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, Warning | Exception) and obj.__module__ == errors.__name__
    ]
    assert len(raised) >= 15
    assert {cls.__name__ for cls in raised} == set(errors.__all__)  # and nothing else: no message helpers
    assert all(getattr(onnx_kvcache.errors, cls.__name__) is cls for cls in raised)
    assert errors.KvCachePreconditionError.__name__ in errors.__all__  # made on first use
    at_root = {n for n in onnx_kvcache.__all__ if inspect.isclass(getattr(onnx_kvcache, n))}
    at_root = {n for n in at_root if issubclass(getattr(onnx_kvcache, n), Warning | Exception)}
    assert at_root == {"KvCacheError", "KvCacheWarning", "MissingRuntimeError"}
    assert all(issubclass(cls, onnx_kvcache.KvCacheWarning) for cls in raised if issubclass(cls, Warning))


def test_the_top_level_api_is_one_a_user_can_hold_in_mind():
    """At most 45 names; one emulation entry point (``emulate_kv_cache``, every format)."""
    assert len(onnx_kvcache.__all__) <= 45
    assert "emulate_kv_cache" in onnx_kvcache.__all__
    assert not [n for n in onnx_kvcache.__all__ if n.startswith("emulate_") and n != "emulate_kv_cache"]
    assert not hasattr(passes.kv_cache_emulation, "emulate_fp8_kv_cache")


#: Modules that define no exported name and that README.md and docs/ never import, yet keep a
#: public name, and why. Any other such module is ``_``-prefixed.
UNPREFIXED_INTERNAL = {
    "onnx_kvcache.cli.commands": "the command's module, conventionally named",
    "onnx_kvcache.model_io.genai_folder": "genai folder rules: whether users import them is undecided",
    "onnx_kvcache.cache.sites": "finding attention sites; the passes import it, so a rename goes with theirs",
    "onnx_kvcache.models.config": "DecoderConfig's home (models.decoder names it); tests/builders extend it",
}


def _modules(package) -> set[str]:
    """Every module (not package) under ``package``, by its dotted name."""
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    return {name for _, name, is_package in found if not is_package}


def test_a_module_nobody_outside_imports_is_private():
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    documented = {m for page in pages for m in re.findall(r"onnx_kvcache(?:\.\w+)+", page.read_text())}
    homes = {getattr(getattr(onnx_kvcache, n), "__module__", "") for n in onnx_kvcache.__all__}
    homes |= set(onnx_kvcache._EXPORTS)  # tables have no __module__: where the root finds them
    public = {m for m in _modules(onnx_kvcache) if not any(p.startswith("_") for p in m.split("."))}
    internal = public - documented - homes
    assert internal == set(UNPREFIXED_INTERNAL), (
        f"prefix with _: {sorted(internal - set(UNPREFIXED_INTERNAL))}"
    )


def test_every_pass_is_exported():
    defined = set()
    for name in _modules(passes):
        if name.rsplit(".", 1)[1].startswith("_"):
            continue
        mod = importlib.import_module(name)
        defined |= {
            obj
            for obj in vars(mod).values()
            if inspect.isclass(obj) and issubclass(obj, ir.passes.PassBase) and obj.__module__ == mod.__name__
        }
    assert len(defined) >= 8
    assert {cls.__name__ for cls in defined} <= set(onnx_kvcache.__all__) & set(passes.__all__)


def test_optimize_model_returns_the_model_it_was_given():
    model = build_decoder(DecoderConfig(num_layers=1, dtype="float16"))
    scales = {0: (0.5, 0.5)}
    assert onnx_kvcache.optimize_model(model, format="int8", scales=scales) is model
    assert typing.get_type_hints(onnx_kvcache.optimize_model)["return"] is ir.Model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    model = build_decoder(DecoderConfig(num_layers=1, dtype="float16"))
    onnx_kvcache.optimize_model(model, fp8_kv_cache=True, ep=None, scales={0: (0.5, 0.5)})
    ir.save(model, path)
    return path


READERS = {
    "inspect_kv_cache": lambda m: onnx_kvcache.inspect_kv_cache(m).layers[0].dtype,
    "check_kv_cache_support": lambda m: onnx_kvcache.check_kv_cache_support(m, "cuda", "fp8").supported,
    "fast_path_diagnostics": lambda m: len(onnx_kvcache.fast_path_diagnostics(m)),
    "emulate_kv_cache": lambda m: onnx_kvcache.emulate_kv_cache(m).graph.num_nodes() > 0,
    "emulate_kv_cache(quantized_io=True)": lambda m: (
        onnx_kvcache.emulate_kv_cache(m, quantized_io=True).graph.num_nodes() > 0
    ),
}


@pytest.mark.parametrize("function", list(READERS))
def test_functions_that_read_a_model_take_it_in_memory_as_a_proto_or_as_a_path(function, model_path):
    import onnx

    read = READERS[function]
    expected = read(ir.load(model_path))
    assert read(onnx.load(model_path, load_external_data=False)) == expected
    assert read(model_path) == read(str(model_path)) == expected
    with pytest.raises(errors.KvCacheTypeError, match="Expected a model"):  # a TypeError too
        read(42)


@pytest.mark.parametrize("name", passes.__all__)
def test_a_pass_given_something_else_than_an_ir_model_says_so(name, model_path):
    import onnx

    pass_ = getattr(passes, name)(
        *(["int8"] if name in ("KvCacheQuantizationPass", "QdqKvCachePass") else [])
    )
    for wrong in (str(model_path), onnx.load(model_path, load_external_data=False)):
        with pytest.raises(onnx_kvcache.KvCacheError, match=f"{name} takes an onnx_ir.Model.*onnx_ir.load"):
            pass_(wrong)


def test_the_lazy_exports_are_exactly_the_public_names():
    assert set(onnx_kvcache._MODULE_OF) == set(onnx_kvcache.__all__)


def test_the_package_description_names_every_attention_operator_it_converts():
    """pyproject.toml's one-line description (what PyPI and pip show) stays true to the table."""
    import pathlib
    import re

    from onnx_kvcache.cache.operators import ATTENTION_OPS

    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    description = re.search(r'^description = "(.*)"$', pyproject, re.MULTILINE).group(1)  # no tomllib in 3.10
    assert all(op_type in description for op_type in ATTENTION_OPS), description


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("NotConvertedWarning", "onnx_kvcache.errors"),
        ("CACHE_FORMATS", "onnx_kvcache.cache.formats"),
        ("DecoderConfig", "onnx_kvcache.models.decoder"),
    ],
)
def test_a_name_that_is_not_top_level_says_where_it_lives(name, home):
    said = f"no attribute '{name}'; import it from {home} (from {home} import {name})"
    with pytest.raises(AttributeError, match=re.escape(said)):
        getattr(onnx_kvcache, name)
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_name'$"):
        onnx_kvcache.no_such_name  # noqa: B018


def test_dir_lists_the_public_names_only():
    """dir() listed the module's machinery: annotations, TYPE_CHECKING, _EXPORTS, _MODULE_OF."""
    assert dir(onnx_kvcache) == sorted({*onnx_kvcache.__all__, "__version__"})
    assert not {"annotations", "TYPE_CHECKING", "_EXPORTS", "_MODULE_OF"} & set(dir(onnx_kvcache))


def test_no_0x_module_path_or_name_is_kept():
    """No release had the 0.x layout: its paths and names are gone, not aliased with a warning."""
    for old in ("onnx_kvcache.formats", "onnx_kvcache.model_files", "onnx_kvcache.files.reading"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    assert not any(type(finder).__module__.startswith("onnx_kvcache") for finder in sys.meta_path)
    from onnx_kvcache import cli
    from onnx_kvcache.cache import sites

    assert not hasattr(cli, "main") and not hasattr(sites, "GqaSite")


def test_convert_result_lives_at_its_public_path():
    """Split into private modules, the result class still names its public module (pickles)."""
    import pickle

    from onnx_kvcache.files import conversion

    assert conversion.ConvertResult.__module__ == "onnx_kvcache.files.conversion"
    assert "onnx_kvcache.files.conversion" in pickle.dumps(conversion.ConvertResult).decode("latin-1")
