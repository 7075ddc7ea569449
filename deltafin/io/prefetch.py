"""Expert prefetch for the streaming provider: read a layer's likely experts before its router runs.

Prediction (``prefetch prev``): the experts the previous pass's last token chose at the same layer
(trained routers repeat many of them from token to token; tools/routing_stats.py measures how many).
The experts the host-RAM cache holds are left out: they cost nothing anyway.

When: at ``start(i)``, called as layer i's spine is asked for (layer i-1 has finished, so its
buffers are free), the reads of layer i's predicted experts are queued at ``PREFETCH`` (with the
read-ahead, before the next layer's spine): they fill the disk while layer i's attention computes,
and every demand read (routed experts, at URGENT) still goes first.

What stays in memory: one buffer per predicted expert (at most top-k), reused layer after layer.
Prefetches nobody took are cancelled at the next layer; while a cancelled one still has pieces
queued (the disk is busy with reads that are certainly needed), nothing new is prefetched, so the
buffers stay at about two layers' worth. ``take(i, e)``, asked by the demand path for every routed expert that the cache does
not hold, returns the expert's weights when its prefetch has completed; a prefetch still under way
is cancelled (its queued pieces are skipped, at most one piece per worker is still read) and the
expert is read on demand as without prefetch, so a demand read never waits for a prefetch.
Buffers whose expert the cache admits are handed to the cache (no copy) and replaced.

Accounting (into the pass's ``PassStats``): bytes read by prefetch (also counted as disk bytes),
and of them the bytes of experts that the router then chose (``prefetch_useful_rate`` is their ratio).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.moe import chosen_experts
from .reader import PREFETCH, AlignedBuffer, Batch, Layout, ReadPool, chunked, views

PREFETCH_CHUNK = 1 << 20  # pieces small enough that a cancelled prefetch holds a worker only briefly


@dataclass
class _Ahead:
    expert: int
    buf: AlignedBuffer
    layout: Layout
    batch: Batch


class Prefetcher:
    def __init__(self, pool: ReadPool, layout_of, decode, cache=None):
        """`layout_of(i, e)`: expert e of layer i's Layout; `decode(i, e, views)`: its weights."""
        self._pool = pool
        self._layout_of = layout_of
        self._decode = decode
        self._cache = cache
        self._last: dict[int, list[int]] = {}  # layer -> what the last token of the previous pass chose
        self._layer: int | None = None  # the layer whose experts are being prefetched
        self._ahead: dict[int, _Ahead] = {}
        self._retiring: list[_Ahead] = []  # cancelled, with pieces still queued or in flight
        self._free: list[AlignedBuffer] = []

    def observe(self, i: int, ids) -> None:
        """What the router of layer i chose this pass (``ids`` [rows, k], or a list of expert ids);
        the last row predicts the next pass."""
        last = ids[-1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else ids
        self._last[i] = chosen_experts(last)

    def start(self, i: int, stats) -> None:
        """Queue the reads of layer i's predicted experts (the previous layer's are done with)."""
        self._release(stats)
        predicted = self._last.get(i)
        if not predicted or self._retiring:
            return  # the disk has not caught up with the last guesses: no new ones (bounds memory)
        cache = self._cache
        self._layer = i
        for e in predicted:
            if cache is not None and cache.expert(i, e) is not None:
                continue
            lay = self._layout_of(i, e)
            buf = self._buffer(lay.capacity, stats)
            jobs = [(run, buf.mem, s) for run, s in zip(lay.runs, lay.starts)]
            self._ahead[e] = _Ahead(e, buf, lay, self._pool.submit(chunked(jobs, PREFETCH_CHUNK), PREFETCH))

    def take(self, i: int, e: int, stats):
        """Expert e of layer i if its prefetch completed (then its weights), else None (a prefetch
        still under way is cancelled: the caller reads it on demand)."""
        a = self._ahead.get(e) if self._layer == i else None
        if a is None:
            return None
        if not a.batch.done() or a.batch.failed() or a.batch.cancelled:
            a.batch.cancel()
            return None
        del self._ahead[e]
        _count(stats, a.batch)
        weights = self._decode(i, e, views(a.buf.mem, a.layout))
        stats.prefetch_used_bytes += a.layout.nbytes
        cache = self._cache
        if cache is not None and cache.admit_expert(i, e, a.buf.nbytes):
            cache.put_expert(i, e, a.buf, weights)  # the cache keeps the buffer; a new one replaces it
        else:
            self._free.append(a.buf)  # reused once layer i is done (the next start())
        return weights

    def resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._free) + sum(a.buf.nbytes for a in [*self._ahead.values(), *self._retiring])

    def close(self) -> None:
        """Cancel everything and wait for the pieces in flight (the buffers must outlive them)."""
        self._release(None)
        for a in self._retiring:
            try:
                a.batch.wait()
            except Exception:
                pass
        self._retiring.clear()

    def _release(self, stats) -> None:
        """Cancel the prefetches nobody took. Their queued pieces are skipped when a worker gets to
        them (after every read that is wanted), so their buffers come back later, not now."""
        for a in self._ahead.values():
            a.batch.cancel()
        self._retiring.extend(self._ahead.values())
        self._ahead.clear()
        self._layer = None
        still = []
        for a in self._retiring:
            if a.batch.done():
                if stats is not None:
                    _count(stats, a.batch)  # what was read counts as prefetched (and unused)
                self._free.append(a.buf)
            else:
                still.append(a)
        self._retiring = still

    def _buffer(self, nbytes: int, stats) -> AlignedBuffer:
        for k, b in enumerate(self._free):
            if b.nbytes >= nbytes:
                return self._free.pop(k)
        return AlignedBuffer(nbytes)


def _count(stats, batch: Batch) -> None:
    """A prefetch's bytes read from disk: disk bytes of the pass, and prefetched bytes."""
    stats.prefetch_bytes += batch.read_bytes
    stats.bytes_read += batch.read_bytes
