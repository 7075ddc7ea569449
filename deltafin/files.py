"""Low-level file access shared by the readers and writers: where a file named by data may be,
how it is opened, cached descriptors, exact preads, and the directory fsync that makes a rename
durable.

The confinement rule: a path that comes from a data file (a safetensors index, a store manifest)
is resolved, symlinks included, and must land inside the model folder; anything else is refused
by name. A folder inside a Hugging Face hub cache snapshot (``models--org--name/snapshots/REV``)
may reach the whole ``models--org--name`` folder, because the hub links every snapshot file to
``../../blobs``. Only regular files are opened: a FIFO or a device would block or never end.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import threading
from pathlib import Path

from .errors import DeltafinError

MAX_JSON_BYTES = 256 << 20  # a config, index or manifest larger than this is not one deltafin wrote or reads


class CheckpointError(DeltafinError):
    """The checkpoint is incomplete, corrupt, or does not match its config."""


def confinement_root(folder: str | Path) -> Path:
    """The folder that paths named by the data files of `folder` must stay inside (resolved)."""
    real = Path(os.path.realpath(folder))
    parts = real.parts
    for k in range(len(parts) - 2, 0, -1):  # .../models--org--name/snapshots/REV[/sub]
        if parts[k] == "snapshots" and parts[k - 1].startswith(("models--", "datasets--", "spaces--")):
            return Path(*parts[:k])
    return real


def confine(folder: str | Path, rel, where: str, root: Path | None = None) -> Path:
    """`folder / rel` for a path `rel` read from a data file, or a CheckpointError naming it.

    `where` names the data file (and field) the path came from; `root` is
    ``confinement_root(folder)`` when the caller already has it."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise CheckpointError(f"{where}: file name {rel!r} is not a relative path")
    if os.path.isabs(rel):
        raise CheckpointError(f"{where}: file name {rel!r} is absolute; only paths inside the model folder "
                              f"{folder} are allowed")
    root = confinement_root(folder) if root is None else root
    path = Path(folder) / rel
    real = os.path.realpath(path)
    if os.path.commonpath([real, str(root)]) != str(root):
        raise CheckpointError(f"{where}: file name {rel!r} points outside the model folder {folder}")
    return path


def open_regular(file: str | Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of `file`, which must be a regular file (a FIFO or device is refused, never waited on)."""
    try:
        fd = os.open(file, flags | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    except OSError as e:
        raise CheckpointError(f"{file}: cannot open ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{file}: not a regular file ({_kind(mode)}); deltafin reads only plain files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def regular_size(file: str | Path) -> int:
    """Size of `file` after checking (without opening it) that it is a regular file."""
    try:
        st = os.stat(file)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{file}: not a regular file ({_kind(st.st_mode)}); deltafin reads only plain files")
    return st.st_size


def read_json(file: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in a regular file of at most `max_bytes`, or a CheckpointError naming the file."""
    fd = open_regular(file)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CheckpointError(f"{file}: {size} bytes is too large for {what} (at most {max_bytes})")
        raw = pread_exact(fd, size, 0, str(file))
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: {what} is not valid JSON ({e})") from None


class FileHandles:
    """Descriptors opened on first use, one per (file, flags), shared by reader threads."""

    def __init__(self):
        self._fds: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def get(self, file: str, flags: int = os.O_RDONLY) -> int:
        key = (file, flags)
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:  # threads may ask for the same file at once
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._fds[key] = open_regular(file, flags)
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):  # a reader dropped without close() still gives its descriptors back
        try:
            self.close()
        except Exception:
            pass


def pread_into(fd: int, view: memoryview, offset: int, need: int, file: str) -> None:
    """Fill view[:need] from the file at offset (view may extend past need; EOF beyond it is fine)."""
    got = 0
    while got < need:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"{file}: unexpected end of file at byte {offset + got}")
        got += n


def pread_exact(fd: int, nbytes: int, offset: int, file: str) -> bytearray:
    buf = bytearray(nbytes)
    pread_into(fd, memoryview(buf), offset, nbytes, file)
    return buf


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def writer_lock(target: str | Path, what: str, wait: bool = False, on_wait=None):
    """Hold the lock of `target` (a folder being written) while the block runs.

    The lock is ``fcntl.flock`` on a hidden file beside the folder (``.NAME.deltafin-lock``; beside,
    so the folder itself holds only what is written into it), named after the folder's resolved
    path so every spelling of it shares one lock. The system drops the lock when its holder exits,
    however it exits. Taken: without `wait`, a CheckpointError naming the holder (its pid and
    command, which it writes into the lock file); with `wait`, ``on_wait(holder)`` is called once
    and the lock is waited for."""
    real = Path(os.path.realpath(target))
    lock = real.parent / f".{real.name}.deltafin-lock"
    real.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                raise CheckpointError(f"{target}: {what} is already in progress ({holder}); wait for it to "
                                      "finish, or stop it, then run this again") from None
            if on_wait is not None:
                on_wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
