"""Routed experts for the streamer: those the host-RAM cache holds, and reads of the others.

What it holds: one read buffer ("slot") per expert read in one layer, reused layer after layer:
``read`` for layer i reuses the slots only once layer i-1 finished computing from them (the
engine asks for a layer's experts after the layer before it ran). An expert the cache admits is
read into a buffer of its own instead, which the cache keeps (no copy).

How it is sized: by the most distinct experts one layer of a pass read (top-k for a decode pass;
a prefill may need one per expert of a layer); a slot is made anew for an expert split into more
runs than the others. With a cache, the slots beyond those a pass already has are first counted
against its budget (``make_room``), and at the pass's end (``end_pass``) the slots beyond what it
needed, and beyond a decode pass's top-k, are given back.

Reads are queued at urgent priority in pieces of EXPERT_CHUNK, and ``read`` returns a Future at
once, so the engine computes the shared expert while they run; waiting on it adds to the pass's
expert wait. Accounted per pass: the bytes by where they come from (RAM for cached experts), and
the experts served by the cache.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from .origin import ReadOrigin, count
from .reader import AHEAD, EXPERT_CHUNK, URGENT, AlignedBuffer, Batch, Layout, ReadPool, chunked, expert_layout, views


class _TimedFuture(Future):
    """A Future whose result() adds the time it blocked to the pass's expert wait."""

    def __init__(self, stats):
        super().__init__()
        self._stats = stats

    def result(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._stats.expert_wait_seconds += time.perf_counter() - t0


class ExpertReader:
    def __init__(self, source, pool: ReadPool, files, origin: ReadOrigin, cache, decode_slots: int,
                 new_buffer=AlignedBuffer):
        """`cache`: the host-RAM cache, or None; `decode_slots`: the slots a decode pass
        needs (top-k), kept at a pass's end; `new_buffer(nbytes)`: makes a buffer."""
        self._new_buffer = new_buffer
        self._source, self._pool, self._files, self._origin = source, pool, files, origin
        self._cache = cache
        self._decode_slots = decode_slots
        self._layouts: dict[tuple[int, int], Layout] = {}
        self._slots: list[AlignedBuffer] = []
        self._slots_used = 0  # the most slots one layer of this pass needed
        self._batch: Batch | None = None  # the last layer's reads
        self._fill_batch: Batch | None = None  # the last ``fill``'s reads
        # (layer, expert) whose fill failed (its read or its decode): never read ahead again, so a bad
        # range of the store costs one read, not one a pass; a demand read raises its error where seen.
        self.unfillable: set[tuple[int, int]] = set()

    def layout(self, i: int, e: int) -> Layout:
        lay = self._layouts.get((i, e))
        if lay is None:
            lay = self._layouts[(i, e)] = expert_layout(self._source, i, e)
        return lay

    def cached(self, i: int, chosen: list[int], stats) -> dict:
        """Of the experts layer i's router chose, those the cache holds (counted as from RAM); the
        cache learns what was chosen (its scores, and what stays until the layer computed)."""
        cache = self._cache
        got = {}
        if cache is not None:
            cache.routed(i, chosen)
            for e in chosen:
                w = cache.expert(i, e)
                if w is not None:
                    got[e] = w
            stats.experts_cached += len(got)
            stats.bytes_from_ram += sum(self.layout(i, e).nbytes for e in got)
        return got

    def read(self, i: int, missing: list[int], got: dict, under_way: dict, stats) -> Future:
        """Read the experts `missing` of layer i. The Future's result: those, with `got` (weights
        at hand) and `under_way` (prefetches still reading: ``prefetch.Ahead``, waited for)."""
        fut = _TimedFuture(stats)
        cache = self._cache
        if self._batch is not None and missing:  # normally long done; after an error it may not be
            try:
                self._batch.wait()
            except Exception:
                pass
        layouts = [self.layout(i, e) for e in missing]
        # An expert the cache admits is read into a buffer of its own, which the cache keeps; the
        # others go through the reused slots.
        own = [cache.admit_expert(i, e, lay.capacity) if cache is not None else None
               for e, lay in zip(missing, layouts)]
        need = sum(1 for b in own if b is None)
        if need > len(self._slots) and cache is not None:  # counted against the budget first
            extra = sum(lay.capacity for lay, b in zip(layouts, own) if b is None) - \
                sum(s.nbytes for s in self._slots)
            cache.make_room(extra, f"room for {need - len(self._slots)} more expert read buffers")
        bufs, k = [], 0
        for lay, b in zip(layouts, own):
            if b is None:
                if k == len(self._slots):  # more distinct experts than ever before (a prefill)
                    self._slots.append(self._new_buffer(lay.capacity))
                elif self._slots[k].nbytes < lay.size:  # an expert split into more runs than the others
                    self._slots[k] = self._new_buffer(lay.capacity)
                b, k = self._slots[k], k + 1
            bufs.append(b)
        self._slots_used = max(self._slots_used, k)
        jobs = [(run, b.mem, s) for lay, b in zip(layouts, bufs) for run, s in zip(lay.runs, lay.starts)]
        for lay in layouts:
            count(stats, self._origin.of(lay), lay.nbytes)
        self._files.prefetch([lay.runs[0].file for lay in layouts if lay.runs])
        decode = self._source.decode_expert

        def finish(error):
            if error is not None:
                fut.set_exception(error)
                return
            try:
                out = dict(got)
                for e, b, lay, mine in zip(missing, bufs, layouts, own):
                    out[e] = decode(i, e, views(b.mem, lay))
                    if mine is not None:
                        out[e] = cache.expert_to_keep(out[e])
                        cache.put_expert(i, e, mine, out[e])
                for e, a in under_way.items():
                    out[e] = a.weights  # decoded by the prefetch's own callback, which ran first
                fut.set_result(out)
            except Exception as e:
                fut.set_exception(e)

        waits = [a.batch for a in under_way.values()]
        if missing:
            self._batch = self._pool.submit(chunked(jobs, EXPERT_CHUNK), URGENT)
            waits.append(self._batch)
        if not waits:
            finish(None)
        else:
            _when_all(waits, finish)
        return fut

    def fill(self, i: int, experts: list[int], stats) -> int:
        """Read experts of layer i that no pass asked for into the cache, behind every urgent read,
        where it admits them (each into a buffer of its own: the slots are not touched); how many
        were queued (none while the last fill is still reading). Their bytes count in `stats` now,
        as a demand read's do."""
        cache = self._cache
        if cache is None or (self._fill_batch is not None and not self._fill_batch.done()):
            return 0
        queued = []
        for e in experts:
            if cache.expert(i, e) is not None:
                continue
            lay = self.layout(i, e)
            buf = cache.admit_expert(i, e, lay.capacity)
            if buf is None:
                break  # no room: the cache's plan changed since the caller looked
            queued.append((e, lay, buf))
            count(stats, self._origin.of(lay), lay.nbytes)
        if not queued:
            return 0
        decode = self._source.decode_expert

        def keep(error):
            if error is not None:  # the slots' promises are settled at the layer's next routing
                self.unfillable.update((i, e) for e, _, _ in queued)
                return
            for e, lay, buf in queued:
                try:
                    weights = cache.expert_to_keep(decode(i, e, views(buf.mem, lay)))
                except Exception:  # noqa: BLE001 -- a demand read of it raises the error where it is seen
                    self.unfillable.add((i, e))
                    continue
                cache.put_expert(i, e, buf, weights)

        jobs = [(run, buf.mem, s) for _, lay, buf in queued for run, s in zip(lay.runs, lay.starts)]
        self._fill_batch = self._pool.submit(chunked(jobs, EXPERT_CHUNK), AHEAD, keep)
        return len(queued)

    def end_pass(self) -> int:
        """Give back the slots beyond what this pass needed (and beyond a decode pass's); the
        bytes freed."""
        keep = max(self._slots_used, self._decode_slots)
        freed = sum(s.nbytes for s in self._slots[keep:])
        del self._slots[keep:]
        self._slots_used = 0
        return freed

    # -- memory ------------------------------------------------------------------------------
    def buffers(self) -> list[AlignedBuffer]:
        """The slots now."""
        return list(self._slots)

    def slot_bytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def extra_slot_bytes(self) -> int:
        """The slots beyond a decode pass's (a long pass's, which ``make_room`` took from the cache)."""
        return sum(s.nbytes for s in self._slots[self._decode_slots:])

    def close(self) -> None:
        for batch in (self._batch, self._fill_batch):
            if batch is not None:
                try:
                    batch.wait()
                except Exception:
                    pass


def _when_all(batches: list[Batch], fn) -> None:
    """Call fn(first error or None) once every batch completed (in the thread completing the last)."""
    left, errors, lock = [len(batches)], [], threading.Lock()

    def one(error):
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn(errors[0] if errors else None)

    for b in batches:
        b.add_done_callback(one)
