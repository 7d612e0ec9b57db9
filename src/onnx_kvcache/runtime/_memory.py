"""What a calibration or evaluation will hold in memory, estimated before it runs.

Rules:

* Each entry point adds up the parts that grow with its arguments (:class:`MemoryEstimate`):
  random token ids generated for ``num_seqs`` windows of ``seq_len``; one run's caches, the
  attention scores onnxruntime's CPU GroupQueryAttention allocates (``batch * num_heads *
  length * length`` float32: one layer at a time) and its logits; what is kept per window
  (evaluation's scores, ``attention_search``'s samples). Sizes are what the arrays take, so the
  estimate is a floor of what the process holds, not a ceiling.
* An estimate above the memory available now (``MemAvailable`` of ``/proc/meminfo``, else the
  physical memory; under a container's cgroup limit, the room left below it; none known: no
  check) is refused before anything is allocated, with the
  figure, its largest parts and the limit, and the arguments that lower it.
"""

from __future__ import annotations

__all__ = [
    "FEWER_WINDOWS",
    "UNKNOWN_VOCABULARY",
    "WINDOW_BYTES",
    "MemoryEstimate",
    "available_memory",
    "run_parts",
]

import dataclasses
import math
import os

from onnx_kvcache.errors import KvCacheError, Message, Param
from onnx_kvcache.model_io import format_bytes
from onnx_kvcache.runtime.runner import KvCacheRunner

#: Bytes of a float32 value: the CPU computes caches, scores and logits in float32.
_FLOAT = 4

#: The vocabulary a run's logits are counted with when the graph's is symbolic.
UNKNOWN_VOCABULARY = 262144

#: Bytes each window's numpy array takes beyond its data (the object, its list entry).
WINDOW_BYTES = 120

#: What lowers a run's memory, said when it is refused (the start of the fix).
FEWER_WINDOWS = (
    "Give fewer or shorter windows (",
    Param("num_seqs", placeholder="N"),
    ", ",
    Param("seq_len", placeholder="N"),
    ")",
)


#: A container's memory limit and use (cgroup v2, else v1): the room left under the limit.
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # "max": no limit
        return None


def _machine_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (the machine's ``MemAvailable``, else
    its physical memory; less under a container's limit), or None when unknown."""
    found = [_machine_memory()]
    for limit_file, usage_file in _CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:
            found.append(max(limit - usage, 0))
            break
    known = [n for n in found if n is not None]
    return min(known) if known else None


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The bytes a run will hold, part by part."""

    what: str
    """The run, as its refusal names it (``calibration``, ``evaluation``)."""
    parts: tuple[tuple[str, int], ...]
    """(what holds it, bytes), in the run's words."""

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    def check(self, *fix: object, limit: int | None = None) -> None:
        """Refuse the run when it would hold more than ``limit`` (default: the memory available
        now); ``fix`` says which arguments lower it (the parts of a :class:`Message`)."""
        limit = available_memory() if limit is None else limit
        if limit is None or self.total <= limit:
            return
        largest = sorted((p for p in self.parts if p[1]), key=lambda p: -p[1])[:3]
        shown = "; ".join(f"{name}: {format_bytes(size)}" for name, size in largest)
        raise KvCacheError(
            Message(
                f"This {self.what} would hold about {format_bytes(self.total)} of memory ({shown}), more "
                f"than the {format_bytes(limit)} available; nothing was run. ",
                *fix,
            )
        )


def run_parts(
    runner: KvCacheRunner, batch: int, length: int, *, queries: int, logits: int
) -> list[tuple[str, int]]:
    """One run of ``batch`` windows of ``queries`` new tokens over ``length`` in all: its caches
    (the present outputs and the copies read back), the CPU GroupQueryAttention's scores (``batch *
    num_heads * queries * length`` float32, one layer at a time), its logits of ``logits`` tokens
    a window (a vocabulary not known from the graph: counted as :data:`UNKNOWN_VOCABULARY`).
    The one estimate of a run's memory: calibration's and evaluation's refusals, and the size of
    evaluation's batches (runtime/_scoring.py), come from it."""
    caches = math.ceil(
        sum(
            batch * b.kv_num_heads * length * b.feed_last_dim * (b.feed_dtype or b.dtype).itemsize
            for b in runner.bindings
        )
    )  # an int4 element is half a byte
    heads = max((s.num_heads for s in runner.sites), default=0)
    scores = batch * heads * queries * length * _FLOAT
    parts = [
        (f"{batch} x {length} tokens' caches", 2 * caches),
        (f"attention scores of {batch} x {heads} heads x {queries} x {length} tokens", scores),
    ]
    if logits:
        vocab = runner.vocab_size or UNKNOWN_VOCABULARY
        parts.append((f"{batch} x {logits} tokens' logits", batch * logits * vocab * _FLOAT))
    return parts
