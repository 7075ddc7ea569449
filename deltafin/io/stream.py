"""The streaming provider: a model larger than RAM, read from disk layer by layer at disk speed.

What stays in memory: the globals (embeddings, final norm, lm_head, output attn-res), the first
``pin_layers`` spines, two spine buffers of the largest layer's size, and one buffer ("slot")
per expert read in one layer. None of it depends on the number of layers, and after the first
passes nothing is allocated per token.

Spine read-ahead: spine buffers A and B alternate. ``spine(i)`` is called only after layer i-1
finished computing and dropped its weights, so the buffer that held layer i-1 is free; the read
of the next streamed layer (wrapping to the next pass) goes into it while layer i computes from
the other one. The engine's views into a buffer are therefore never overwritten while in use.

Experts: ``experts(i, chosen)`` queues one read per expert (merged runs) at urgent priority and
returns a Future at once, so the engine computes the shared expert while the reads run. The
slots are reused at the next layer's ``experts`` call, after layer i finished.

Per pass it accounts bytes by where they come from (the model's files on disk, or for a hub
source its local cache or the network; RAM for pinned layers and the head), time blocked on
spines and on experts, and experts loaded into the engine's ``PassStats``.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future

from ..model.moe import chosen_experts
from ..settings import Settings
from .reader import AHEAD, SPINE_CHUNK, URGENT, AlignedBuffer, Batch, Files, Layout, ReadPool, chunked, \
    make_layout, views


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
        self.buf = AlignedBuffer(nbytes)
        self.layer: int | None = None  # layer being read (or read) into it
        self.origin = "disk"  # where its bytes come from (see _count)
        self.batch: Batch | None = None
        self.held = False  # handed to the engine for the layer computing now

    def settle(self) -> None:
        """Wait for an outstanding read (its result is no longer wanted) and forget it."""
        if self.batch is not None:
            try:
                self.batch.wait()
            except Exception:
                pass
        self.layer, self.batch, self.held = None, None, False


class StreamProvider:
    def __init__(self, source, settings: Settings, held: frozenset[int] = frozenset()):
        """``held``: layers whose spine a device provider keeps; they are never read here."""
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
        self._streamed = [i for i in range(self.pin_layers, L) if i not in held]
        size = max((self._spine_layouts[i].capacity for i in self._streamed), default=0)
        self._spine_bufs = [_SpineBuffer(size), _SpineBuffer(size)] if self._streamed else []

        self._slots: list[AlignedBuffer] = []
        self._expert_batch: Batch | None = None

    # -- the provider protocol ---------------------------------------------------------------
    def globals(self) -> dict:
        return self._globals

    def start_pass(self, stats) -> None:
        stats.bytes_from_ram += self._global_pass_bytes + self._embed_row_bytes * stats.tokens
        for b in self._spine_bufs:
            if b.held:  # the previous pass is over
                b.settle()
        if self._streamed:
            first = self._streamed[0]
            self._request(first)
            self._request(self._next_streamed(first), keep=first)

    def end_pass(self, stats) -> None:
        pass

    def spine(self, i: int, stats) -> dict:
        for b in self._spine_bufs:
            if b.held:  # layer i-1 is done with it
                b.settle()
        if i not in self._streamed:
            if i < self.pin_layers:
                stats.bytes_from_ram += self._spine_layouts[i].nbytes
            if self._streamed:
                self._request(self._next_streamed(i))
            return self._pinned[i] if i < self.pin_layers else {}
        b = self._request(i)
        b.held = True
        self._request(self._next_streamed(i))
        t0 = time.perf_counter()
        b.batch.wait()
        stats.spine_wait_seconds += time.perf_counter() - t0
        _count(stats, b.origin, self._spine_layouts[i].nbytes)
        return self.source.decode_spine(i, views(b.buf.mem, self._spine_layouts[i]))

    def experts(self, i: int, ids, stats) -> Future:
        """Read the experts routed to (``ids``: the router's tensor, or a list of expert ids)."""
        fut = _TimedFuture(stats)
        chosen = chosen_experts(ids)
        if self._expert_batch is not None:  # normally long done; after an error it may not be
            try:
                self._expert_batch.wait()
            except Exception:
                pass
        layouts = [self._expert_layout(i, e) for e in chosen]
        while len(self._slots) < len(layouts):  # more distinct experts than ever before (a prefill)
            self._slots.append(AlignedBuffer(layouts[len(self._slots)].capacity))
        jobs = []
        for k, lay in enumerate(layouts):
            if self._slots[k].nbytes < lay.size:  # an expert split into more runs than the others
                self._slots[k] = AlignedBuffer(lay.capacity)
            jobs += [(run, self._slots[k].mem, s) for run, s in zip(lay.runs, lay.starts)]
        for lay in layouts:
            _count(stats, self._where(lay), lay.nbytes)
        self.files.prefetch([lay.runs[0].file for lay in layouts if lay.runs])
        stats.experts_loaded += len(chosen)
        slots = self._slots[:len(layouts)]
        decode = self.source.decode_expert

        def finish(error):
            if error is not None:
                fut.set_exception(error)
                return
            try:
                fut.set_result({e: decode(i, e, views(s.mem, lay)) for e, s, lay in zip(chosen, slots, layouts)})
            except Exception as e:
                fut.set_exception(e)

        self._expert_batch = self.pool.submit(jobs, URGENT, finish)
        return fut

    # -- introspection -----------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Memory the provider holds, by part (independent of the layer count except `pinned`)."""
        out = {
            "globals": self._global_buf.nbytes,
            "pinned": sum(b.nbytes for b in self._pinned_bufs),
            "spine_buffers": sum(b.buf.nbytes for b in self._spine_bufs),
            "expert_slots": sum(s.nbytes for s in self._slots),
        }
        out["total"] = sum(out.values())
        return out

    def close(self) -> None:
        for b in self._spine_bufs:
            b.settle()
        if self._expert_batch is not None:
            try:
                self._expert_batch.wait()
            except Exception:
                pass
        self._finalizer()

    # -- internals ---------------------------------------------------------------------------
    def _read_now(self, layout: Layout, buf: AlignedBuffer) -> None:
        jobs = [(run, buf.mem, s) for run, s in zip(layout.runs, layout.starts)]
        self.pool.submit(chunked(jobs, SPINE_CHUNK), URGENT).wait()

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
        jobs = [(run, b.buf.mem, s) for run, s in zip(lay.runs, lay.starts)]
        b.layer, b.held, b.origin = layer, False, self._where(lay)
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
