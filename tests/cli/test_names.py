"""cli/_names.py: the parser's choices are the tables' rows (standard library copies)."""

from __future__ import annotations

from onnx_kvcache.cli import _names
from onnx_kvcache.cli.commands import _COMMANDS, build_parser


def test_the_choices_copied_for_the_parser_are_the_tables():
    from onnx_kvcache.cache.rotation import ROTATIONS
    from onnx_kvcache.calibrate.calibration import CALIBRATION_METHODS
    from onnx_kvcache.files.conversion import ASKED_WEIGHTS
    from onnx_kvcache.passes.kv_cache_emulation import SEMANTICS
    from onnx_kvcache.pipeline.storage_decision import STORAGES

    assert tuple(SEMANTICS) == _names.SEMANTICS
    assert tuple(ASKED_WEIGHTS) == _names.WEIGHTS
    assert tuple(CALIBRATION_METHODS) == _names.METHODS
    assert tuple(ROTATIONS) == _names.ROTATIONS
    assert STORAGES == _names.STORAGES


def test_every_choice_of_the_parser_is_a_named_table():
    """No option hard-codes its choices: each list is one of _names' tables."""
    tables = {
        tuple(t)
        for t in (
            _names.FORMATS,
            _names.GRANULARITIES,
            _names.METHODS,
            _names.SEMANTICS,
            _names.WEIGHTS,
            _names.PROVIDERS,
            _names.ROTATIONS,
            _names.STORAGES,
        )
    }
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.choices is not None:
                assert tuple(action.choices) in tables, (name, action.dest)


def test_each_command_row_is_a_subcommand_in_order():
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    assert list(sub.choices) == [c.name for c in _COMMANDS]
