"""Which weights one memory tier holds for good, given its byte budget.

One plan for every tier (device memory, and host RAM under it with its own budget: ``ram_cache``):

1. the globals (final norm, lm_head, output attn-res; the embedding table stays in host memory,
   one row per token is all a pass needs of it) must fit, or nothing can run from this tier;
2. then whole spines, a fixed set of layers from the first on: a pass walks the layers in order,
   so a least-recently-used cache smaller than the spines would evict each layer just before it
   is needed again, and a fixed set keeps every hit;
3. then routed experts: what is left of the budget, as the same number of expert slots in every
   MoE layer (capped at the layer's experts). Which experts occupy the slots is decided while
   decoding from observed routing counts (``ExpertSlots``), since routing is skewed per layer.

What is not held streams through the tier below.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.sizes import ModelSizes
from ..units import GB


@dataclass(frozen=True)
class Placement:
    tier: str
    budget: int
    sizes: ModelSizes
    spine_layers: frozenset[int]
    expert_slots: int  # per MoE layer

    @property
    def held_bytes(self) -> int:
        s = self.sizes
        return (s.globals_bytes + sum(s.spine_bytes[i] for i in self.spine_layers)
                + self.expert_slots * sum(s.expert_bytes))

    @property
    def everything(self) -> bool:
        return len(self.spine_layers) == len(self.sizes.spine_bytes) and self.expert_slots >= self.sizes.num_experts

    def summary(self) -> dict:
        moe = sum(1 for b in self.sizes.expert_bytes if b)
        return {"tier": self.tier, "budget_bytes": self.budget, "held_bytes": self.held_bytes,
                "model_bytes": self.sizes.total, "spine_layers": len(self.spine_layers),
                "layers": len(self.sizes.spine_bytes), "experts_per_layer": self.expert_slots,
                "experts_in_layer": self.sizes.num_experts, "moe_layers": moe}

    def describe(self) -> str:
        s = self.summary()
        return (f"{self.tier}: holds {s['held_bytes'] / GB:.2f} of {s['model_bytes'] / GB:.2f} GB "
                f"(budget {self.budget / GB:.2f} GB): spines of {s['spine_layers']}/{s['layers']} layers, "
                f"{s['experts_per_layer']}/{s['experts_in_layer']} experts in each of {s['moe_layers']} MoE layers")


class PlacementError(ValueError):
    pass


def plan(sizes: ModelSizes, budget: int, tier: str) -> Placement:
    left = budget - sizes.globals_bytes
    if left < 0:
        raise PlacementError(f"the model does not fit in {tier}: its globals alone need "
                             f"{sizes.globals_bytes / GB:.4f} GB, more than the budget of {budget / GB:.4f} GB")
    spines = []
    for i, b in enumerate(sizes.spine_bytes):
        if b > left:
            break
        spines.append(i)
        left -= b
    per_slot = sum(sizes.expert_bytes)  # one expert in every MoE layer
    slots = 0
    if len(spines) == len(sizes.spine_bytes):
        # no expert bytes at all (a rank's share without MoE layers): every slot is free
        slots = min(sizes.num_experts, left // per_slot) if per_slot else sizes.num_experts
    return Placement(tier, budget, sizes, frozenset(spines), int(slots))


def require_everything(p: Placement, how: str, remedy: str = "stream the rest with --stream on") -> None:
    """Refuse, with the sizes, when the tier cannot hold the whole model (or a rank's share of it)."""
    if p.everything:
        return
    s = p.sizes
    raise PlacementError(
        f"the model does not fit in {p.tier}: it needs {s.total / GB:.2f} GB (globals {s.globals_bytes / GB:.2f}, "
        f"spines {sum(s.spine_bytes) / GB:.2f}, experts {s.experts_total / GB:.2f}) and the "
        f"budget is {p.budget / GB:.2f} GB ({how}); {remedy}")


class ExpertSlots:
    """Which experts of each MoE layer stay held: up to ``slots`` per layer, the most often routed lately.

    Each pass in which an expert is chosen adds 1 to its score in that layer, and scores halve every
    ``half_life`` passes of the layer, so an expert that was popular long ago gives way to one that
    is popular now (plain counts never forget; least-recently-used forgets after one pass and, with
    top-k routing, evicts hot experts for one-off ones: tools/expert_cache_policy.py measures both).
    The decay is applied lazily, by growing the increment instead of shrinking every score: a pass
    costs O(chosen), whatever the number of experts.

    ``admit`` is asked for an expert that has to be fetched anyway: it says yes while the layer has
    a free slot, and when the expert now scores above the layer's coldest held one (which it evicts);
    ``put`` then stores the fetched weights (an opaque value). ``resize`` changes the slots per layer
    and returns what it evicted. ``spare[i]``: held experts of layer i that a tier above holds too:
    their copy here is needed only once that tier lets them go, so they are evicted first, whatever
    their score. Not thread-safe: a caller shared between threads locks around it."""

    def __init__(self, slots: int, half_life: float = 32.0):
        self.slots = slots
        self.half_life = half_life
        self.scores: dict[int, dict[int, float]] = {}
        self._step: dict[int, int] = {}
        self.held: dict[int, dict] = {}  # layer -> {expert: weights}
        self.spare: dict[int, set] = {}

    def routed(self, i: int, chosen) -> None:
        scores = self.scores.setdefault(i, {})
        step = self._step[i] = self._step.get(i, 0) + 1
        if step > 500 * self.half_life:  # keep the growing increment far from overflow
            for e in scores:
                scores[e] *= 2.0 ** (-step / self.half_life)
            step = self._step[i] = 0
        inc = 2.0 ** (step / self.half_life)
        for e in chosen:
            scores[e] = scores.get(e, 0.0) + inc

    def score(self, i: int, e: int) -> float:
        return self.scores.get(i, {}).get(e, 0.0)

    def get(self, i: int, e: int):
        return self.held.get(i, {}).get(e)

    def coldest(self, i: int, keep=()) -> int | None:
        """Layer i's held expert to evict first (a spare one, else the lowest score), leaving out
        those in `keep`; None: none."""
        layer = self.held.get(i, {})
        pick = [x for x in self.spare.get(i, ()) if x in layer and x not in keep] or \
            [x for x in layer if x not in keep]
        return min(pick, key=lambda x: self.score(i, x), default=None)

    def admit(self, i: int, e: int, pending: int = 0, keep=()) -> bool:
        """Whether `e` (not held) should take a slot of layer i; evicts the coldest to make room.
        `pending`: slots of layer i already promised to experts not stored yet; `keep`: experts
        that must not be evicted now (in use)."""
        if self.slots <= 0:
            return False
        layer = self.held.setdefault(i, {})
        if len(layer) + pending < self.slots:
            return True
        coldest = self.coldest(i, keep)
        if coldest is not None and (coldest in self.spare.get(i, ()) or self.score(i, e) > self.score(i, coldest)):
            del layer[coldest]
            return True
        return False

    def put(self, i: int, e: int, weights) -> None:
        layer = self.held.setdefault(i, {})
        if e in layer or len(layer) < self.slots:
            layer[e] = weights

    def offer(self, i: int, e: int, weights) -> None:
        """Keep fetched weights if `e` earns a slot."""
        if self.admit(i, e):
            self.put(i, e, weights)

    def resize(self, slots: int) -> list:
        """Set the slots per layer; returns the weights evicted (the coldest of each layer)."""
        self.slots = max(0, slots)
        out = []
        for i, layer in self.held.items():
            while len(layer) > self.slots:
                out.append(layer.pop(self.coldest(i)))
        return out

    def held_count(self) -> int:
        return sum(len(v) for v in self.held.values())
