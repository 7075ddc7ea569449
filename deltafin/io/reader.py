"""Reading byte ranges of checkpoint files into reused, page-aligned buffers, in parallel.

Three pieces, used by the streaming provider and by ``deltafin bench``:

- ``Layout``: a group of tensors (one layer's spine, one expert) as a few contiguous *runs*
  (tensors adjacent in one file are merged, so a group is one pread per file region) and where
  each run and tensor lands in a buffer. Runs start at their file offset modulo the page size
  past a page boundary, so O_DIRECT can read whole pages and tensor views keep the alignment
  they have in the file. ``spine_layout`` / ``expert_layout`` / ``globals_layout``: a source's
  group, read as the one extent the source knows for it where it knows one (a converted store).
- ``Files``: how bytes get from a file into a buffer, by read mode: ``buffered`` (pread through
  the page cache), ``nocache`` (O_DIRECT where the filesystem allows it, else pread followed by
  ``POSIX_FADV_DONTNEED`` on the range), ``mmap`` (the file mapped once, copied from the map).
- ``ReadPool``: a persistent pool of worker threads taking read jobs from one priority queue;
  a ``Batch`` completes when all its jobs did. ``os.preadv`` and numpy copies release the GIL,
  so the workers read truly in parallel while the compute thread runs.
"""
from __future__ import annotations

import errno
import itertools
import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..files import CheckpointError, FileHandles, pread_into
from ..checkpoint.hf import DTYPES, TensorInfo

ALIGN = 4096  # page size and the O_DIRECT alignment of offsets, lengths and buffer addresses
READ_MODES = ("buffered", "nocache", "mmap")
# Queue priorities: experts are on the critical path of the layer computing now; the next
# layer's spine is needed only after that. A prefetch (io.prefetch: the likely experts of the layer
# about to compute) queues with the read-ahead, in order: it is asked for before the next spine,
# which is needed later; every demand read overtakes it. (Below the read-ahead, a prefetch rarely
# finished in time on a busy disk: 5% of its bytes were used on a skewed small-k3, against 41%.)
URGENT, AHEAD = 0, 1
PREFETCH = AHEAD
SPINE_CHUNK = 8 << 20  # spine runs are split so several workers read one layer in parallel
# Expert reads (demand and prefetch) go in pieces of this size, so a layer's few missing experts
# keep every worker busy (one whole-expert pread per worker left most of them idle: in a 3 GiB
# cgroup, kl_medium int8 spine with the cache, 1 MiB pieces reached 0.66 of the disk limit against
# 0.38-0.42 unsplit and 0.42 with 2 MiB), and a cancelled prefetch holds a worker only briefly.
EXPERT_CHUNK = 1 << 20


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Run:
    """One contiguous byte range of one file, read with one pread."""
    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    runs: tuple[Run, ...]
    starts: tuple[int, ...]  # buffer offset of each run's first byte
    tensors: tuple[tuple[str, TensorInfo, int], ...]  # (key, info, buffer offset)
    size: int  # buffer bytes the group needs (a page multiple)

    @property
    def nbytes(self) -> int:
        """Bytes read from the file(s) for this group."""
        return sum(r.nbytes for r in self.runs)

    @property
    def capacity(self) -> int:
        """A buffer size that fits this group wherever in a page its runs start: buffers sized
        by it do not need to grow for another group of the same shape."""
        return sum(align_up(r.nbytes) + ALIGN for r in self.runs)


def merge_extents(infos) -> list[Run]:
    """Runs covering the given TensorInfos: tensors that touch in one file become one run."""
    runs: list[Run] = []
    for t in sorted(infos, key=lambda t: (t.file, t.offset)):
        if t.nbytes == 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.file == t.file and t.offset <= last.offset + last.nbytes:
            end = max(last.offset + last.nbytes, t.offset + t.nbytes)
            runs[-1] = Run(last.file, last.offset, end - last.offset)
        else:
            runs.append(Run(t.file, t.offset, t.nbytes))
    return runs


def make_layout(infos: dict[str, TensorInfo], extent: tuple[str, int, int] | None = None) -> Layout:
    """Place a group of tensors in a buffer. `extent` (file, offset, nbytes), when the source
    knows it, is read as one run and must contain every tensor."""
    if extent is not None:
        runs = [Run(str(extent[0]), int(extent[1]), int(extent[2]))]
        for t in infos.values():
            r = runs[0]
            if t.file != r.file or t.offset < r.offset or t.offset + t.nbytes > r.offset + r.nbytes:
                raise CheckpointError(f"{t.file}: tensor '{t.name}' lies outside its group's extent "
                                      f"{r.file}[{r.offset}:{r.offset + r.nbytes}]")
    else:
        runs = merge_extents(infos.values())
    starts, pos = [], 0
    for r in runs:
        starts.append(pos + r.offset % ALIGN)
        pos += align_up(r.offset + r.nbytes) - align_down(r.offset)
    placed = []
    for key, t in infos.items():
        buf_off = 0
        for r, s in zip(runs, starts):
            if t.file == r.file and r.offset <= t.offset and t.offset + t.nbytes <= r.offset + r.nbytes:
                buf_off = s + t.offset - r.offset
                break
        placed.append((key, t, buf_off))
    return Layout(tuple(runs), tuple(starts), tuple(placed), pos)


