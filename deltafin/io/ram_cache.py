"""The host-RAM cache of a streamed model: what it holds, how it is sized, what makes it give memory back.

What it holds, beyond the streamer's fixed buffers (globals, pinned layers, the spine read-ahead
buffers, the expert slots):

- spines of a fixed set of layers, from the first streamed layer on (``placement.plan`` decides,
  as for device memory): a pass walks the layers in order, so a recency-based cache would evict
  each layer just before it is needed again. A layer enters when it was read for a pass anyway
  (the streamer reads it into a buffer the cache then keeps: no copy); the layers outside the set keep being read
  with nocache reads, so they never evict it;
- routed experts, once every spine is held: the same number of slots in every MoE layer, filled
  by ``placement.ExpertSlots`` (scores of how often each expert was routed lately). An admitted
  expert is read straight into its own buffer (the evicted expert's, when one makes room): no copy.

Everything held is page-aligned memory whose tensors (views, decoded once) are handed to the
engine as they are: no copy per use. For an engine computing on the CPU (``cpu_layout``), what is
kept for good is first laid out as the CPU's products read it fastest (``io/ram.py`` ``cpu_layout``:
grouped int8 codes permuted in place, once): every spine the cache takes, and experts while it holds
all of a layer's (no routed expert is then ever evicted). While it holds only some, admitted experts
replace each other every few tokens and keep the store's layout: the permutation would cost each of
them about as much CPU as their read saves.

Sizing: ``target`` is the bytes the cache may hold, together with the streamer's spine read-ahead
buffers: those exist only while some layer is not held (two buffers of the largest layer still
read), so holding a spine costs its bytes but can shrink them, and dropping one can bring them back
(on k3-slice, dropping the last 0.42 GB spine brings back 2 x 0.42 GB of buffers). The plan picks
the most spines whose bytes plus the buffers they leave fit (``_plan``); the streamer tells the
cache what its read-ahead buffers take now (``ring_bytes``). ``set_target`` (from
``memory.Watcher``, a few times a second) moves the target. Shrinking happens at once, experts first (the coldest of each layer,
one slot of every layer at a time), then spines from the last held layer back: dropping an entry
drops the cache's reference, and the memory goes back as soon as no layer computing now still uses
it (at most one layer later). Growing is lazy: entries are admitted as the pass reads them. A
line goes to stderr (``log``) when the set of layers / experts per layer the target allows changes,
with why (every change of direction; steps the same way at most once a second).

Thread-safety: every method takes the cache's lock; the decode thread (and the read workers
that complete expert reads) admit and look up, the watcher shrinks.

For a caller that wants to read experts ahead (prefetch): ``expert(i, e)`` looks one up,
``admit_expert(i, e, capacity)`` asks for a slot (making room) and returns the buffer to read into,
``put_expert(i, e, buf, weights)`` stores what was read into it; ``routed(i, chosen)`` is called once per layer per pass by the
streamer with what the router chose (the scores the slots follow).
"""
from __future__ import annotations

import sys
import threading
import time

from ..checkpoint.sizes import ModelSizes
from ..units import GB
from .placement import ExpertSlots, Placement
from .ram import expert_in_cpu_layout, spine_in_cpu_layout
from .reader import AlignedBuffer


