"""Spines for the streamer: the pinned ones, held from load on, and the read-ahead of the others.

What it holds: the first ``pin_layers`` spines, each in a buffer of its own, and two read-ahead
buffers (A and B) with the read in flight or done into each; nothing that grows with the number
of layers but the pinned spines.

How it is sized: the read-ahead buffers are made for the largest spine still read. They follow the
host-RAM cache (``_follow_cache``): the layers it holds are not read, so as it takes spines a buffer
larger than the largest layer still read is made anew at its next read (the old one goes first:
the two never coexist), and both are given back once it holds every streamed spine. A spine the
cache wants is kept in the buffer it was read into: that buffer goes to the cache (no copy), and
the read-ahead makes a new one when it needs it.

Why a read never overwrites a buffer in use: the buffers alternate. ``begin(i)`` is called only
after layer i-1 finished computing and dropped its weights (``release``), so the buffer that held
layer i-1 is free; the read of the next streamed layer (wrapping to the next pass) goes into it
while layer i computes from the other one, which is marked held and never read into.

Accounted per pass: the time blocked on a spine's read, its bytes by where they come from (RAM for
pinned and cached spines), spines loaded and, of them, served from RAM.
"""
from __future__ import annotations

import time

from .origin import ReadOrigin, count
from .ram import spine_in_cpu_layout
from .reader import AHEAD, SPINE_CHUNK, AlignedBuffer, Batch, Layout, ReadPool, chunked, read_now, views


class _SpineBuffer:
    def __init__(self, buf: AlignedBuffer):
        self.buf: AlignedBuffer | None = buf
        self.layer: int | None = None  # layer being read (or read) into it
        self.origin = "disk"  # where its bytes come from (see origin.ReadOrigin)
        self.batch: Batch | None = None
        self.held = False  # handed to the engine for the layer computing now
        self.weights: dict | None = None  # its layer's weights, decoded once its read completed

    def settle(self) -> None:
        """Wait for an outstanding read (its result is no longer wanted) and forget it."""
        if self.batch is not None:
            try:
                self.batch.wait()
            except Exception:
                pass
        self.layer, self.batch, self.held, self.weights = None, None, False, None


