"""gc_paused: the cyclic collector off inside, its state restored after (errors included)."""

from __future__ import annotations

import contextlib
import gc

import pytest

from onnx_kvcache._gc import gc_paused


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("raises", [False, True])
def test_the_collector_is_off_inside_and_as_it_was_after(enabled, raises):
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(ValueError) if raises else contextlib.nullcontext(), gc_paused():
            assert not gc.isenabled()
            with gc_paused():  # nested: the inner one restores "off"
                pass
            assert not gc.isenabled()
            if raises:
                raise ValueError("stopped")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
