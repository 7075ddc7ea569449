"""The device provider: weights in a CUDA (or MPS) device's memory, as much as its budget holds.

What stays on the device, from load on (``placement.plan`` decides): the globals except the
embedding table (a pass needs one row of it per token, looked up on the host), the spines of a
fixed set of layers, and in each MoE layer either every expert (plain experts are stacked for
the grouped kernels, ``kernels.grouped``) or up to ``expert_slots`` experts, the ones routed most
often so far (``placement.ExpertSlots``; an expert enters a slot when it had to be fetched
anyway, so keeping it costs no extra copy). Memory is given back only when the provider is
dropped, or when a held expert is displaced by one routed more often.

Everything else comes from the streamer (``io.stream``): disk -> its page-aligned buffers, which
this provider registers as pinned memory so the O_DIRECT reads land in memory the device can copy
from asynchronously -> device, on a dedicated copy stream. The compute stream waits for a copy's
event; the host never waits for a copy except before the streamer reuses the buffer copied from:
it reuses a spine buffer when the next spine is asked for and its expert slots at the next
experts call, so both calls first wait for the last copy out of them (normally long finished:
the copy was queued a layer earlier). Tensors made on the copy stream are marked as used by the
compute stream, so the allocator does not hand their memory out again before the layer ran.

Accounted per pass: bytes read from device-resident weights (``bytes_on_device``) and bytes
copied host -> device (``bytes_to_device``), besides what the streamer accounts (disk reads,
waits).

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


# Device memory left free under an automatic budget: decode states, activations, the allocator's
# rounding and the streamed layers' transient copies.
HEADROOM_MIN = 2 * GiB
HEADROOM_FRACTION = 0.04


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
    headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * total))
    return max(0, free - headroom), (f"auto: {free / GB:.1f} GB free - {headroom / GB:.1f} GB headroom")


def device_placement(source, settings, device: torch.device, stream: str) -> tuple[Placement, str]:
    """The device's plan for `source` and a start-up line; stream 'off' refuses a model that does not fit."""
    budget, how = device_budget(settings, device)
    p = plan(ModelSizes.of(source), budget, str(device))
    if stream == "off":
        require_everything(p, how)
    return p, f"{p.describe()}; budget {how}"