class SpineReader:
    def __init__(self, source, pool: ReadPool, files, origin: ReadOrigin, layouts: list[Layout],
                 pin_layers: int, streamable: list[int], cache=None, new_buffer=AlignedBuffer,
                 cpu_layout: bool = False):
        """`layouts[i]`: layer i's spine; `streamable`: the layers read here, neither pinned nor
        held by a device provider; `cache`: the host-RAM cache, if there is one; `new_buffer(nbytes)`:
        makes a buffer (a device provider's are pinned memory); `cpu_layout`: pinned spines are
        computed on the CPU, in the layout its products read fastest (io/ram.py)."""
        self._new_buffer = new_buffer
        self._source, self._pool, self._files, self._origin = source, pool, files, origin
        self._layouts = layouts
        self._cache = cache
        self.pin_layers = pin_layers
        self._pinned: list[dict] = []
        self._pinned_bufs: list[AlignedBuffer] = []
        for i in range(pin_layers):
            buf = new_buffer(layouts[i].capacity)
            read_now(pool, layouts[i], buf)
            self._pinned_bufs.append(buf)
            spine = source.decode_spine(i, views(buf.mem, layouts[i]))
            self._pinned.append(spine_in_cpu_layout(spine) if cpu_layout else spine)
        self.streamable = streamable
        self._streamed = streamable  # of them, those not cached now (see _follow_cache)
        self._ring_size = max((layouts[i].capacity for i in self._streamed), default=0)
        self._bufs = ([_SpineBuffer(new_buffer(self._ring_size)), _SpineBuffer(new_buffer(self._ring_size))]
                      if self._streamed else [])
        self._cache_version = -1

    # -- a pass ------------------------------------------------------------------------------
    def release(self) -> None:
        """The layer (or pass) that computed from a held buffer is done with it."""
        for b in self._bufs:
            if b.held:
                b.settle()

    def start_pass(self) -> None:
        """Queue the reads of the pass's first two streamed layers."""
        self._follow_cache()
        if self._streamed:
            first = self._streamed[0]
            self._request(first)
            self._request(self._next_streamed(first), keep=first)

    def held(self, i: int, stats) -> dict | None:
        """Layer i's spine if it is pinned or cached (counted as from RAM), else None."""
        self._follow_cache()
        w = self._pinned[i] if i < self.pin_layers else self._cache.spine(i) if self._cache is not None else None
        if w is not None:
            stats.bytes_from_ram += self._layouts[i].nbytes
            stats.spines_loaded += 1
            stats.spines_cached += 1
        return w

    def skip(self, i: int) -> None:
        """Layer i is not read here (held, or by a device): the read-ahead moves on past it."""
        if self._streamed:
            self._request(self._next_streamed(i))

    def begin(self, i: int) -> _SpineBuffer:
        """The buffer streamed layer i is (being) read into, handed to the engine; the next streamed
        layer's read is queued into the other one."""
        b = self._request(i)
        b.held = True
        if self._streamed:
            self._request(self._next_streamed(i))
        return b

    def finish(self, b: _SpineBuffer, stats) -> tuple[dict, bool]:
        """Wait for `b`'s read; its layer's weights, and whether the cache kept them (and the buffer)."""
        t0 = time.perf_counter()
        b.batch.wait()
        stats.spine_wait_seconds += time.perf_counter() - t0
        count(stats, b.origin, self._layouts[b.layer].nbytes)
        stats.spines_loaded += 1
        return self._keep(b, self._decoded(b))

    def in_ram(self, j: int) -> dict | None:
        """Layer j's spine if it is in RAM for good (pinned or cached): weights that stay valid until
        the cache gives them up (nothing is counted)."""
        if j < self.pin_layers:
            return self._pinned[j]
        if self._cache is not None and j in self.streamable:
            return self._cache.spine(j)
        return None

    def in_memory(self, j: int) -> dict | None:
        """Layer j's spine if it is in memory now (pinned, cached, or its read-ahead complete)."""
        w = self.in_ram(j)
        if w is not None or j not in self.streamable:
            return w
        for b in self._bufs:
            if b.layer == j and b.batch is not None and b.batch.done() and not b.batch.failed():
                return self._decoded(b)
        return None

    # -- memory ------------------------------------------------------------------------------
    def buffers(self) -> list[AlignedBuffer]:
        """The read-ahead buffers now."""
        return [b.buf for b in self._bufs if b.buf is not None]

    def buffer_bytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers())

    def pinned_bytes(self) -> int:
        return sum(buf.nbytes for buf in self._pinned_bufs)

    def close(self) -> None:
        for b in self._bufs:
            b.settle()

    # -- internals ---------------------------------------------------------------------------
    def _keep(self, b: _SpineBuffer, weights: dict) -> tuple[dict, bool]:
        """Offer the spine read into `b` to the cache; its weights from now on (as the cache lays them
        out), and True if kept, with its buffer."""
        i = b.layer
        if self._cache is None or not self._cache.wants_spine(i):
            return weights, False
        # Kept from now on in the buffer it was read into (no copy, no second buffer of its size
        # while the read-ahead buffers still exist); the read-ahead makes a new one when it needs it.
        buf = b.buf
        buf.trim(self._layouts[i].capacity)
        weights = b.weights = self._cache.spine_to_keep(weights)
        if not self._cache.put_spine(i, buf, weights):
            return weights, False
        b.buf = None
        self._follow_cache()  # the last spine kept: the other read-ahead buffer goes now
        return weights, True

    def _decoded(self, b: _SpineBuffer) -> dict:
        """The weights of the layer read into `b` (decoded once: a guess may have asked first)."""
        if b.weights is None:
            b.weights = self._source.decode_spine(b.layer, views(b.buf.mem, self._layouts[b.layer]))
        return b.weights

    def _follow_cache(self) -> None:
        """The layers the cache holds are not read, and the buffers shrink to the largest layer
        still read (given back when none is)."""
        if self._cache is None or self._cache.version == self._cache_version:
            return
        self._cache_version = self._cache.version
        self._streamed = [i for i in self.streamable if not self._cache.holds_spine(i)]
        self._ring_size = max((self._layouts[i].capacity for i in self._streamed), default=0)
        if not self._streamed:
            for b in self._bufs:
                if not b.held:
                    b.settle()
                    b.buf = None

    def _next_streamed(self, i: int) -> int:
        """The streamed layer read after layer i: the next one, or the first of the next pass."""
        for j in self._streamed:
            if j > i:
                return j
        return self._streamed[0]

    def _request(self, layer: int, keep: int | None = None) -> _SpineBuffer:
        """The buffer `layer` is (being) read into; start the read if it is not under way, in a
        buffer that is neither held by the engine nor reading `keep`."""
        for b in self._bufs:
            if b.layer == layer and not b.held:
                if not b.batch.failed():
                    return b
                b.settle()  # a failed read (the error went to the pass that wanted it): read again
        free = [b for b in self._bufs if b.layer is None and not b.held]
        if free:
            b = free[0]
        else:  # a read nobody wants any more (after an error or out-of-order use): let it finish
            b = next(b for b in self._bufs if not b.held and b.layer != keep)
            b.settle()
        lay = self._layouts[layer]
        if b.buf is None or b.buf.nbytes < lay.capacity or b.buf.nbytes > max(self._ring_size, lay.capacity):
            b.buf = None  # the old one goes first: the two never coexist
            b.buf = self._new_buffer(max(self._ring_size, lay.capacity))
        jobs = [(run, b.buf.mem, s) for run, s in zip(lay.runs, lay.starts)]
        b.layer, b.held, b.origin, b.weights = layer, False, self._origin.of(lay), None
        self._files.prefetch(list(dict.fromkeys(run.file for run in lay.runs)))
        b.batch = self._pool.submit(chunked(jobs, SPINE_CHUNK), AHEAD)
        return b
