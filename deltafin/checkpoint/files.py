"""Low-level file access shared by the readers and writers: cached descriptors, exact preads,
and the directory fsync that makes a rename durable."""
from __future__ import annotations

import os
import threading
from pathlib import Path


class CheckpointError(ValueError):
    """The checkpoint is incomplete, corrupt, or does not match its config."""


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
                    try:
                        fd = self._fds[key] = os.open(file, flags)
                    except OSError as e:
                        raise CheckpointError(f"{file}: cannot open ({e.strerror})") from None
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