def globals_layout(source) -> Layout:
    return make_layout(source.global_infos(), _extent(source, "globals_extent"))


def spine_layout(source, i: int) -> Layout:
    return make_layout(source.spine_infos(i), _extent(source, "spine_extent", i))


def expert_layout(source, i: int, e: int) -> Layout:
    return make_layout(source.expert_infos(i, e), _extent(source, "expert_extent", i, e))


def _extent(source, method: str, *args):
    """The source's one-read extent for a group, when it has one (a converted store does)."""
    f = getattr(source, method, None)
    return f(*args) if f is not None else None


def views(buf: memoryview, layout: Layout, base: int = 0) -> dict[str, torch.Tensor]:
    """The group's tensors as views into `buf` (where the layout was read at `base`)."""
    out = {}
    for key, t, off in layout.tensors:
        dtype, size = DTYPES[t.dtype]
        if t.nbytes == 0:
            out[key] = torch.empty(t.shape, dtype=dtype)
        else:
            out[key] = torch.frombuffer(buf, dtype=dtype, count=t.nbytes // size, offset=base + off).view(t.shape)
    return out


class AlignedBuffer:
    """Page-aligned, zero-filled memory (a private anonymous mapping), allocated once and reused.

    Private, not shared: a shared anonymous mapping is shmem, whose pages cost more to fault in
    (an O_DIRECT read into a new buffer inserts each page into a shmem file) and to give back (the
    file is truncated), and which a memory cgroup counts as page cache rather than as the process's
    own memory (measured: docs/benchmarks.md#read-buffers)."""

    def __init__(self, nbytes: int):
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mem = memoryview(self._map)

    def trim(self, nbytes: int) -> None:
        """Give the pages past the first `nbytes` back to the system (the mapping stays; nothing
        may touch them again): a read-ahead buffer kept for a smaller layer than it was made for."""
        keep = align_up(max(nbytes, 1))
        if keep < self.nbytes:
            self._map.madvise(mmap.MADV_DONTNEED, keep, self.nbytes - keep)
            self.nbytes = keep


class Files:
    """Open files of one read mode; thread-safe; each file opened (or mapped) once."""

    def __init__(self, mode: str, direct: bool = True):
        if mode not in READ_MODES:
            raise ValueError(f"unknown read mode {mode!r} (allowed: {', '.join(READ_MODES)})")
        self.mode = mode
        self._direct_ok = direct and hasattr(os, "O_DIRECT")
        self._files = FileHandles()
        self._no_direct: set[str] = set()  # files whose filesystem refuses O_DIRECT
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _fd(self, file: str) -> int:
        return self._files.get(file)

    def _direct_fd(self, file: str) -> int | None:
        if not self._direct_ok or file in self._no_direct:
            return None
        try:
            return self._files.get(file, os.O_RDONLY | os.O_DIRECT)
        except CheckpointError:  # e.g. a filesystem without O_DIRECT
            self._no_direct.add(file)
            return None

    def _map(self, file: str) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            fd = self._fd(file)
            with self._lock:
                m = self._maps.get(file)
                if m is None:
                    m = self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        return m

    def read(self, run: Run, buf: memoryview, start: int) -> None:
        """Copy the run's bytes into buf[start:start + run.nbytes]."""
        if self.mode == "mmap":
            m = self._map(run.file)
            if run.offset + run.nbytes > len(m):
                raise CheckpointError(f"{run.file}: unexpected end of file at byte {len(m)}")
            src = np.frombuffer(m, dtype=np.uint8, count=run.nbytes, offset=run.offset)
            dst = np.frombuffer(buf, dtype=np.uint8, count=run.nbytes, offset=start)
            np.copyto(dst, src)  # releases the GIL; the page faults happen in this worker
            return
        if self.mode == "nocache":
            dfd = self._direct_fd(run.file)
            if dfd is not None:
                a0, a1 = align_down(run.offset), align_up(run.offset + run.nbytes)
                base = start - (run.offset - a0)
                try:
                    pread_into(dfd, buf[base:base + (a1 - a0)], a0, run.offset + run.nbytes - a0, run.file)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._no_direct.add(run.file)  # this filesystem refuses aligned direct reads
        fd = self._fd(run.file)
        pread_into(fd, buf[start:start + run.nbytes], run.offset, run.nbytes, run.file)
        if self.mode == "nocache":
            os.posix_fadvise(fd, run.offset, run.nbytes, os.POSIX_FADV_DONTNEED)

    def prefetch(self, files: list[str]) -> None:
        """A hint that these files are about to be read (local files need none)."""

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a view is still alive; the map goes with it
                    pass
            self._maps.clear()
        self._files.close()
        self._no_direct.clear()


class Batch:
    """Completion of a group of read jobs: wait() returns once all finished (raising the first error)."""

    def __init__(self, count: int, on_done: Callable[[BaseException | None], None] | None = None):
        self.cancelled = False  # set by cancel(): jobs not started yet are skipped
        self.read_bytes = 0  # bytes its jobs read (all of them unless cancelled)
        self._left = count
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks = [on_done] if on_done is not None else []
        self._finished = False
        if count == 0:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            callbacks, self._callbacks, self._finished = self._callbacks, [], True
        for fn in callbacks:
            self._call(fn)
        self._event.set()

    def _call(self, fn) -> None:
        try:
            fn(self._error)
        except BaseException as e:  # keep the worker alive; the waiter sees the error
            self._error = self._error or e

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call fn(error) once every job finished and every callback given before has run: in the
        thread that finishes the last job, or in this one when that already happened."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                return
        self._event.wait()  # the earlier callbacks may still be running in the finishing thread
        self._call(fn)

    def cancel(self) -> None:
        """Skip the jobs no worker has started; the batch completes once those in flight finish."""
        self.cancelled = True

    def job_done(self, error: BaseException | None, nbytes: int = 0) -> None:
        with self._lock:
            self.read_bytes += nbytes
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def done(self) -> bool:
        return self._event.is_set()

    def failed(self) -> bool:
        return self._event.is_set() and self._error is not None

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


# A read job: (run, buffer, buffer offset of the run's first byte).
Job = tuple[Run, memoryview, int]


def chunked(jobs: list[Job], chunk: int) -> list[Job]:
    """Split runs longer than `chunk` at file offsets that are multiples of `chunk` (a page
    multiple), so the pieces' page-aligned O_DIRECT reads never overlap."""
    out = []
    for run, buf, start in jobs:
        if run.nbytes <= chunk:
            out.append((run, buf, start))
            continue
        end = run.offset + run.nbytes
        a = run.offset
        while a < end:
            b = min(end, (a // chunk + 1) * chunk)
            out.append((Run(run.file, a, b - a), buf, start + a - run.offset))
            a = b
    return out


class ReadPool:
    """`workers` threads reading jobs from one priority queue (lower priority value first)."""

    def __init__(self, files: Files, workers: int):
        self.files = files
        self.workers = max(1, int(workers))
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=_work, args=(self._queue, files), daemon=True,
                                          name=f"deltafin-read-{k}") for k in range(self.workers)]
        for t in self._threads:
            t.start()

    def submit(self, jobs: list[Job], priority: int,
               on_done: Callable[[BaseException | None], None] | None = None) -> Batch:
        batch = Batch(len(jobs), on_done)
        for job in jobs:
            self._queue.put((priority, next(self._seq), job, batch))
        return batch

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._seq), None, None))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


