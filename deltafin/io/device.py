"""The device provider: weights in a CUDA (or MPS) device's memory, as much as its budget holds.

What stays on the device, from load on (``placement.plan`` decides): the globals except the
embedding table (a pass needs one row of it per token, looked up on the host), the spines of a
fixed set of layers, and in each MoE layer either every expert (plain experts are stacked for
the grouped kernels, ``kernels.grouped``) or up to ``expert_slots`` experts, the ones routed most
often so far (``placement.ExpertSlots``; an expert enters a slot when it had to be fetched
anyway, so keeping it costs no extra copy). Memory is given back only when the provider is
dropped, or when a held expert is displaced by one routed more often.

Everything else comes from the streamer (``io.stream``) and its host-RAM cache: disk -> page-aligned
buffers, every one of which (read-ahead, expert slots, the cache's spines and experts) is made as
pinned memory (``PinnedBuffer``), so the O_DIRECT reads land in memory the device can copy from
asynchronously and a cache hit is copied straight from the cache -> device, on a dedicated copy
stream. The host-RAM cache is told which experts the device's slots hold (``above``): its copies of
those are the first it gives up for room, so under a tight RAM budget the two tiers hold different
experts, and with room to spare an expert the device lets go is still in RAM. The compute stream waits for a copy's
event; the host never waits for a copy except before the streamer reuses the buffer copied from:
it reuses a spine buffer when the next spine is asked for and its expert slots at the next
experts call, so both calls first wait for the last copy out of them (normally long finished:
the copy was queued a layer earlier). Tensors made on the copy stream are marked as used by the
compute stream, so the allocator does not hand their memory out again before the layer ran.

Experts computed where they lie (``cpu_experts``): in a pass of few rows (a decode), the experts
the host serves and the device's slots do not take stay in host memory, and the MoE layer computes
them on the host's cores from the rows it sends down (``model.moe``), while the device computes the
rest; their weights never cross PCIe. ``auto`` decides per layer from the first pass that has such
experts: the time the host's products of one row with all of them take in one call (plus a round
trip of the rows) against the time the copy stream would be busy meanwhile: copying them (one copy
timed on the stream) and the spine it copies ahead. Timed one at a time, the
host's product left most of its threads idle and lost (1.1-3.9 ms against a 0.46 ms copy of a
17.5 MB MXFP4 expert on the H200 host), while in a pass the host computed them at ~0.18 ms each and
the decode ran 1.6x faster than with copies. Prompt passes always copy (many rows: the device's
products win there).

Accounted per pass: bytes read from device-resident weights (``bytes_on_device``), bytes copied
host -> device (``bytes_to_device``) and experts computed on the host (``bytes_host_compute``),
besides what the streamer accounts (disk reads, waits).

On MPS (untested: no such machine was available) copies go through the same code without a copy
stream: ``.to(device)``, which orders itself with the compute queue.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future

import torch

from ..model.layers import NOT_PRODUCTS
from ..kernels.grouped import ExpertStack, MXFP4Stack, Stacked
from ..kernels.linear import QWeight
from ..checkpoint.sizes import ModelSizes
from ..model.moe import chosen_experts
from ..units import GB, GiB
from .placement import ExpertSlots, Placement, plan, require_everything
from .ram import done
from .reader import AlignedBuffer, align_up


def _tensors(w):
    if isinstance(w, QWeight):
        return list(w.tensors.values())
    if isinstance(w, tuple):
        return [t for x in w for t in _tensors(x)]
    return [w] if isinstance(w, torch.Tensor) else []


def _move(w, device, non_blocking: bool = False):
    """A copy of `w` on `device` (a copy also where it is there already: the streamer's buffers are
    reused, what is held must not be)."""
    if isinstance(w, QWeight):
        return QWeight(w.codec, w.shape, w.group_size,
                       {k: t.to(device, non_blocking=non_blocking, copy=True) for k, t in w.tensors.items()})
    if isinstance(w, tuple):
        return tuple(_move(x, device, non_blocking) for x in w)
    return w.to(device, non_blocking=non_blocking, copy=True)


def _move_all(w, device, non_blocking: bool = False):
    """``_move`` of `w`, or of each value of a dict."""
    if isinstance(w, dict):
        return {k: _move(x, device, non_blocking) for k, x in w.items()}
    return _move(w, device, non_blocking)


# Small weights that are not matrix products (norm weights, biases, gate taps, depth-mix queries)
# are converted to float32 wherever they are used; a held one on CUDA is kept in float32 instead (the
# same values: widening is exact), which saves a conversion kernel per use and pass.
SMALL_WEIGHT = 1 << 20


def _held(name: str, w, device: torch.device):
    """`w` moved to `device` to be held there (see SMALL_WEIGHT)."""
    if (device.type == "cuda" and isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16)
            and (w.dim() <= 1 or w.shape[0] == 1 or (name in NOT_PRODUCTS and w.numel() <= SMALL_WEIGHT))):
        return w.to(device, torch.float32)
    return _move(w, device)


# The most rows a pass may have for its host-served experts to be computed on the host (cpu_experts).
HOST_ROWS = 8
# What sending a layer's rows to the host and the sum back adds to the host's products (two small
# copies and a wait; measured on the H200 host at ~30-60 us), counted against the host in ``auto``.
HOST_ROUND_TRIP_S = 60e-6

# Device memory left free under an automatic budget: decode states, activations, the allocator's
# rounding and the streamed layers' transient copies.
HEADROOM_MIN = 2 * GiB
HEADROOM_FRACTION = 0.04


def device_headroom(total: int) -> int:
    """Bytes of a device of `total` bytes left free under an automatic budget."""
    return max(HEADROOM_MIN, int(HEADROOM_FRACTION * total))


def device_budget(settings, device: torch.device) -> tuple[int, str]:
    """(budget bytes, how it was set) for weights on `device`."""
    given = settings.gpu_budget_bytes()
    if given is not None:
        return given, f"gpu_budget={settings.gpu_budget} GB"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    elif device.type == "mps":
        total = torch.mps.recommended_max_memory()
        free = total - torch.mps.driver_allocated_memory()
    else:
        import psutil
        free = total = psutil.virtual_memory().available
    headroom = device_headroom(total)
    return max(0, free - headroom), (f"auto: {free / GB:.1f} GB free - {headroom / GB:.1f} GB headroom")


def device_placement(source, settings, device: torch.device, stream: str, layers: range | None = None,
                     with_globals: bool = True) -> tuple[Placement, str]:
    """The device's plan for `source` and a start-up line; stream 'off' refuses a model that does not fit.
    `layers` / `with_globals`: a rank of a model split across processes, which holds its layers (and
    rank 0 the globals) whole on its device, or refuses to start."""
    budget, how = device_budget(settings, device)
    sizes = ModelSizes.of(source)
    if layers is not None:
        sizes = sizes.restricted(layers, with_globals)
    p = plan(sizes, budget, str(device))
    if layers is not None:
        require_everything(p, how, "a rank on a GPU holds its layers whole: start more ranks (--placement sets "
                                   "their layers) or give this one a larger --gpu-budget")
    elif stream == "off":
        require_everything(p, how)
    return p, f"{p.describe()}; budget {how}"


class PinnedBuffer(AlignedBuffer):
    """An AlignedBuffer registered as pinned (page-locked) memory while it lives, so that copies out
    of it to the device are asynchronous DMA. The registration ends before the mapping does: when the
    buffer is dropped (a cache gives memory back) its finalizer first waits for the copy stream (no
    copy may still read from it), then unregisters; the mapping goes with the last view of it.
    (A registration that outlived its memory would make a new buffer mapped at the same address
    impossible to register.) Registering costs about what touching every page does: once per buffer."""

    def __init__(self, nbytes: int, stream, registry: weakref.WeakSet):
        super().__init__(nbytes)
        self._stream = stream
        _register(self._map, self.nbytes)
        self._finalizer = weakref.finalize(self, _unregister_map, stream, self._map)
        registry.add(self)

    def trim(self, nbytes: int) -> None:
        # Pages given back while registered would stay locked (and the device would go on reading
        # the old ones): register the smaller range instead.
        if align_up(max(nbytes, 1)) < self.nbytes:
            self._finalizer()
            super().trim(nbytes)
            _register(self._map, self.nbytes)
            self._finalizer = weakref.finalize(self, _unregister_map, self._stream, self._map)

    def release(self) -> None:
        self._finalizer()


def _map_address(m) -> int:
    return torch.frombuffer(m, dtype=torch.uint8).data_ptr()


def _register(m, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(_map_address(m), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"registering a {nbytes}-byte read buffer as pinned memory failed (CUDA error {int(err)})")


def _unregister_map(stream, m) -> None:
    try:
        stream.synchronize()  # no copy may still read from it
        torch.cuda.cudart().cudaHostUnregister(_map_address(m))
    except Exception:  # at interpreter exit CUDA may be gone before the buffer: nothing left to do
        pass


class _Copier:
    """Host -> device copies on a dedicated stream (CUDA) whose events the compute stream waits on,
    and the host buffers they copy from (pinned on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pinned: weakref.WeakSet = weakref.WeakSet()

    def buffer(self, nbytes: int) -> AlignedBuffer:
        """A host buffer to read weights into (pinned memory where copies can use it)."""
        if self.stream is None:
            return AlignedBuffer(nbytes)
        return PinnedBuffer(nbytes, self.stream, self._pinned)

    def pinned(self) -> tuple[int, int]:
        """(buffers, bytes) registered as pinned memory now."""
        bufs = list(self._pinned)
        return len(bufs), sum(b.nbytes for b in bufs)

    def copy(self, w, now: bool = True):
        """`w` (tensors / QWeights, dict or tuple) on the device; (moved, event or None). The compute
        stream waits for the copy from here on, or (`now` False: a copy ahead of its use) from
        ``use(event)`` on."""
        if self.stream is None:
            return _move_all(w, self.device), None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = _move_all(w, self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if now:
            compute.wait_event(event)
        for t in _tensors(tuple(moved.values()) if isinstance(moved, dict) else moved):
            t.record_stream(compute)
        return moved, event

    def time_copy(self, w) -> float:
        """Seconds the copy of `w` takes on the copy stream itself (not counting the copies queued
        before it: a spine copied ahead may be crossing)."""
        if self.stream is None:
            t0 = time.perf_counter()
            self.copy(w)
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self.copy(w)
        end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def use(self, event) -> None:
        """The compute stream waits for a copy made ahead (``copy(w, now=False)``) from here on."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def close(self) -> None:
        for b in list(self._pinned):
            b.release()


def _wait(event) -> None:
    if event is not None:
        event.synchronize()


class DeviceProvider:
    def __init__(self, source, settings, placement: Placement, layers: range | None = None,
                 with_globals: bool = True):
        """``layers``: the layers whose weights it holds (default all; a rank of a split model holds
        its own, whole: ``device_placement``); ``with_globals``: the embedding, head and final norm too."""
        self.config = cfg = source.config
        self.placement = placement
        self.layers = range(cfg.num_layers) if layers is None else layers
        self.device = settings.torch_device()
        # bf16 products (--dtype bfloat16): stacked bf16 experts may take the bf16 grouped GEMMs
        self._bf16_products = settings.torch_dtype() == torch.bfloat16
        self._copier = _Copier(self.device)
        sizes = placement.sizes
        g = source.read_globals() if with_globals else {}
        self._globals = {k: w if k == "embed" else _held(k, w, self.device) for k, w in g.items()}
        self._spines = {}
        self._stacks: dict[int, Stacked] = {}  # layers whose experts are all held, stacked
        self._all: dict[int, dict] = {}  # layers whose experts are all held, per expert (other codecs)
        self._slots = ExpertSlots(placement.expert_slots if placement.expert_slots < sizes.num_experts else 0)
        for i in self.layers:
            if i in placement.spine_layers:
                self._spines[i] = {k: _held(k, w, self.device) for k, w in source.read_spine(i).items()}
            if cfg.is_moe(i) and placement.expert_slots >= sizes.num_experts:
                self._hold_all_experts(source, i)
        self._spine_bytes = sizes.spine_bytes
        self._expert_bytes = sizes.expert_bytes
        self._host = None
        if not placement.everything:
            from .stream import StreamProvider
            # The globals are the device's (and its embedding table): the streamer reads none (its
            # copy took the embedding and head a second time, in pinned memory, out of the RAM budget).
            self._host = StreamProvider(source, settings, held=placement.spine_layers, with_globals=False,
                                        new_buffer=self._copier.buffer)
        # Per MoE layer, whether host-served experts of small passes are computed on the host.
        self._cpu_experts = settings.cpu_experts if self.device.type != "cpu" else "off"
        self._host_compute: dict[int, bool] = {}
        self.host_choices: dict[int, dict] = {}  # auto's measurements, per layer
        self._spine_copy = None  # event of the last copy out of a streamer spine buffer
        # The layers whose spines cross to the device each pass, and the one copied ahead (below).
        self._streamed = [i for i in self.layers if i not in self._spines] if self._host else []
        self._ahead: tuple[int, dict, object] | None = None
        self.spines_copied_ahead = 0  # of those used
        self._expert_copy = None  # ... and out of its expert slots

    @property
    def streaming(self) -> bool:
        return self._host is not None

    @property
    def graph_ready(self) -> bool:
        """Every weight is held and every MoE layer's experts are stacked: a one-token pass reads
        nothing back to the host, so it can be recorded as a CUDA graph (decode_graph.py)."""
        moe = sum(1 for i in self.layers if self.config.is_moe(i))
        return self._host is None and len(self._stacks) == moe

    @property
    def stacks_take_any_rows(self) -> bool:
        """Every MoE layer's experts are stacked where the grouped GEMMs take them (any number of rows
        without a read-back: a recorded pass may carry more rows, decode_graph.MAX_GRAPH_ROWS)."""
        return self.graph_ready and all(s.sorted_gemm() for s in self._stacks.values())

    def _hold_all_experts(self, source, i: int) -> None:
        first = source.read_expert(i, 0)
        if all(isinstance(w, torch.Tensor) for w in first):
            w1, w3, w2 = first
            stack = ExpertStack(torch.empty((self.config.num_experts, 2 * w1.shape[0], w1.shape[1]), dtype=w1.dtype,
                                            device=self.device),
                                torch.empty((self.config.num_experts, *w2.shape), dtype=w2.dtype, device=self.device),
                                bf16_products=self._bf16_products)
            inter = w1.shape[0]
            for e in range(self.config.num_experts):
                w1, w3, w2 = first if e == 0 else source.read_expert(i, e)
                stack.w13[e, :inter].copy_(w1)
                stack.w13[e, inter:].copy_(w3)
                stack.w2[e].copy_(w2)
            self._stacks[i] = stack
        else:
            held = [_move(first if e == 0 else source.read_expert(i, e), self.device)
                    for e in range(self.config.num_experts)]
            if all(isinstance(w, QWeight) and w.codec == "mxfp4" for w in held[0]):
                self._stacks[i] = MXFP4Stack.from_experts(held)
            else:
                self._all[i] = dict(enumerate(held))

    # -- the provider protocol ---------------------------------------------------------------
    def globals(self) -> dict:
        return self._globals

    def start_pass(self, stats) -> None:
        if self._host is not None:
            _wait(self._spine_copy)
            self._host.start_pass(stats)

    def end_pass(self, stats) -> None:
        if self._host is not None:
            self._host.end_pass(stats)

    def spine(self, i: int, stats) -> dict:
        if self._host is not None:
            _wait(self._spine_copy)  # the streamer may now reuse the buffer last copied from
            host = self._host.spine(i, stats)  # for a held layer: only moves the read-ahead on
        if i in self._spines:
            stats.bytes_on_device += self._spine_bytes[i]
            return self._spines[i]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == i:
            moved = ahead[1]
            self._copier.use(ahead[2])
            self.spines_copied_ahead += 1
        else:
            moved, self._spine_copy = self._copier.copy(host)
        stats.bytes_to_device += self._spine_bytes[i]
        self._copy_ahead(i)
        return moved

    def _copy_ahead(self, i: int) -> None:
        """Queue the copy of the next streamed layer's spine (wrapping to the next pass) now, if RAM
        holds it: the copy stream then always has a spine to move while layer i's attention runs and
        its routing comes back, instead of idling until layer i+1 asks. Only spines RAM holds for
        good are copied ahead (a read-ahead buffer is reused; a cached spine the cache gives up stays
        mapped until the copy drained, see PinnedBuffer). One spine's copy more is on the device at a
        time, which the automatic budget's headroom covers."""
        if self._copier.stream is None or not self._streamed:
            return
        j = next((j for j in self._streamed if j > i), self._streamed[0])
        w = self._host.spine_in_ram(j)
        if w:
            moved, event = self._copier.copy(w, now=False)
            self._ahead = (j, moved, event)

    def experts(self, i: int, ids, stats, residual=None) -> Future:
        stack = self._stacks.get(i)
        if stack is not None:
            # Every expert is here: no need to read the routing back. Counted as the pass's (token, expert)
            # pairs, at most the layer's experts: exact for one token (a token's top-k experts are
            # distinct) and for a batch that chose every expert, between those an upper bound (the
            # union of the rows' choices stays on the device).
            n = min(ids.numel() if isinstance(ids, torch.Tensor) else len(ids), len(stack))
            stats.bytes_on_device += n * self._expert_bytes[i]
            stats.experts_loaded += n
            return done(stack)
        chosen = chosen_experts(ids)
        held = self._all.get(i)
        if held is not None:
            stats.experts_loaded += len(chosen)
            stats.bytes_on_device += len(chosen) * self._expert_bytes[i]
            return done({e: held[e] for e in chosen})
        self._slots.routed(i, chosen)
        got = {e: w for e in chosen if (w := self._slots.get(i, e)) is not None}
        missing = [e for e in chosen if e not in got]
        stats.bytes_on_device += len(got) * self._expert_bytes[i]
        stats.experts_loaded += len(got)  # the streamer counts the ones it reads
        if not missing:
            return done(got)
        _wait(self._expert_copy)  # the streamer reuses its expert slots in this call
        pending = self._host.experts(i, missing, stats, residual)
        rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        return _Arriving(self, i, pending, got, stats, self._cpu_experts != "off" and rows <= HOST_ROWS)

    def _on_host(self, i: int, rest: dict) -> bool:
        """Whether layer i computes its host-served experts on the host (``auto``: measured on the
        first pass's `rest`, expert id -> weights)."""
        if self._cpu_experts == "on":
            return True
        if i not in self._host_compute:
            # Copies cost the same per expert (one is timed); the host's products are timed together,
            # as a pass runs them (one expert alone leaves most of the host's threads idle).
            one = self._copier.time_copy(next(iter(rest.values())))
            copy_s = one * len(rest)
            host_s = _time_host_product(rest)
            # While the host computes, the copy stream moves the spine copied ahead: the host's
            # products hide under that copy as well as under the experts' own.
            busy_s = one / self._expert_bytes[i] * self._spine_bytes[self._ahead[0]] if self._ahead else 0.0
            self._host_compute[i] = host_s + HOST_ROUND_TRIP_S < copy_s + busy_s
            self.host_choices[i] = {"experts": len(rest), "copy_s": copy_s, "spine_copy_s": busy_s,
                                    "host_s": host_s, "host": self._host_compute[i]}
        return self._host_compute[i]

    # -- introspection -----------------------------------------------------------------------
    def residency(self) -> dict:
        """What the device holds (the plan, and how many expert slots are filled now)."""
        out = self.placement.summary()
        out["experts_held"] = (self._slots.held_count()
                               + self.config.num_experts * (len(self._stacks) + len(self._all)))
        out["grouped_expert_layers"] = len(self._stacks)
        out["pinned_host_buffers"], out["pinned_host_bytes"] = self._copier.pinned()
        if self._host is not None:
            out["spines_copied_ahead"] = self.spines_copied_ahead
            out["cpu_experts"] = self._cpu_experts
            if self.host_choices:
                out["host_compute_layers"] = sorted(i for i, c in self.host_choices.items() if c["host"])
                out["host_choices"] = self.host_choices
            host = self._host.residency()
            if host:
                out["host"] = host
        return out

    def resident_bytes(self) -> dict[str, int]:
        out = {"device": self.placement.held_bytes}
        if self._host is not None:
            out.update(self._host.resident_bytes())
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return out

    def close(self) -> None:
        self._ahead = None
        if self._host is not None:
            self._host.close()
        self._copier.close()


class _Arriving:
    """Experts of one layer: the held ones now, the fetched ones once read and copied to the device
    (`host_ok`: those the device's slots do not take may stay on the host, see ``cpu_experts``)."""

    def __init__(self, provider: DeviceProvider, i: int, pending, held: dict, stats, host_ok: bool):
        self.provider, self.i, self.pending, self.held, self.stats = provider, i, pending, held, stats
        self.host_ok = host_ok

    def result(self) -> dict:
        got = self.pending.result()  # the streamer's expert wait is accounted by the streamer
        p, i = self.provider, self.i
        before = set(p._slots.held.get(i, {}))
        stay, admitted = {}, None
        if self.host_ok and got:
            # Those the device's slots take are copied (the device keeps them); the others may stay.
            admitted = {e for e in got if p._slots.admit(i, e)}
            rest = {e: w for e, w in got.items() if e not in admitted}
            if rest and p._on_host(i, rest):
                stay, got = rest, {e: got[e] for e in admitted}
        t0 = time.perf_counter()
        moved, p._expert_copy = p._copier.copy(got) if got else ({}, p._expert_copy)
        self.stats.expert_wait_seconds += time.perf_counter() - t0
        self.stats.bytes_to_device += len(got) * p._expert_bytes[i]
        self.stats.bytes_host_compute += len(stay) * p._expert_bytes[i]
        for e, w in moved.items():
            if admitted is None:
                p._slots.offer(i, e, w)
            elif e in admitted:
                p._slots.put(i, e, w)
        after = set(p._slots.held.get(i, {}))
        for e in after - before:
            p._host.above(i, e, True)
        for e in before - after:
            p._host.above(i, e, False)
        return {**self.held, **moved, **stay}


def _time_host_product(experts: dict) -> float:
    """Seconds the host's products of one row with each of `experts` (id -> (w1, w3, w2)) take, in
    one call as a pass makes it (the second of two runs: the first touches the weights)."""
    from ..kernels import experts_cpu
    w1 = next(iter(experts.values()))[0]
    x = torch.zeros(1, w1.shape[1], dtype=torch.float32)
    ids = torch.tensor([sorted(experts)], dtype=torch.long)
    one = torch.ones(ids.shape, dtype=torch.float32)
    for _ in range(2):
        t0 = time.perf_counter()
        if experts_cpu.routed(lambda g, u: g * u, x, ids, one, experts) is None:
            return float("inf")  # no native product for it here
        seconds = time.perf_counter() - t0
    return seconds

