"""``StrEnum`` on every supported Python: members are their values (``Placement.BESIDE == "beside"``)."""

from __future__ import annotations

__all__ = ["StrEnum"]

import enum
import sys

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """A str-valued enum that prints and formats as its value (Python 3.11's ``enum.StrEnum``)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)
