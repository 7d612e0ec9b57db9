"""runtime/_memory.py: what a run will hold, refused past the memory available (issue 37)."""

from __future__ import annotations

import pytest

from onnx_kvcache import KvCacheError
from onnx_kvcache.errors import Param
from onnx_kvcache.runtime import _memory


@pytest.mark.parametrize(
    ("limit", "usage", "room"),
    [("1073741824", "268435456", 3 << 28), ("max", "268435456", None), ("9223372036854771712", "5", None)],
    ids=["limited", "no limit (v2)", "no limit (v1)"],
)
def test_a_containers_limit_lowers_the_memory_available(tmp_path, monkeypatch, limit, usage, room):
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(usage + "\n")
    monkeypatch.setattr(_memory, "_CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    monkeypatch.setattr(_memory, "_machine_memory", lambda: 16 << 30)
    assert _memory.available_memory() == (16 << 30 if room is None else room)


def test_an_estimate_past_the_limit_names_the_figures_and_the_fix():
    estimate = _memory.MemoryEstimate("calibration", (("ids", 3 << 30), ("caches", 1 << 20), ("none", 0)))
    estimate.check(limit=4 << 30)  # fits
    with pytest.raises(KvCacheError) as said:
        estimate.check("Give fewer windows (", Param("num_seqs", placeholder="N"), ").", limit=1 << 30)
    assert str(said.value) == (
        "This calibration would hold about 3.0 GiB of memory (ids: 3.0 GiB; caches: 1.0 MiB), more than "
        "the 1.0 GiB available; nothing was run. Give fewer windows (num_seqs=N)."
    )
