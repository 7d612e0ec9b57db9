"""A folder's public names, each imported from its private module on first use (PEP 562).

``model_io``, ``runtime`` and ``files`` hand other folders their names through a table
``{private module: (names, ...)}``; :func:`lazy_getattr` makes the folder's ``__getattr__`` from it.
A name is read from its module at each use, never copied into the folder, so
``monkeypatch.setattr(<private module>, name, ...)`` reaches every caller that says
``folder.name``. Standard library only; ``importlib`` is imported at the first lookup.
"""

from __future__ import annotations

__all__ = ["lazy_getattr"]

TYPE_CHECKING = False  # typing is not imported: importing a folder stays cheap
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, tuple[str, ...]]) -> Callable[[str], object]:
    """The ``__getattr__`` of ``package`` for its table of ``{module: names}``."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(module), name)

    return __getattr__