class _Copier:
    """Host -> device copies on a dedicated stream (CUDA) whose events the compute stream waits on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Host buffers registered as pinned memory. The list keeps them mapped while registered: the
        # finalizer (close, or the copier being dropped) unregisters them first, so no registration
        # outlives its memory (a new buffer mapped at the same address could not be registered).
        self.pinned: list = []
        self._finalizer = weakref.finalize(self, _unregister, self.stream, self.pinned)

    def pin(self, buf) -> None:
        """Register a streamer buffer as pinned memory (once), so copies from it are asynchronous."""
        if self.stream is None or any(b is buf for b in self.pinned):
            return
        err = torch.cuda.cudart().cudaHostRegister(_address(buf), buf.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"registering a {buf.nbytes}-byte read buffer as pinned memory failed (CUDA error "
                               f"{int(err)})")
        self.pinned.append(buf)

    def copy(self, w):
        """`w` (tensors / QWeights, dict or tuple) on the device; (moved, event or None)."""
        if self.stream is None:
            return ({k: _move(x, self.device) for k, x in w.items()} if isinstance(w, dict)
                    else _move(w, self.device)), None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = ({k: _move(x, self.device, True) for k, x in w.items()} if isinstance(w, dict)
                     else _move(w, self.device, True))
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)
        for t in _tensors(tuple(moved.values()) if isinstance(moved, dict) else moved):
            t.record_stream(compute)
        return moved, event

    def close(self) -> None:
        self._finalizer()


def _address(buf) -> int:
    return torch.frombuffer(buf.mem, dtype=torch.uint8).data_ptr()


def _unregister(stream, pinned: list) -> None:
    if stream is not None:
        stream.synchronize()  # no copy may still read from a buffer
        for b in pinned:
            torch.cuda.cudart().cudaHostUnregister(_address(b))
    pinned.clear()


def _wait(event) -> None:
    if event is not None:
        event.synchronize()


class DeviceProvider:
    def __init__(self, source, settings, placement: Placement):
        self.config = cfg = source.config
        self.placement = placement
        self.device = settings.torch_device()
        self._copier = _Copier(self.device)
        sizes = placement.sizes
        g = source.read_globals()
        self._globals = {k: w if k == "embed" else _held(k, w, self.device) for k, w in g.items()}
        self._spines = {}
        self._stacks: dict[int, Stacked] = {}  # layers whose experts are all held, stacked
        self._all: dict[int, dict] = {}  # layers whose experts are all held, per expert (other codecs)
        self._slots = ExpertSlots(placement.expert_slots if placement.expert_slots < sizes.num_experts else 0)
        for i in range(cfg.num_layers):
            if i in placement.spine_layers:
                self._spines[i] = {k: _held(k, w, self.device) for k, w in source.read_spine(i).items()}
            if cfg.is_moe(i) and placement.expert_slots >= sizes.num_experts:
                self._hold_all_experts(source, i)
        self._spine_bytes = sizes.spine_bytes
        self._expert_bytes = sizes.expert_bytes
        self._host = None
        if not placement.everything:
            from .stream import StreamProvider
            # No host-RAM cache under it yet: the copier registers the streamer's buffers as pinned
            # memory once, which a cache that resizes them would invalidate.
            self._host = StreamProvider(source, settings, held=placement.spine_layers, cache=False)
            for buf in self._host.spine_buffers():
                self._copier.pin(buf)
        self._spine_copy = None  # event of the last copy out of a streamer spine buffer
        self._expert_copy = None  # ... and out of its expert slots

    @property
    def streaming(self) -> bool:
        return self._host is not None

    @property
    def graph_ready(self) -> bool:
        """Every weight is held and every MoE layer's experts are stacked: a one-token pass reads
        nothing back to the host, so it can be recorded as a CUDA graph (decode_graph.py)."""
        moe = sum(1 for i in range(self.config.num_layers) if self.config.is_moe(i))
        return self._host is None and len(self._stacks) == moe

    def _hold_all_experts(self, source, i: int) -> None:
        first = source.read_expert(i, 0)
        if all(isinstance(w, torch.Tensor) for w in first):
            w1, w3, w2 = first
            stack = ExpertStack(torch.empty((self.config.num_experts, 2 * w1.shape[0], w1.shape[1]), dtype=w1.dtype,
                                            device=self.device),
                                torch.empty((self.config.num_experts, *w2.shape), dtype=w2.dtype, device=self.device))
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
        moved, self._spine_copy = self._copier.copy(host)
        stats.bytes_to_device += self._spine_bytes[i]
        return moved

    def experts(self, i: int, ids, stats, residual=None) -> Future:
        stack = self._stacks.get(i)
        if stack is not None:
            # Every expert is here: no need to read the routing back. Counted as ids.numel() experts,
            # which at one token is exact (a token's top-k experts are distinct).
            n = ids.numel() if isinstance(ids, torch.Tensor) else len(ids)
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
        for buf in self._host.expert_buffers():
            self._copier.pin(buf)
        return _Arriving(self, i, pending, got, stats)

    # -- introspection -----------------------------------------------------------------------
    def residency(self) -> dict:
        """What the device holds (the plan, and how many expert slots are filled now)."""
        out = self.placement.summary()
        out["experts_held"] = (self._slots.held_count()
                               + self.config.num_experts * (len(self._stacks) + len(self._all)))
        out["grouped_expert_layers"] = len(self._stacks)
        out["pinned_host_buffers"] = len(self._copier.pinned)
        return out

    def resident_bytes(self) -> dict[str, int]:
        out = {"device": self.placement.held_bytes}
        if self._host is not None:
            out.update(self._host.resident_bytes())
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return out

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        self._copier.close()


class _Arriving:
    """Experts of one layer: the held ones now, the fetched ones once read and copied to the device."""

    def __init__(self, provider: DeviceProvider, i: int, pending, held: dict, stats):
        self.provider, self.i, self.pending, self.held, self.stats = provider, i, pending, held, stats

    def result(self) -> dict:
        got = self.pending.result()  # the streamer's expert wait is accounted by the streamer
        p = self.provider
        t0 = time.perf_counter()
        moved, p._expert_copy = p._copier.copy(got)
        self.stats.expert_wait_seconds += time.perf_counter() - t0
        self.stats.bytes_to_device += len(got) * p._expert_bytes[self.i]
        for e, w in moved.items():
            p._slots.offer(self.i, e, w)
        return {**self.held, **moved}