class RamCache:
    def __init__(self, spine_bytes: list[int], expert_bytes: list[int], num_experts: int, log=None,
                 new_buffer=AlignedBuffer, cpu_layout: bool = False):
        """`spine_bytes[i]`: buffer bytes layer i's spine takes here (0 for a layer that is never
        streamed: pinned, or held by a device); `expert_bytes[i]`: one expert of layer i (0: dense);
        `new_buffer(nbytes)`: makes the buffer an admitted expert is read into; `cpu_layout`: what it
        keeps is computed on the CPU (not copied to a device), see ``spine_to_keep``."""
        self._new_buffer = new_buffer
        self.cpu_layout = cpu_layout
        self._sizes = ModelSizes(0, tuple(spine_bytes), tuple(expert_bytes), num_experts if any(expert_bytes) else 0)
        self._cacheable = [i for i, b in enumerate(spine_bytes) if b]
        self._lock = threading.Lock()
        self._log = log if log is not None else (lambda line: print(line, file=sys.stderr))
        self.target = 0
        self.fixed_bytes = 0  # the streamer's own buffers now, but for its spine read-ahead (set by it)
        self.ring_bytes = 0  # the streamer's spine read-ahead buffers now (set by it; see _plan)
        self._loan = 0  # lent to a pass's extra expert read buffers (make_room), back at its end
        self._spines: dict[int, tuple[object, dict]] = {}  # layer -> (buffer, decoded weights)
        self._plan = self._make_plan(0)
        self._spine_held = 0
        self._experts = ExpertSlots(0)  # weights: (buffer, decoded weights)
        self._pending: dict[int, tuple[int, int]] = {}  # layer -> (experts admitted, not stored yet; their bytes)
        self._in_use: dict[int, set] = {}  # layer -> what its router chose this pass
        self._expert_held = 0
        self._clock = time.monotonic
        self._last_verb, self._last_line = "", float("-inf")
        self.version = 0  # bumped when the set of held spines changes (the streamer re-plans its reads)
        self.held_version = 0  # bumped when anything held comes or goes (``whole_layer`` views follow it)
        # Called (under the lock: they must only drop references) when anything held goes, so that
        # whoever keeps views of held weights lets them go with it (``StreamProvider.held``).
        self.on_drop: list = []

    # -- sizing ------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        with self._lock:
            return self._spine_held + self._expert_held

    def charged_bytes(self) -> int:
        """What the target pays for now: what the cache holds, the experts it admitted that are
        being read into buffers of their own, and the spine read-ahead buffers."""
        with self._lock:
            return self._spine_held + self._expert_held + self._promised() + self.ring_bytes

    def _ring_cost(self, spines) -> int:
        """The read-ahead buffers the streamer needs while it holds `spines`: two of the largest
        layer still read (none once every spine is held)."""
        return 2 * max((self._sizes.spine_bytes[i] for i in self._cacheable if i not in spines), default=0)

    def _make_plan(self, target: int) -> Placement:
        """The most spines, from the first streamed layer on, whose bytes and the read-ahead buffers
        they leave fit in `target`, also at every step of taking in those not held yet (a pass
        admits them in layer order); experts in what is left once every spine is in (the same number
        of slots in every MoE layer). More spines are not always dearer: the buffers follow the
        largest layer still read, and go once none is (k3-slice, GB: none held 2.34 of buffers,
        the first 1.17 + 1.26, three 2.43 + 0.84, all four 2.85 + 0)."""
        s = self._sizes
        layers = self._cacheable

        def cost(n: int) -> int:
            return sum(s.spine_bytes[i] for i in layers[:n]) + self._ring_cost(layers[:n])

        held = 0
        while held < len(layers) and layers[held] in self._spines:
            held += 1
        n = held
        while n < len(layers) and cost(n + 1) <= target:
            n += 1
        if n == held and cost(held) > target:  # neither more nor these fit: fewer
            n = max((m for m in range(held) if cost(m) <= target), default=0)
        slots = 0
        per_slot = sum(s.expert_bytes)
        if n == len(layers) and per_slot:
            slots = int(min(s.num_experts, max(0, target - cost(n)) // per_slot))
        return Placement("ram", target, s, frozenset(layers[:n]), slots)

    def set_target(self, target: int, why: str = "") -> None:
        with self._lock:
            self._set_target(target, why)

    def _set_target(self, target: int, why: str) -> None:
        old = self._plan
        self.target = max(0, int(target))
        self._plan = self._make_plan(self.target)
        self._shrink_to(self._plan)
        if (old.spine_layers, old.expert_slots) == (self._plan.spine_layers, self._plan.expert_slots):
            return
        verb = "grows" if self._plan.held_bytes > old.held_bytes else "shrinks"
        now = self._clock()
        # Every turn is told; more steps the same way at most one line a second.
        if verb != self._last_verb or now - self._last_line >= 1.0:
            self._last_verb, self._last_line = verb, now
            self._log(f"deltafin: ram cache {verb} to {self.target / GB:.2f} GB ({why}): "
                      f"{self._describe(self._plan)}")

    def make_room(self, nbytes: int, why: str) -> None:
        """Lower the target so that `nbytes` more of the streamer's own buffers (a long pass's
        extra expert read buffers) fit in what the budget allowed; ``repay`` gives it back when
        they are freed, at the pass's end."""
        with self._lock:
            nbytes = max(0, min(nbytes, self.target))
            self._loan += nbytes
            self._set_target(self.target - nbytes, why)

    def repay(self, freed: int) -> None:
        """The pass that needed ``make_room`` is over and freed `freed` bytes of buffers: the target
        gets up to that much of the loan back now (not after the watcher saw memory stay free for a
        few seconds, which on k3-slice let the first 10-15 tokens after a prefill run with the cache
        down to a spine or two). Buffers the streamer keeps (a decode's own expert slots) are not
        given back: they stay taken, and count among its own buffers from now on."""
        with self._lock:
            back, self._loan = min(self._loan, max(0, freed)), 0
            if back:
                self._set_target(self.target + back, "a long pass's expert read buffers given back")

    def _set_slots(self, slots: int) -> None:
        dropped = self._experts.resize(slots)
        for buf, _ in dropped:
            self._expert_held -= buf.nbytes
        if dropped:
            self._dropped()

    def _dropped(self) -> None:
        self.held_version += 1
        for drop in self.on_drop:
            drop()

    def _shrink_to(self, p: Placement) -> None:
        self._set_slots(p.expert_slots)
        for i in sorted(self._spines, reverse=True):
            if i not in p.spine_layers:
                self._spine_held -= self._spines.pop(i)[0].nbytes
                self.version += 1
                self._dropped()

    def _over(self, more: int, spines=None) -> bool:
        """Whether holding `more` bytes (and the spines `spines`, default those held) passes the target."""
        spines = self._spines.keys() if spines is None else spines
        return self._spine_held + self._expert_held + more + self._ring_cost(spines) > self.target

    def _describe(self, p: Placement) -> str:
        s = self._sizes
        text = f"spines of {len(p.spine_layers)}/{len(self._cacheable)} streamed layers"
        if s.num_experts:
            text += f", {p.expert_slots}/{s.num_experts} experts in each MoE layer"
        return text

    # -- spines ------------------------------------------------------------------------------
    def spine(self, i: int) -> dict | None:
        with self._lock:
            got = self._spines.get(i)
            return got[1] if got is not None else None

    def holds_spine(self, i: int) -> bool:
        with self._lock:
            return i in self._spines

    def wants_spine(self, i: int) -> bool:
        with self._lock:
            return i in self._plan.spine_layers and i not in self._spines and self._sizes.spine_bytes[i] > 0

    def spine_to_keep(self, weights: dict) -> dict:
        """A spine about to be offered to ``put_spine`` (by the one that read it, before anyone else
        uses it: its codes may be permuted in place) as the cache keeps it; use the result from then on."""
        return spine_in_cpu_layout(weights) if self.cpu_layout else weights

    def put_spine(self, i: int, buf, weights: dict) -> bool:
        """Keep layer i's spine, read into `buf` (a buffer the caller gives away: the cache holds it
        from now on, with the `weights` viewing it); False: not kept."""
        with self._lock:
            if i not in self._plan.spine_layers or i in self._spines:
                return False
            spines = {*self._spines, i}
            # Spines come before experts: make room among the experts if they took it meanwhile.
            while self._over(buf.nbytes, spines) and self._experts.slots:
                self._set_slots(self._experts.slots - 1)
            if self._over(buf.nbytes, spines):
                return False
            self._spines[i] = (buf, weights)
            self._spine_held += buf.nbytes
            self.version += 1
            self.held_version += 1
            return True

    # -- experts -----------------------------------------------------------------------------
    def routed(self, i: int, chosen) -> None:
        """What layer i's router chose this pass: scores, and the experts that must stay until the
        layer has computed (a hit is computed from its buffer, so it is not evicted meanwhile)."""
        with self._lock:
            self._experts.routed(i, chosen)
            self._in_use[i] = set(chosen)
            self._pending.pop(i, None)  # promises of the layer's last pass are settled by now

    def expert(self, i: int, e: int):
        with self._lock:
            got = self._experts.get(i, e)
            return got[1] if got is not None else None

    def missing_experts(self, i: int) -> list[int]:
        """Layer i's experts not held, where the plan holds every expert of every layer (and every
        spine); else none: what a reader may fetch before any pass asks (``StreamProvider.end_pass``)."""
        with self._lock:
            n = self._sizes.num_experts
            if not n or not self._sizes.expert_bytes[i] or self._plan.expert_slots < n \
                    or len(self._spines) < len(self._cacheable):
                return []
            layer = self._experts.held.get(i, {})
            return [e for e in range(n) if e not in layer]

    def whole_layer(self, i: int) -> dict | None:
        """Every expert of layer i, {expert: weights} in expert order, where the cache holds them all;
        else None."""
        with self._lock:
            layer = self._experts.held.get(i, {})
            n = self._sizes.num_experts
            return {e: layer[e][1] for e in range(n)} if n and len(layer) >= n else None

    def lay_out_experts(self, i: int) -> bool:
        """Lay out for the CPU the experts of layer i kept before the cache held all of a layer's (in
        the store's layout then, see ``expert_to_keep``), now that it holds every one; whether any was.
        Their codes are permuted in place, so the old weight objects must not be used again: the change
        is told as a drop (``on_drop``), and it is made between passes, by the thread that runs them."""
        with self._lock:
            n = self._sizes.num_experts
            if not (self.cpu_layout and n and self._plan.expert_slots >= n):
                return False
            layer = self._experts.held.get(i, {})
            changed = False
            for e, (buf, weights) in list(layer.items()):
                laid = expert_in_cpu_layout(weights)
                if any(a is not b for a, b in zip(laid, weights)):
                    layer[e], changed = (buf, laid), True
            if changed:
                self._dropped()
            return changed

    def admit_expert(self, i: int, e: int, capacity: int, buf=None):
        """The buffer to read expert e of layer i into, to keep it; None: not admitted. `buf`: the
        expert is already read into a buffer of its own (a prefetch's), kept as it is when admitted.

        An admitted expert holds a promised slot (and its bytes) until ``put_expert``: a pass that
        reads many experts of a layer (a prompt) is admitted no more of them than the layer's
        slots and the target allow. When the layer's slots are full, the coldest expert not in use
        by this pass makes room and its buffer is reused (no allocation, no page faults)."""
        with self._lock:
            layer = self._experts.held.get(i, {})
            n, promised = self._pending.get(i, (0, 0))
            full = len(layer) + n >= self._experts.slots
            if not full and self._over(capacity + self._promised()):
                return None  # a slot is free but the bytes are not (buffers round up): only swaps
            keep = self._in_use.get(i, ())
            victim = self._experts.coldest(i, keep) if full else None
            old = layer[victim][0] if victim is not None else None
            if not self._experts.admit(i, e, n, keep):
                return None
            self._pending[i] = (n + 1, promised + capacity)
            if old is not None and victim not in layer:
                self._expert_held -= old.nbytes
                self._dropped()
                if buf is None and old.nbytes >= capacity:
                    return old
            return buf if buf is not None else self._new_buffer(capacity)

    def expert_to_keep(self, weights: tuple) -> tuple:
        """An admitted expert about to be stored by ``put_expert``, as the cache keeps it (see
        ``spine_to_keep``): in the CPU layout only while the cache holds every expert of a layer."""
        with self._lock:
            every = self._plan.expert_slots >= self._sizes.num_experts > 0
        return expert_in_cpu_layout(weights) if self.cpu_layout and every else weights

    def put_expert(self, i: int, e: int, buf, weights) -> None:
        with self._lock:
            n, promised = self._pending.get(i, (0, 0))
            if n:
                self._pending[i] = (n - 1, max(0, promised - buf.nbytes))
            if self._over(buf.nbytes):
                return
            layer = self._experts.held.get(i, {})
            before, replaced = len(layer), layer.get(e)
            self._experts.put(i, e, (buf, weights))
            if len(self._experts.held.get(i, {})) > before:
                self._expert_held += buf.nbytes
                self.held_version += 1
            elif replaced is not None and self._experts.get(i, e) is not replaced:
                self._expert_held += buf.nbytes - replaced[0].nbytes
                self._dropped()

    def above(self, i: int, e: int, held: bool) -> None:
        """Whether a tier above (the device) holds expert e of layer i now: while it does, the copy
        here is the first to make room (``ExpertSlots.spare``); kept while there is room, it saves a
        disk read once that tier lets the expert go."""
        with self._lock:
            spare = self._experts.spare.setdefault(i, set())
            if held:
                spare.add(e)
            else:
                spare.discard(e)

    def _promised(self) -> int:
        return sum(b for _, b in self._pending.values())

    # -- introspection -----------------------------------------------------------------------
    def residency(self) -> dict:
        with self._lock:
            return {"target_bytes": self.target, "held_bytes": self._spine_held + self._expert_held,
                    "spine_layers_held": len(self._spines), "streamed_layers": len(self._cacheable),
                    "experts_held": self._experts.held_count(), "expert_slots_per_layer": self._experts.slots,
                    "experts_in_layer": self._sizes.num_experts,
                    "slot_bytes": sum(self._sizes.expert_bytes)}  # one expert slot in every MoE layer
