"""Safe output files: modes, locks, stale cleanup, journals, clone-or-copy, signals."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io._atomic import TEMP_PREFIX

MiB = 2**20


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            h.update(block)
    return h.hexdigest()


def sparse_file(path: pathlib.Path, size=64 * MiB, extents=((10 * MiB, MiB), (40 * MiB, 3 * MiB))):
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, length in extents:
            f.seek(offset)
            f.write(rng.integers(0, 256, length, dtype=np.uint8).tobytes())
    return path


def filesystem_clones(folder: pathlib.Path) -> bool:
    """Probe FICLONE directly, independently of the code under test."""
    if sys.platform != "linux":
        return False
    import fcntl

    a, b = folder / "probe-a", folder / "probe-b"
    a.write_bytes(b"x" * 4096)
    try:
        with open(a, "rb") as src, open(b, "wb") as dst:
            fcntl.ioctl(dst.fileno(), 0x40049409, src.fileno())
        return True
    except OSError:
        return False
    finally:
        a.unlink()
        b.unlink(missing_ok=True)


def clone_dirs(tmp_path) -> list[pathlib.Path]:
    """tmp_path, and folders on cloning filesystems named in ONNX_KVCACHE_TEST_CLONE_DIRS."""
    extra = [pathlib.Path(p) for p in os.environ.get("ONNX_KVCACHE_TEST_CLONE_DIRS", "").split(":") if p]
    return [tmp_path, *extra]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (2048, "2.0 KiB"),
        (int(2.3 * 2**30), "2.3 GiB"),
        (131 * 2**30, "131 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert file_io.format_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "unit", "text"),
    [
        (0, "MiB", "0.0 MiB"),
        (2**19, "MiB", "0.5 MiB"),
        (3 * 2**30, "MiB", "3072.0 MiB"),
        (2**30, "GiB", "1.0 GiB"),
    ],
)
def test_format_bytes_in_one_unit(n, unit, text):
    """A fixed unit keeps its one decimal whatever the size (figures a line compares)."""
    assert file_io.format_bytes(n, unit) == text


@pytest.mark.parametrize("plain", [False, True])
def test_copy_keeps_holes_and_bytes(tmp_path, monkeypatch, plain):
    if plain:
        monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
    src = sparse_file(tmp_path / "src.bin")
    stats = file_io.copy_file(src, tmp_path / "dst.bin")
    dst = tmp_path / "dst.bin"
    assert digest(src) == digest(dst) and dst.stat().st_size == 64 * MiB
    assert file_io.allocated_bytes(dst) <= file_io.allocated_bytes(src) + MiB  # holes kept
    if stats.cloned:
        assert stats.written == 0 and not plain
    else:
        assert stats.written == 4 * MiB


def test_copy_without_copy_file_range_reads_and_writes(tmp_path, monkeypatch):
    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", unsupported, raising=False)
    monkeypatch.setattr(file_io, "clone_file", lambda src, dst: False)
    src = sparse_file(tmp_path / "src.bin", size=8 * MiB, extents=((MiB, 2 * MiB),))
    assert file_io.copy_file(src, tmp_path / "dst.bin").written == 2 * MiB
    assert digest(src) == digest(tmp_path / "dst.bin")


def test_copy_of_a_file_without_holes_and_an_empty_file(tmp_path):
    src = tmp_path / "dense.bin"
    src.write_bytes(os.urandom(3 * MiB + 5))
    (tmp_path / "empty.bin").write_bytes(b"")
    assert file_io.copy_data(src, tmp_path / "d1") == 3 * MiB + 5
    assert file_io.copy_data(tmp_path / "empty.bin", tmp_path / "d2") == 0
    assert (tmp_path / "d1").read_bytes() == src.read_bytes() and (tmp_path / "d2").read_bytes() == b""


def test_clone_exactly_where_the_filesystem_clones(tmp_path, monkeypatch):
    for folder in clone_dirs(tmp_path):
        work = folder / f"clone-test-{os.getpid()}"
        work.mkdir()
        try:
            src = sparse_file(work / "src.bin")
            expected = filesystem_clones(work)
            assert file_io.clone_file(src, work / "dst.bin") == expected
            assert (work / "dst.bin").exists() == expected
            stats = file_io.copy_file(src, work / "dst2.bin")
            assert stats.cloned == expected and (stats.written == 0) == expected
            assert digest(work / "dst2.bin") == digest(src)
            monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
            assert not file_io.clone_file(src, work / "dst3.bin") and not (work / "dst3.bin").exists()
            monkeypatch.delenv(file_io.PLAIN_COPY_ENV)
        finally:
            for p in work.iterdir():
                p.unlink()
            work.rmdir()


def test_new_files_and_folders_follow_the_umask(tmp_path):
    for mask, file_mode, dir_mode in [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)]:
        old = os.umask(mask)
        try:
            target = tmp_path / f"m{mask:o}" / "deep" / "out.json"
            file_io.atomic_write_text(target, "{}")
            assert stat.S_IMODE(target.stat().st_mode) == file_mode
            assert stat.S_IMODE(target.parent.stat().st_mode) == dir_mode
            with file_io.TempDir(tmp_path) as d:
                assert stat.S_IMODE(d.path.stat().st_mode) == dir_mode
                file_io.write_new_file(d.path / "x", b"1")
                assert stat.S_IMODE((d.path / "x").stat().st_mode) == file_mode
                file_io.copy_file(target, d.path / "y")
                assert stat.S_IMODE((d.path / "y").stat().st_mode) == file_mode
        finally:
            os.umask(old)


def test_replacing_like_an_existing_file_keeps_its_mode_and_owner(tmp_path, umask022):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    if os.geteuid() == 0:
        os.chown(target, 1234, 5678)
    before = target.stat()
    file_io.atomic_write_bytes(target, b"new", like=before)
    after = target.stat()
    assert target.read_bytes() == b"new" and after.st_ino != before.st_ino
    assert (stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid) == (0o640, before.st_uid, before.st_gid)


def test_a_failed_write_removes_its_temporary_file_and_created_folders(tmp_path, monkeypatch):
    real_replace = os.replace

    def full(a, b):
        raise OSError(errno.ENOSPC, "No space left on device", str(b))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        file_io.atomic_write_bytes(tmp_path / "a" / "b" / "c.json", b"{}")
    monkeypatch.setattr(os, "replace", real_replace)
    assert list(tmp_path.iterdir()) == []


def test_rename_noreplace_never_replaces(tmp_path, monkeypatch):
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(file_io, "_renameat2", lambda *a: False)
        a, b = tmp_path / f"a{fallback}", tmp_path / f"b{fallback}"
        a.write_text("a")
        b.write_text("b")
        with pytest.raises(FileExistsError):
            file_io.rename_noreplace(a, b)
        assert a.read_text() == "a" and b.read_text() == "b"
        c = tmp_path / f"c{fallback}"
        file_io.rename_noreplace(a, c)
        assert c.read_text() == "a" and not a.exists() and c.stat().st_nlink == 1
        d, e = tmp_path / f"d{fallback}", tmp_path / f"e{fallback}"
        d.mkdir()
        e.mkdir()
        with pytest.raises(FileExistsError):
            file_io.rename_noreplace(d, e)


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_rename_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    assert file_io.rename_exchange(a, b)
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_folder_replacement_swaps_atomically_and_removes_the_old_one(tmp_path, monkeypatch):
    for exchange in (True, False):
        if not exchange:
            monkeypatch.setattr(file_io, "rename_exchange", lambda a, b: False)
        out = tmp_path / f"out{exchange}"
        out.mkdir()
        (out / "old").write_text("old")
        with file_io.TempDir(tmp_path) as d:
            (d.path / "new").write_text("new")
            d.publish(out, replace=True)
        assert [p.name for p in out.iterdir()] == ["new"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]


class DurabilityLog:
    """Every ``os.fsync`` (the synced file's size and mtime) and every rename that publishes.

    At each rename, what is renamed (a file, or a folder with everything in it) must have
    been fsynced in the state it is in: synced, and not written since.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: dict[tuple[int, int], tuple[int, int]] = {}
        self.checked: set[tuple[int, int]] = set()
        self.unsynced: list[str] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            real_fsync(fd)
            st = os.fstat(fd)
            self.synced[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns)

        monkeypatch.setattr(file_io.os, "fsync", fsync)
        for owner, name in [
            (file_io, "rename_noreplace"),
            (file_io, "rename_exchange"),
            (file_io.os, "rename"),
            (file_io.os, "replace"),
        ]:
            monkeypatch.setattr(owner, name, self._publishing(getattr(owner, name)))

    def _publishing(self, rename):  # type: ignore[no-untyped-def]
        def wrapper(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
            self._check(pathlib.Path(src), pathlib.Path(dst))
            return rename(src, dst, *args, **kwargs)

        return wrapper

    def _check(self, src: pathlib.Path, dst: pathlib.Path) -> None:
        entries = [src]
        if src.is_dir() and not src.is_symlink():
            entries += [pathlib.Path(d) / n for d, dirs, files in os.walk(src) for n in dirs + files]
        for path in entries:
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                continue
            key = (st.st_dev, st.st_ino)
            self.checked.add(key)
            if self.synced.get(key) != (st.st_size, st.st_mtime_ns):
                self.unsynced.append(f"{path.name} (published as {dst})")

    def assert_published_synced(self, *paths: pathlib.Path) -> None:
        """``paths`` (as they are now) were published by a checked rename, each synced first."""
        assert not self.unsynced, self.unsynced
        for path in paths:
            st = os.lstat(path)
            assert (st.st_dev, st.st_ino) in self.checked, f"{path} was not published by a rename"


def _model_file(folder: pathlib.Path) -> pathlib.Path:
    import onnx_ir as ir

    from onnx_kvcache.models.decoder import build_decoder

    folder.mkdir(parents=True, exist_ok=True)
    ir.save(
        build_decoder(num_layers=2, vocab_size=300), folder / "model.onnx", external_data="model.onnx.data"
    )
    return folder / "model.onnx"


def _genai_folder(folder: pathlib.Path, share_buffer: bool = False) -> pathlib.Path:
    from onnx_kvcache.models.decoder import save_genai_folder

    save_genai_folder(folder, num_layers=2, vocab_size=300)
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["past_present_share_buffer"] = share_buffer  # False: in place changes it too
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def _convert(src: pathlib.Path, out: pathlib.Path | None = None, **kwargs):  # type: ignore[no-untyped-def]
    """A conversion of ``src``, to run later (the input is made before the log starts)."""
    from onnx_kvcache import convert_model

    scales = {0: (0.05, 0.04), 1: (0.06, 0.05)}
    return lambda: convert_model(src, out, format="int8", scales=scales, progress=False, **kwargs)


def _into_empty_folder(t: pathlib.Path):  # type: ignore[no-untyped-def]
    (t / "out").mkdir()
    return _convert(_genai_folder(t / "in"), t / "out")


DURABLE_WRITES = {
    # name: tmp -> (the write, its input made; the files it must have published synced)
    "copy: file into another folder": lambda t: (
        _convert(_model_file(t / "in"), t / "out" / "m.onnx"),
        [t / "out" / "m.onnx.data", t / "out" / "m.onnx"],
    ),
    "copy: file beside, own data": lambda t: (
        _convert(_model_file(t / "in"), t / "in" / "m.onnx", weights="copy"),
        [t / "in" / "m.onnx.data", t / "in" / "m.onnx"],
    ),
    "copy: folder into another folder": lambda t: (
        _convert(_genai_folder(t / "in"), t / "out"),
        [t / "out" / "model.onnx.data", t / "out" / "model.onnx", t / "out" / "tokenizer.json", t / "out"],
    ),
    "copy: folder into an empty folder": lambda t: (
        _into_empty_folder(t),
        [t / "out" / "model.onnx.data", t / "out" / "model.onnx", t / "out" / "genai_config.json"],
    ),
    "atomic write: in place, file": lambda t: (
        _convert(_model_file(t / "in"), in_place=True),
        [t / "in" / "model.onnx"],
    ),
    "atomic write: in place, folder and config": lambda t: (
        _convert(_genai_folder(t / "in"), in_place=True),
        [t / "in" / "model.int8.onnx", t / "in" / "genai_config.json"],
    ),
    "atomic write: a scale file": lambda t: (
        lambda: file_io.atomic_write_text(t / "scales" / "s.json", "{}"),
        [t / "scales" / "s.json"],
    ),
}


COPY_WAYS = ((True, "read-write"), (False, "clone or copy_file_range"))


@pytest.mark.parametrize(
    ("case", "plain"),
    [
        *(
            pytest.param(c, p, id=f"{c} ({how})")
            for c in DURABLE_WRITES
            if c.startswith("copy")
            for p, how in COPY_WAYS
        ),
        *(pytest.param(c, False, id=c) for c in DURABLE_WRITES if not c.startswith("copy")),
    ],
)
def test_data_is_fsynced_before_the_rename_that_publishes_it(tmp_path, monkeypatch, case, plain):
    if plain:
        monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
    write, published = DURABLE_WRITES[case](tmp_path)
    log = DurabilityLog(monkeypatch)
    write()
    log.assert_published_synced(*published)


def test_the_durability_log_catches_data_renamed_unsynced(tmp_path, monkeypatch):
    """The check above can fail: never synced, or written after its fsync."""
    log = DurabilityLog(monkeypatch)
    (tmp_path / "a").write_bytes(b"weights")
    file_io.rename_noreplace(tmp_path / "a", tmp_path / "a.data")
    with open(tmp_path / "b", "wb") as f:
        f.write(b"weights")
        f.flush()
        os.fsync(f.fileno())
        time.sleep(0.01)
        f.write(b" and more")
    os.replace(tmp_path / "b", tmp_path / "b.data")
    assert log.unsynced == [
        f"a (published as {tmp_path}/a.data)",
        f"b (published as {tmp_path}/b.data)",
    ]


def test_sweep_removes_only_our_entries_that_no_process_owns(tmp_path):
    stale_file = tmp_path / f"{TEMP_PREFIX}1-dead"
    stale_file.write_bytes(b"x" * 100)
    stale_dir = tmp_path / f"{TEMP_PREFIX}2-dead"
    (stale_dir / "sub").mkdir(parents=True)
    (stale_dir / "sub" / "weights.data").write_bytes(b"w")
    (tmp_path / "user.onnx").write_bytes(b"mine")
    (tmp_path / ".model.onnx.abc.tmp").write_bytes(b"not ours")
    (tmp_path / f"{TEMP_PREFIX}link").symlink_to(tmp_path / "user.onnx")
    live = file_io.TempFile(tmp_path)
    live_dir = file_io.TempDir(tmp_path)
    try:
        removed = file_io.sweep_stale(tmp_path)
        assert sorted(removed) == sorted([stale_file.name, stale_dir.name])
        assert live.path.exists() and live_dir.path.exists()
        assert (tmp_path / "user.onnx").read_bytes() == b"mine" and (
            tmp_path / ".model.onnx.abc.tmp"
        ).exists()
        assert (tmp_path / f"{TEMP_PREFIX}link").is_symlink()
    finally:
        live.close()
        live_dir.close()
    assert not live.path.exists() and not live_dir.path.exists()


def test_sweep_leaves_entries_of_a_live_process_alone_until_it_dies(tmp_path):
    code = (
        "import sys, pathlib; from onnx_kvcache.model_io import _atomic as file_io; "
        f"t = file_io.TempDir({str(tmp_path)!r}); print(t.path.name, flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    name = child.stdout.readline().strip()
    try:
        assert name.startswith(TEMP_PREFIX)
        assert file_io.sweep_stale(tmp_path) == [] and (tmp_path / name).is_dir()
    finally:
        child.kill()
        child.wait()
    assert file_io.sweep_stale(tmp_path) == [name] and not (tmp_path / name).exists()


def _journaled_folder(tmp_path):
    """A genai-like folder: config naming old.onnx; staged new.onnx and a new config."""
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "genai_config.json").write_text('{"filename": "old.onnx"}')
    (folder / "old.onnx").write_bytes(b"old graph")
    (folder / "data").write_bytes(b"weights")
    return folder


def _state(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(TEMP_PREFIX)}


OLD = {"genai_config.json": b'{"filename": "old.onnx"}', "old.onnx": b"old graph", "data": b"weights"}
NEW = {"genai_config.json": b'{"filename": "new.onnx"}', "new.onnx": b"new graph", "data": b"weights"}


def _publish(folder):
    with file_io.TempDir(folder) as tmp:
        file_io.write_new_file(tmp.path / "graph", b"new graph")
        file_io.write_new_file(tmp.path / "config", b'{"filename": "new.onnx"}')
        file_io.publish_as_one(
            folder,
            [(tmp.path / "graph", folder / "new.onnx", False)],
            tmp.path / "config",
            folder / "genai_config.json",
            replace=True,
            remove_after=[folder / "old.onnx"],
        )


def _killed_after_fsyncs(crash_at, work):
    """Run ``work`` in a child killed (os._exit, no cleanup) after ``crash_at`` folder fsyncs,
    each a durable step; the child's wait status."""
    pid = os.fork()
    if pid == 0:  # the writer
        calls = [0]
        real = file_io.fsync_dir

        def crash_after(path):
            real(path)
            calls[0] += 1
            if calls[0] > crash_at:
                os._exit(9)

        file_io.fsync_dir = crash_after
        try:
            work()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to kill a writer mid-way")
@pytest.mark.parametrize("crash_at", range(7))
def test_a_run_killed_between_renames_is_settled_by_the_next_sweep(tmp_path, crash_at):
    """Kill (os._exit, no cleanup) after each durable step; the sweep leaves old or new, never a mix."""
    folder = _journaled_folder(tmp_path)
    status = _killed_after_fsyncs(crash_at, lambda: _publish(folder))
    before = _state(folder)
    if crash_at in (1, 2):  # between the renames: the mix a sweep must settle
        assert before not in (OLD, NEW)
    file_io.sweep_stale(folder)
    state = _state(folder)
    assert state in (OLD, NEW), (os.waitstatus_to_exitcode(status), state)
    assert not [n for n in os.listdir(folder) if n.startswith(TEMP_PREFIX)]


def test_a_journal_is_not_replayed_when_the_folder_changed_since(tmp_path):
    folder = _journaled_folder(tmp_path)
    journal = folder / f"{TEMP_PREFIX}9-x.journal"
    new = folder / "new.onnx"
    new.write_bytes(b"new graph")
    doc = {
        "created": [["new.onnx", list(file_io.file_identity(new))]],
        "commit": [
            "genai_config.json",
            [0, 0, 0, 0],
            list(file_io.file_identity(folder / "genai_config.json")),
        ],
        "remove_after": [["old.onnx", list(file_io.file_identity(folder / "old.onnx"))]],
    }
    journal.write_text(json.dumps(doc))
    (folder / "genai_config.json").write_text('{"filename": "edited by hand"}')
    file_io.sweep_stale(folder)
    assert new.exists() and (folder / "old.onnx").exists() and not journal.exists()
    journal.write_text("{partial")
    assert file_io.sweep_stale(folder) == [journal.name] and new.exists()


def test_a_failing_commit_undoes_what_it_published(tmp_path, monkeypatch):
    folder = _journaled_folder(tmp_path)

    def full(a, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        _publish(folder)
    assert _state(folder) == OLD


def _fill_killed_at(folder, crash_at):
    """Fill the empty ``folder`` as a genai folder, in a child killed after ``crash_at`` fsyncs."""

    def fill():
        with file_io.TempDir(folder) as tmp:
            (tmp.path / "weights").mkdir()
            file_io.write_new_file(tmp.path / "weights" / "model.onnx.data", b"weights")
            file_io.write_new_file(tmp.path / "model.onnx", b"graph")
            file_io.write_new_file(tmp.path / "genai_config.json", b"{}")
            file_io.publish_into_empty(tmp, folder, pathlib.PurePosixPath("genai_config.json"))

    _killed_after_fsyncs(crash_at, fill)


def _tree(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
        for p in folder.rglob("*")
        if not p.relative_to(folder).parts[0].startswith(TEMP_PREFIX)
    }


FILLED = {
    "genai_config.json": b"{}",
    "model.onnx": b"graph",
    "weights": None,
    "weights/model.onnx.data": b"weights",
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to kill a writer mid-way")
@pytest.mark.parametrize("crash_at", range(7))
def test_a_fill_killed_at_any_step_leaves_the_folder_empty_or_complete_after_the_sweep(tmp_path, crash_at):
    folder = tmp_path / "out"
    folder.mkdir()
    _fill_killed_at(folder, crash_at)
    if crash_at in (2, 3):  # between the renames: files without genai_config.json, the commit
        assert "model.onnx" in _tree(folder) and "genai_config.json" not in _tree(folder)
    file_io.sweep_stale(folder)
    assert _tree(folder) in ({}, FILLED) and not [n for n in os.listdir(folder) if n.startswith(TEMP_PREFIX)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to kill a writer mid-way")
def test_undoing_a_killed_fill_keeps_what_others_put_in_its_folders(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    _fill_killed_at(folder, 2)
    (folder / "weights" / "theirs.txt").write_text("theirs")
    file_io.sweep_stale(folder)
    assert _tree(folder) == {"weights": None, "weights/theirs.txt": b"theirs"}


def test_sigterm_and_sighup_raise_interrupted_like_ctrl_c():
    previous = signal.getsignal(signal.SIGTERM)
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)):
        with pytest.raises(file_io.Interrupted) as info, file_io.signal_handlers():
            os.kill(os.getpid(), signum)
            time.sleep(1)
        assert info.value.exit_code == code and not info.value.completed
        assert isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_signal_during_a_commit_waits_for_it():
    done = []
    with (
        pytest.raises(file_io.Interrupted) as info,
        file_io.signal_handlers(),
        file_io.uninterrupted(completes=True),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        done.append(True)
    assert done and info.value.completed


@pytest.mark.parametrize("entry", [file_io.TempFile, file_io.TempDir])
def test_a_signal_while_a_temporary_entry_is_created_leaves_nothing(tmp_path, monkeypatch, entry):
    """The signal is held until the entry is ours, then raised, and the entry removed."""
    from onnx_kvcache._signals import signal_handlers

    real_lock = file_io._lock

    def lock_then_signal(fd):
        real_lock(fd)
        # delivered while creating; to this thread, as a process-directed kill may go to an
        # onnxruntime pool thread (earlier tests' sessions) and come only after the entry
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    monkeypatch.setattr(file_io, "_lock", lock_then_signal)
    with signal_handlers(), pytest.raises(file_io.Interrupted):
        entry(tmp_path)
    assert os.listdir(tmp_path) == [] and not file_io._LIVE


def test_entries_a_signal_left_open_are_closed_at_exit(tmp_path):
    """A signal between creating an entry and entering the block that closes it."""
    kept = file_io.TempFile(tmp_path)
    kept.write(b"x")
    published = file_io.TempFile(tmp_path)
    published.publish(tmp_path / "out")
    left = file_io.TempDir(tmp_path)
    file_io.close_temporary_entries()
    assert os.listdir(tmp_path) == ["out"] and not file_io._LIVE
    assert kept.fd == left.fd == -1


def test_an_entry_that_cannot_be_locked_is_removed(tmp_path, monkeypatch):
    def refuse(fd):
        raise OSError(errno.ENOLCK, "no locks here")

    monkeypatch.setattr(file_io, "_lock", refuse)
    with pytest.raises(OSError, match="no locks here"):
        file_io.TempFile(tmp_path)
    assert os.listdir(tmp_path) == [] and not file_io._LIVE