def read_now(pool: ReadPool, layout: Layout, buf: AlignedBuffer) -> None:
    """Read a group into `buf` and wait for it (at load: the globals, the pinned spines)."""
    jobs = [(run, buf.mem, s) for run, s in zip(layout.runs, layout.starts)]
    pool.submit(chunked(jobs, SPINE_CHUNK), URGENT).wait()


def _work(q: queue.PriorityQueue, files: Files) -> None:
    while True:
        _, _, job, batch = q.get()
        if job is None:
            return
        if batch.cancelled:
            batch.job_done(None)
            continue
        error = None
        try:
            files.read(*job)
        except BaseException as e:  # reported to whoever waits on the batch
            error = e
        batch.job_done(error, job[0].nbytes if error is None else 0)


def drop_file_cache(files) -> str:
    """Evict these files' pages from the page cache, and nothing else: each file's dirty pages are
    written back, then ``POSIX_FADV_DONTNEED`` drops its clean ones. Other programs' cached files
    are left alone (no ``/proc/sys/vm/drop_caches``). Pages another process holds mapped stay.

    Returns the method used: "fadvise", or "none" where the platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return "none"
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return "fadvise"


def cached_fraction(files) -> float | None:
    """Share of the files' pages now in the page cache (mincore), or None where it cannot be told."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for file in files:
        size = os.path.getsize(file)
        if size == 0:
            continue
        with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(m)  # the map's address; touches no page
            try:
                if mincore(ctypes.addressof(anchor), size, vec) != 0:
                    return None
            finally:
                del anchor
            resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
            total += pages
    return resident / total if total else 0.0
