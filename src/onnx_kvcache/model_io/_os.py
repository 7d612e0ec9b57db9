"""The operating system's calls the output writers need where Python has no portable name.

Open flags that are 0 where the platform lacks them, ``fcntl`` (None on Windows: no ``flock``),
and the C library (None where it cannot be loaded) for ``renameat2``/``renamex_np`` (one rename
that never replaces, or swaps) and macOS's ``clonefile``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock, so no stale-entry sweeping either
    fcntl = None  # type: ignore[assignment]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _libc() -> Any:
    if sys.platform not in ("linux", "darwin"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
