"""The streaming provider: a model larger than RAM, read from disk layer by layer at disk speed.

It composes the parts that each hold one kind of memory:

- the globals (embeddings, final norm, lm_head, output attn-res), read here at load;
- ``spine_reader.SpineReader``: the first ``pin_layers`` spines, and two read-ahead buffers of the
  largest streamed layer's size;
- ``expert_reader.ExpertReader``: one buffer ("slot") per expert read in one layer;
- ``prefetch.Prefetcher`` (with ``prefetch`` on): buffers of the guessed experts, and
  ``prefetch.Guesses``, which says when each guess is made;
- a host-RAM cache (``io.ram_cache``, sized by the ``ram_budget`` setting through ``io.memory``)
  that keeps the spines of a fixed set of layers and the experts routed most often lately, as long
  as memory is free; what it holds is not read again, and it gives memory back under pressure.

What stays in memory: none of it depends on the number of layers but the pinned spines. With
``ram_budget 0`` there is no cache, and after the first passes nothing is allocated per token.
With a cache, the spine buffers follow the layers still streamed (none once every spine is held),
and expert slots beyond what the last pass needed are given back after it (a prefill may need one
per expert of a layer). The provider tells the cache what its own buffers take (``_note_fixed``)
whenever they may have changed, so that the budget covers both.

Read-ahead never overwrites a buffer in use: ``spine(i)`` is called only after layer i-1 finished
computing and dropped its weights, so the spine buffer that held layer i-1 is free for the next
read while layer i computes from the other one (see ``spine_reader``); the expert slots are reused
at the next layer's ``experts`` call, after layer i finished. ``experts(i, chosen)`` queues its
reads and returns a Future at once, so the engine computes the shared expert while they run.

Per pass it accounts bytes by where they come from (the model's files on disk, or for a hub
source its local cache or the network; RAM for pinned and cached layers and experts, and the
head), time blocked on spines and on experts, and experts loaded (and of them, served by the
cache) into the engine's ``PassStats``.
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future

from ..kernels import cpu_native
from ..kernels.experts_cpu import held_table
from ..model.moe import chosen_experts
from ..settings import Settings
from .expert_reader import ExpertReader
from .memory import WATCH_INTERVAL_S, MemoryBudget, Watcher
from .origin import ReadOrigin
from .prefetch import Guesses, Prefetcher
from .ram import HeldExperts, spine_in_cpu_layout
from .ram_cache import RamCache
from .reader import AlignedBuffer, Files, ReadPool, align_up, expert_layout, globals_layout, read_now, \
    spine_layout, views
from .spine_reader import SpineReader


class StreamProvider:
    def __init__(self, source, settings: Settings, held: frozenset[int] = frozenset(), cache: bool = True,
                 memory_root: str = "/", watch: bool = True, layers: range | None = None,
                 with_globals: bool = True, new_buffer=AlignedBuffer, cpu_layout: bool = False):
        """``held``: layers whose spine a device provider keeps; they are never read here.
        ``layers``: the layers whose weights are read (default all; a rank of a split model reads its
        own; ``pin_layers`` then pins only where the range starts at the first layer);
        ``with_globals``: whether the embedding, head and final norm are read too.
        ``cache``: whether a host-RAM cache may be kept (as ``settings.ram_budget`` says);
        ``memory_root``: the file tree memory is read from (``/``; tests give a tree they write);
        ``watch``: check memory from a thread a few times a second (else only ``watcher.check()``);
        ``new_buffer(nbytes)``: makes every buffer the streamer and its cache read into (a device
        provider's are pinned memory, so copies out of them to the device are asynchronous);
        ``cpu_layout``: the weights are computed on the CPU: what stays in RAM for good (the globals,
        pinned spines, what the cache keeps) is laid out as its products read it fastest (io/ram.py)."""
        self.source = source
        cfg = self.config = source.config
        self.settings = settings
        # A hub source reads through its cache, which fetches what is missing first.
        make_files = getattr(source, "make_files", None)
        self.files = make_files(settings.read_mode) if make_files is not None else Files(settings.read_mode)
        origin = ReadOrigin(source)
        self.pool = ReadPool(self.files, settings.io_workers)
        # The worker threads stop when the provider is dropped (they do not reference it).
        self._finalizer = weakref.finalize(self, _shutdown, self.pool, self.files)

        L = cfg.num_layers
        layers = range(L) if layers is None else layers
        layouts = [spine_layout(source, i) for i in range(L)]
        self._global_buf: AlignedBuffer | None = None
        self._globals, self._embed_row_bytes, self._global_pass_bytes = {}, 0, 0
        if with_globals:
            glayout = globals_layout(source)
            self._global_buf = new_buffer(glayout.capacity)
            read_now(self.pool, glayout, self._global_buf)
            self._globals = source.decode_globals(views(self._global_buf.mem, glayout))
            if cpu_layout:
                self._globals = spine_in_cpu_layout(self._globals)
            embed = self._globals["embed"]
            self._embed_row_bytes = embed.shape[1] * embed.element_size()
            # Per pass the whole of every global but the embedding is used; of the embedding, one row per token.
            self._global_pass_bytes = glayout.nbytes - embed.numel() * embed.element_size()

        self._layers = layers
        self.cpu_layout = cpu_layout
        pin_layers = min(settings.pin_layers, layers.stop) if layers.start == 0 else 0
        # the layers whose spine is read
        self.streamable = [i for i in layers if i >= pin_layers and i not in held]
        ceiling = settings.ram_budget_bytes()
        self.cache: RamCache | None = None
        moe = [i for i in layers if cfg.is_moe(i)]
        # A cache is worth having while anything is read per pass: spines, or routed experts (under a
        # device that holds every spine, the experts alone).
        if cache and ceiling != 0 and (self.streamable or moe):
            self.cache = RamCache([align_up(layouts[i].capacity) if i in self.streamable else 0 for i in range(L)],
                                  [align_up(expert_layout(source, i, 0).capacity) if i in moe else 0
                                   for i in range(L)], cfg.num_experts, new_buffer=new_buffer,
                                  cpu_layout=cpu_layout)
        self._spines = SpineReader(source, self.pool, self.files, origin, layouts, pin_layers, self.streamable,
                                   self.cache, new_buffer, cpu_layout)
        self._experts = ExpertReader(source, self.pool, self.files, origin, self.cache, cfg.experts_per_token,
                                     new_buffer)
        self.prefetcher: Prefetcher | None = None
        self._guesses: Guesses | None = None
        if settings.prefetch != "off" and any(cfg.is_moe(i) for i in range(L)):
            self.prefetcher = Prefetcher(self.pool, self._experts.layout, source.decode_expert, self.cache,
                                         guesses=cfg.experts_per_token, new_buffer=new_buffer)
            self._guesses = Guesses(cfg, settings.prefetch, self.prefetcher, self._spines.in_memory)

        # Views of what the cache holds for good, for the CPU's one-call layers and replayed passes
        # (``held``), made again when it changes; ``on_drop`` callbacks let go of theirs when it drops any.
        self._held_version = -1
        self._held_all: tuple | None = None
        self._held_layers: dict[int, HeldExperts | bool] = {}  # False: held, not as one table
        self.on_drop: list = []
        self.watcher: Watcher | None = None
        if self.cache is not None:
            self.cache.on_drop.append(self._forget_held)
            self._note_fixed()
            budget = MemoryBudget(ceiling, memory_root)
            self.budget_line = budget.describe(self.cache.fixed_bytes)
            self.watcher = Watcher(budget, self.cache, WATCH_INTERVAL_S if watch else None)
            self.watcher.check()
        else:
            self.budget_line = ("ram budget 0: no cache (every streamed byte is read per token)" if ceiling == 0
                                else "")

    # -- the provider protocol ---------------------------------------------------------------
    def globals(self) -> dict:
        return self._globals

    def start_pass(self, stats) -> None:
        stats.bytes_from_ram += self._global_pass_bytes + self._embed_row_bytes * stats.tokens
        self._spines.release()  # the previous pass is over
        if self._guesses is not None:
            self._guesses.start_pass(stats)
        self._spines.start_pass()

    def end_pass(self, stats) -> None:
        if self.cache is not None:
            # Slots a larger pass (a prefill) needed go back to the budget; a decode pass keeps its own.
            freed = self._experts.end_pass()
            self._note_fixed()
            self.cache.repay(freed)
            if self.cpu_layout:
                self._fill(stats)

    def spine(self, i: int, stats) -> dict:
        self._spines.release()  # layer i-1 is done with its buffer
        if self._guesses is not None:
            self._guesses.before_spine(i, stats)
        held = self._spines.held(i, stats)
        if held is not None or i not in self.streamable:
            self._spines.skip(i)
            return held if held is not None else {}
        b = self._spines.begin(i)
        self._note_fixed()  # the read-ahead may have made a buffer anew
        weights, kept = self._spines.finish(b, stats)
        if kept:  # its buffer went to the cache (and with the last spine, the other one went too)
            self._note_fixed()
        return weights

    def experts(self, i: int, ids, stats, residual=None) -> Future:
        """Read the experts routed to (``ids``: the router's tensor, or a list of expert ids).
        ``residual``: the layer's residual stream at its MoE (rows of this pass), from which the
        ``early`` prefetch guesses the next MoE layer's experts."""
        chosen = chosen_experts(ids)
        stats.experts_loaded += len(chosen)
        stats.experts_streamed += len(chosen)
        got = self._experts.cached(i, chosen, stats)
        under_way = self._guesses.routed(i, ids, chosen, got, stats) if self._guesses is not None else {}
        missing = [e for e in chosen if e not in got and e not in under_way]
        fut = self._experts.read(i, missing, got, under_way, stats)
        if self._guesses is not None and residual is not None:
            self._guesses.after_experts(i, residual, stats)
        self._note_fixed()
        return fut

    def held_experts(self, i: int) -> HeldExperts | None:
        """Every expert of layer i while the cache holds them all, laid out for the CPU's products
        (``io.ram.RAMProvider.held_experts``; the caller tells the choice with ``count_experts``); else
        None (they are asked for with ``experts``)."""
        if not self.cpu_layout or self.cache is None or not cpu_native.available():
            return None
        self._follow_held()
        got = self._held_layers.get(i)
        if got is None:
            whole = self.cache.whole_layer(i)
            if whole is None:
                return None
            got = HeldExperts(whole)
            # Only as one native table. A layer whose experts were kept before the cache held them all is
            # partly in the store's layout: laid out now, once (else its products go expert by expert).
            if held_table(got) is None and self.cache.lay_out_experts(i):
                self._follow_held()  # the cache changed: every view made before is gone
                whole = self.cache.whole_layer(i)
                got = HeldExperts(whole) if whole is not None else None
            self._held_layers[i] = got = got if got is not None and held_table(got) is not None else False
        return got or None

    def held(self) -> tuple[dict, list[dict], list[dict]] | None:
        """The weights themselves while RAM holds all of them (the cache every streamed spine and every
        expert: a model that fits once the cache is warm), as ``io.ram.RAMProvider.held`` hands them
        out; else None. They stay valid until the cache drops any (``on_drop`` says when)."""
        if not self.cpu_layout or self.cache is None:
            return None
        self._follow_held()
        if self._held_all is None:
            cfg = self.config
            spines, experts = [{} for _ in range(cfg.num_layers)], [{} for _ in range(cfg.num_layers)]
            for i in self._layers:
                spines[i] = self._spines.in_ram(i)
                if spines[i] is None:
                    return None
                if cfg.is_moe(i):
                    experts[i] = self.held_experts(i)
                    if experts[i] is None:
                        return None
            self._held_all = (self._globals, spines, experts)
        return self._held_all

    def count_experts(self, i: int, ids, stats) -> None:
        """Account the experts of layer i that a routing over ``held_experts`` chose, as ``experts``
        accounts cache hits (the cache's scores learn the choice too)."""
        chosen = chosen_experts(ids)
        stats.experts_loaded += len(chosen)
        stats.experts_streamed += len(chosen)
        self._experts.cached(i, chosen, stats)

    def above(self, i: int, e: int, held: bool) -> None:
        """Whether a tier above (the device) holds expert e of layer i now (see ``RamCache.above``)."""
        if self.cache is not None:
            self.cache.above(i, e, held)

    # -- introspection -----------------------------------------------------------------------
    def spine_in_ram(self, i: int) -> dict | None:
        """Layer i's spine if RAM holds it for good (pinned or cached; not a read-ahead buffer, which
        is reused): what a device provider may copy ahead of the layer."""
        return self._spines.in_ram(i)

    def spine_buffers(self) -> list[AlignedBuffer]:
        """The spine read-ahead buffers now (the engine's spine weights view them)."""
        return self._spines.buffers()

    def expert_buffers(self) -> list[AlignedBuffer]:
        """The expert read buffers ("slots") now; a pass that reads more experts of a layer than
        any before makes more."""
        return self._experts.buffers()

    def resident_bytes(self) -> dict[str, int]:
        """Memory the provider holds, by part (independent of the layer count except `pinned`)."""
        out = {
            "globals": self._global_buf.nbytes if self._global_buf is not None else 0,
            "pinned": self._spines.pinned_bytes(),
            "spine_buffers": self._spines.buffer_bytes(),
            "expert_slots": self._experts.slot_bytes(),
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
        self._spines.close()
        self._experts.close()
        self._finalizer()

    # -- internals ---------------------------------------------------------------------------
    def _fill(self, stats) -> None:
        """Once the cache's plan holds the whole model, read the experts no pass has chosen yet, one
        layer's at a time behind the passes' own reads: a layer computes in one native call, and a
        pass replays, only while every expert of the model is held (``held``), and an expert the
        routers seldom choose may take thousands of tokens to come by itself."""
        failed = self._experts.unfillable
        for i in self._layers:
            missing = [e for e in self.cache.missing_experts(i) if (i, e) not in failed]
            if missing:
                self._experts.fill(i, missing, stats)
                return

    def _follow_held(self) -> None:
        """Drop the views of ``held`` made before the cache last changed (what it took in since
        may complete them)."""
        version = self.cache.held_version
        if version != self._held_version:
            self._held_version = version
            self._held_all, self._held_layers = None, {}

    def _forget_held(self) -> None:
        """The cache dropped something (under its lock, maybe on the watcher's thread): let go of
        every view of what it held, here and wherever ``on_drop`` says, so its memory goes back."""
        self._held_all, self._held_layers = None, {}
        for drop in self.on_drop:
            drop()

    def _note_fixed(self) -> None:
        """Tell the cache what the streamer's own buffers take now (the budget follows their
        recent peak), without the extra expert slots of a long pass (a prefill), which
        ``make_room`` already took from the cache and ``end_pass`` gives back, and without the
        spine read-ahead buffers, which the cache's plan counts with the spines (``ring_bytes``)."""
        if self.cache is not None:
            held = self.resident_bytes()
            self.cache.ring_bytes = held["spine_buffers"]
            self.cache.fixed_bytes = held["total"] - self._experts.extra_slot_bytes() - held["spine_buffers"]


def _shutdown(pool: ReadPool, files: Files) -> None:
    pool.shutdown()
    files.close()
