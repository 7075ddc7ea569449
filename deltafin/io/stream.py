"""The streaming provider: a model larger than RAM, read from disk layer by layer at disk speed.

What stays in memory: the globals (embeddings, final norm, lm_head, output attn-res), the first
``pin_layers`` spines, two spine buffers of the largest streamed layer's size, and one buffer
("slot") per expert read in one layer. None of it depends on the number of layers. Beyond that,
a host-RAM cache (``io.ram_cache``, sized by the ``ram_budget`` setting through ``io.memory``)
keeps the spines of a fixed set of layers and the experts routed most often lately, as long as
memory is free; what it holds is not read again, and it gives memory back under pressure. With
``ram_budget 0`` there is no cache, and after the first passes nothing is allocated per token.
With a cache, the spine buffers follow the layers still streamed (none once every spine is
held), and expert slots beyond what the last pass needed are given back after it (a prefill
may need one per expert of a layer).

Spine read-ahead: spine buffers A and B alternate. ``spine(i)`` is called only after layer i-1
finished computing and dropped its weights, so the buffer that held layer i-1 is free; the read
of the next streamed layer (wrapping to the next pass) goes into it while layer i computes from
the other one. The engine's views into a buffer are therefore never overwritten while in use.

Experts: ``experts(i, chosen)`` queues one read per expert (merged runs) at urgent priority and
returns a Future at once, so the engine computes the shared expert while the reads run. The
slots are reused at the next layer's ``experts`` call, after layer i finished.

Per pass it accounts bytes by where they come from (the model's files on disk, or for a hub
source its local cache or the network; RAM for pinned and cached layers and experts, and the
head), time blocked on spines and on experts, and experts loaded (and of them, served by the
cache) into the engine's ``PassStats``.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future

from ..model.moe import chosen_experts
from ..settings import Settings
from .memory import WATCH_INTERVAL_S, MemoryBudget, Watcher
from .prefetch import Ahead, Prefetcher, early_guess
from .ram import done
from .ram_cache import RamCache
from .reader import AHEAD, EXPERT_CHUNK, SPINE_CHUNK, URGENT, AlignedBuffer, Batch, Files, Layout, ReadPool, chunked, \
    make_layout, views, align_up


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


class _SpineBuffer:
    def __init__(self, nbytes: int):
        self.buf: AlignedBuffer | None = AlignedBuffer(nbytes)
        self.layer: int | None = None  # layer being read (or read) into it
        self.origin = "disk"  # where its bytes come from (see _count)
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


class StreamProvider:
    def __init__(self, source, settings: Settings, held: frozenset[int] = frozenset(), cache: bool = True,
                 memory_root: str = "/", watch: bool = True):
        """``held``: layers whose spine a device provider keeps; they are never read here.
        ``cache``: whether a host-RAM cache may be kept (as ``settings.ram_budget`` says);
        ``memory_root``: the file tree memory is read from (``/``; tests give a tree they write);
        ``watch``: check memory from a thread a few times a second (else only ``watcher.check()``)."""
        self.source = source
        cfg = self.config = source.config
        self.settings = settings
        # A hub source reads through its cache, which fetches what is missing first.
        make_files = getattr(source, "make_files", None)
        self.files = make_files(settings.read_mode) if make_files is not None else Files(settings.read_mode)
        self._origin = getattr(source, "origin", None)
        self.pool = ReadPool(self.files, settings.io_workers)
        # The worker threads stop when the provider is dropped (they do not reference it).
        self._finalizer = weakref.finalize(self, _shutdown, self.pool, self.files)

        L = cfg.num_layers
        self._spine_layouts = [make_layout(source.spine_infos(i), _extent(source, "spine_extent", i))
                               for i in range(L)]
        self._expert_layouts: dict[tuple[int, int], Layout] = {}

        glayout = make_layout(source.global_infos(), _extent(source, "globals_extent"))
        self._global_buf = AlignedBuffer(glayout.capacity)
        self._read_now(glayout, self._global_buf)
        self._globals = source.decode_globals(views(self._global_buf.mem, glayout))
        embed = self._globals["embed"]
        self._embed_row_bytes = embed.shape[1] * embed.element_size()
        # Per pass the whole of every global but the embedding is used; of the embedding, one row per token.
        self._global_pass_bytes = glayout.nbytes - embed.numel() * embed.element_size()

        self.pin_layers = min(settings.pin_layers, L)
        self._pinned: list[dict] = []
        self._pinned_bufs: list[AlignedBuffer] = []
        for i in range(self.pin_layers):
            buf = AlignedBuffer(self._spine_layouts[i].capacity)
            self._read_now(self._spine_layouts[i], buf)
            self._pinned_bufs.append(buf)
            self._pinned.append(source.decode_spine(i, views(buf.mem, self._spine_layouts[i])))
        self._streamable = [i for i in range(self.pin_layers, L) if i not in held]
        self._streamed = self._streamable  # of them, those not cached now (see _plan_reads)
        self._ring_size = max((self._spine_layouts[i].capacity for i in self._streamed), default=0)
        self._spine_bufs = [_SpineBuffer(self._ring_size), _SpineBuffer(self._ring_size)] if self._streamed else []

        self._slots: list[AlignedBuffer] = []
        self._slots_used = 0  # the most slots one layer of this pass needed
        self._expert_batch: Batch | None = None

        self.prefetcher: Prefetcher | None = None  # made once the cache (which it fills) is
        self.cache: RamCache | None = None
        self.watcher: Watcher | None = None
        ceiling = settings.ram_budget_bytes()
        if cache and ceiling != 0 and self._streamable:
            moe = [i for i in range(L) if cfg.is_moe(i)]
            self.cache = RamCache([align_up(self._spine_layouts[i].capacity) if i in self._streamable
                                   else 0 for i in range(L)],
                                  [align_up(self._expert_layout(i, 0).capacity) if i in moe else 0
                                   for i in range(L)], cfg.num_experts)
            self._note_fixed()
            self._budget = MemoryBudget(ceiling, memory_root)
            self.budget_line = self._budget.describe(self.cache.fixed_bytes)
            self.watcher = Watcher(self._budget, self.cache, WATCH_INTERVAL_S if watch else None)
            self.watcher.check()
        else:
            self.budget_line = ("ram budget 0: no cache (every streamed byte is read per token)" if ceiling == 0
                                else "")
        self._cache_version = -1
        if settings.prefetch != "off" and any(cfg.is_moe(i) for i in range(L)):
            self.prefetcher = Prefetcher(self.pool, self._expert_layout, source.decode_expert, self.cache,
                                         guesses=cfg.experts_per_token)
        self._first_moe = next((i for i in range(L) if cfg.is_moe(i)), None)

    # -- the provider protocol ---------------------------------------------------------------
    def globals(self) -> dict:
        return self._globals

    def start_pass(self, stats) -> None:
        stats.bytes_from_ram += self._global_pass_bytes + self._embed_row_bytes * stats.tokens
        for b in self._spine_bufs:
            if b.held:  # the previous pass is over
                b.settle()
        if self.prefetcher is not None:
            # The first MoE layer has no MoE layer before it to guess from: the previous pass's
            # last token's experts there, queued before the dense layers before it compute.
            self.prefetcher.start(self._first_moe, stats)
        self._plan_reads()
        if self._streamed:
            first = self._streamed[0]
            self._request(first)
            self._request(self._next_streamed(first), keep=first)

    def end_pass(self, stats) -> None:
        if self.cache is not None:
            # Slots a larger pass (a prefill) needed go back to the budget; a decode pass keeps its own.
            keep = max(self._slots_used, self.config.experts_per_token)
            freed = sum(s.nbytes for s in self._slots[keep:])
            del self._slots[keep:]
            self._slots_used = 0
            self._note_fixed()
            self.cache.repay(freed)

    def spine(self, i: int, stats) -> dict:
        for b in self._spine_bufs:
            if b.held:  # layer i-1 is done with it
                b.settle()
        if self.prefetcher is not None and self.settings.prefetch == "prev" and self.config.is_moe(i) \
                and i != self._first_moe:  # (the first's guess was queued when the pass started)
            self.prefetcher.start(i, stats)  # queued first: needed before the next spine
        self._plan_reads()
        cached = self._pinned[i] if i < self.pin_layers else self.cache.spine(i) if self.cache else None
        if cached is not None or i not in self._streamable:
            if cached is not None:
                stats.bytes_from_ram += self._spine_layouts[i].nbytes
                stats.spines_loaded += 1
                stats.spines_cached += 1
            if self._streamed:
                self._request(self._next_streamed(i))
            return cached if cached is not None else {}
        b = self._request(i)
        b.held = True
        if self._streamed:
            self._request(self._next_streamed(i))
        self._note_fixed()
        t0 = time.perf_counter()
        b.batch.wait()
        stats.spine_wait_seconds += time.perf_counter() - t0
        lay = self._spine_layouts[i]
        _count(stats, b.origin, lay.nbytes)
        stats.spines_loaded += 1
        weights = self._decoded(b)
        if self.cache is not None and self.cache.wants_spine(i):
            # Kept from now on in the buffer it was read into (no copy, no second buffer of its size
            # while the read-ahead buffers still exist); the read-ahead makes a new one when it needs it.
            buf = b.buf
            buf.trim(lay.capacity)
            if self.cache.put_spine(i, buf, weights):
                b.buf = None
                self._plan_reads()  # the last spine kept: the other read-ahead buffer goes now
                self._note_fixed()
        return weights

    def experts(self, i: int, ids, stats, residual=None) -> Future:
        """Read the experts routed to (``ids``: the router's tensor, or a list of expert ids).
        ``residual``: the layer's residual stream at its MoE (rows of this pass), from which the
        ``early`` prefetch guesses the next MoE layer's experts."""
        fut = _TimedFuture(stats)
        chosen = chosen_experts(ids)
        stats.experts_loaded += len(chosen)
        cache = self.cache
        got = {}
        if cache is not None:
            cache.routed(i, chosen)
            for e in chosen:
                w = cache.expert(i, e)
                if w is not None:
                    got[e] = w
            stats.experts_cached += len(got)
            stats.bytes_from_ram += sum(self._expert_layout(i, e).nbytes for e in got)
        under_way = {}  # prefetches of chosen experts still reading: waited for, not read again
        if self.prefetcher is not None:
            if self.settings.prefetch == "prev" or i == self._first_moe:
                self.prefetcher.observe(i, ids)
            for e in chosen:
                w = self.prefetcher.take(i, e, stats) if e not in got else None
                if isinstance(w, Ahead):
                    under_way[e] = w
                elif w is not None:
                    got[e] = w
        missing = [e for e in chosen if e not in got and e not in under_way]
        if self._expert_batch is not None and missing:  # normally long done; after an error it may not be
            try:
                self._expert_batch.wait()
            except Exception:
                pass
        layouts = [self._expert_layout(i, e) for e in missing]
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
                    self._slots.append(AlignedBuffer(lay.capacity))
                elif self._slots[k].nbytes < lay.size:  # an expert split into more runs than the others
                    self._slots[k] = AlignedBuffer(lay.capacity)
                b, k = self._slots[k], k + 1
            bufs.append(b)
        self._slots_used = max(self._slots_used, k)
        jobs = [(run, b.mem, s) for lay, b in zip(layouts, bufs) for run, s in zip(lay.runs, lay.starts)]
        for lay in layouts:
            _count(stats, self._where(lay), lay.nbytes)
        self.files.prefetch([lay.runs[0].file for lay in layouts if lay.runs])
        decode = self.source.decode_expert

        def finish(error):
            if error is not None:
                fut.set_exception(error)
                return
            try:
                out = dict(got)
                for e, b, lay, mine in zip(missing, bufs, layouts, own):
                    out[e] = decode(i, e, views(b.mem, lay))
                    if mine is not None:
                        cache.put_expert(i, e, mine, out[e])
                for e, a in under_way.items():
                    out[e] = a.weights  # decoded by the prefetch's own callback, which ran first
                fut.set_result(out)
            except Exception as e:
                fut.set_exception(e)

        waits = [a.batch for a in under_way.values()]
        if missing:
            self._expert_batch = self.pool.submit(chunked(jobs, EXPERT_CHUNK), URGENT)
            waits.append(self._expert_batch)
        if self.settings.prefetch == "early" and residual is not None:
            self._guess_next(i, residual, stats)  # queued behind this layer's demand reads
        self._note_fixed()
        if not waits:
            finish(None)
        else:
            _when_all(waits, finish)
        return fut

    def _guess_next(self, i: int, residual, stats) -> None:
        """Prefetch ``early``: the next MoE layer's router on this layer's residual stream."""
        j = next((n for n in range(i + 1, self.config.num_layers) if self.config.is_moe(n)), None)
        router = self._router(j) if j is not None else None
        guess = early_guess(self.config, residual, router) if router is not None else None
        if guess:
            self.prefetcher.start(j, stats, guess, computing=i)

    def _router(self, j: int) -> dict | None:
        """Layer j's spine if it is in memory now (pinned, cached, or its read-ahead complete)."""
        if j < self.pin_layers:
            return self._pinned[j]
        if j not in self._streamable:
            return None
        if self.cache is not None:
            w = self.cache.spine(j)
            if w is not None:
                return w
        for b in self._spine_bufs:
            if b.layer == j and b.batch is not None and b.batch.done() and not b.batch.failed():
                return self._decoded(b)
        return None

    def _decoded(self, b: _SpineBuffer) -> dict:
        """The weights of the layer read into `b` (decoded once: a guess may have asked first)."""
        if b.weights is None:
            b.weights = self.source.decode_spine(b.layer, views(b.buf.mem, self._spine_layouts[b.layer]))
        return b.weights

    # -- introspection -----------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Memory the provider holds, by part (independent of the layer count except `pinned`)."""
        out = {
            "globals": self._global_buf.nbytes,
            "pinned": sum(b.nbytes for b in self._pinned_bufs),
            "spine_buffers": sum(b.buf.nbytes for b in self._spine_bufs if b.buf is not None),
            "expert_slots": sum(s.nbytes for s in self._slots),
            "prefetch": self.prefetcher.resident_bytes() if self.prefetcher is not None else 0,
        }
        out["total"] = sum(out.values())
        if self.cache is not None:  # not in the total: the fixed part
            out["cache"] = self.cache.held_bytes()
        return out

    def residency(self) -> dict:
        """The host-RAM budget now (the streamer's own buffers plus what the cache may hold) and
        what the cache holds; empty without a cache."""
        if self.cache is None:
            return {}
        c = self.cache.residency()
        return {"budget_bytes": c["target_bytes"] + self.cache.fixed_bytes, "fixed_bytes": self.cache.fixed_bytes,
                "cache": c}

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for b in self._spine_bufs:
            b.settle()
        if self._expert_batch is not None:
            try:
                self._expert_batch.wait()
            except Exception:
                pass
        self._finalizer()

    # -- internals ---------------------------------------------------------------------------
    def _note_fixed(self) -> None:
        """Tell the cache what the streamer's own buffers take now (the budget follows their
        recent peak), without the extra expert slots of a long pass (a prefill), which
        ``make_room`` already took from the cache and ``end_pass`` gives back, and without the
        spine read-ahead buffers, which the cache's plan counts with the spines (``ring_bytes``)."""
        if self.cache is not None:
            extra = sum(s.nbytes for s in self._slots[self.config.experts_per_token:])
            held = self.resident_bytes()
            self.cache.ring_bytes = held["spine_buffers"]
            self.cache.fixed_bytes = held["total"] - extra - held["spine_buffers"]

    def _read_now(self, layout: Layout, buf: AlignedBuffer) -> None:
        jobs = [(run, buf.mem, s) for run, s in zip(layout.runs, layout.starts)]
        self.pool.submit(chunked(jobs, SPINE_CHUNK), URGENT).wait()

    def _plan_reads(self) -> None:
        """Follow the cache: the layers it holds are not read, and the spine buffers shrink to the
        largest layer still read (given back when none is)."""
        if self.cache is None or self.cache.version == self._cache_version:
            return
        self._cache_version = self.cache.version
        self._streamed = [i for i in self._streamable if not self.cache.holds_spine(i)]
        self._ring_size = max((self._spine_layouts[i].capacity for i in self._streamed), default=0)
        if not self._streamed:
            for b in self._spine_bufs:
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
        for b in self._spine_bufs:
            if b.layer == layer and not b.held:
                if not b.batch.failed():
                    return b
                b.settle()  # a failed read (the error went to the pass that wanted it): read again
        free = [b for b in self._spine_bufs if b.layer is None and not b.held]
        if free:
            b = free[0]
        else:  # a read nobody wants any more (after an error or out-of-order use): let it finish
            b = next(b for b in self._spine_bufs if not b.held and b.layer != keep)
            b.settle()
        lay = self._spine_layouts[layer]
        if b.buf is None or b.buf.nbytes < lay.capacity or b.buf.nbytes > max(self._ring_size, lay.capacity):
            b.buf = None  # the old one goes first: the two never coexist
            b.buf = AlignedBuffer(max(self._ring_size, lay.capacity))
        jobs = [(run, b.buf.mem, s) for run, s in zip(lay.runs, lay.starts)]
        b.layer, b.held, b.origin, b.weights = layer, False, self._where(lay), None
        self.files.prefetch(list(dict.fromkeys(run.file for run in lay.runs)))
        b.batch = self.pool.submit(chunked(jobs, SPINE_CHUNK), AHEAD)
        return b

    def _where(self, layout: Layout) -> str:
        """"disk", or for a hub source "cache" / "network" (decided when the read is asked for)."""
        if self._origin is None or not layout.runs:
            return "disk"
        return self._origin(layout.runs[0].file)

    def _expert_layout(self, i: int, e: int) -> Layout:
        lay = self._expert_layouts.get((i, e))
        if lay is None:
            lay = self._expert_layouts[(i, e)] = make_layout(self.source.expert_infos(i, e),
                                                             _extent(self.source, "expert_extent", i, e))
        return lay


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


def _count(stats, origin: str, nbytes: int) -> None:
    if origin == "disk":
        stats.bytes_read += nbytes
    elif origin == "cache":
        stats.bytes_from_cache += nbytes
    else:
        stats.bytes_from_network += nbytes


def _extent(source, method: str, *args):
    """The source's one-read extent for a group, when it has one (a converted store does)."""
    f = getattr(source, method, None)
    return f(*args) if f is not None else None


def _shutdown(pool: ReadPool, files: Files) -> None:
    pool.shutdown()
    files.close()
