"""Which layers each rank holds, and the check that every rank has the same model.

At start every rank sends the others what it has (``agree``): its model's identity (the fields a
saved decode state must match, see runtime.saved_state, plus a hash of the whole tensor index and
the settings that change the numbers) and its budget. A field that differs refuses the start on
every rank, naming the field and which ranks have which value.

The layers are split into contiguous ranges in rank order (rank 0 first: it embeds, so it holds
the first layers, and also the head, so that logits never cross the wire: the last rank sends the
residual stream of the wanted rows back, much smaller than a vocabulary-wide row). ``--placement``
sets the ranges; else they are sized by each rank's --ram-budget when every rank sets one above 0,
else so that each rank holds about the same weight bytes (rank 0's count includes the globals).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from dataclasses import dataclass

from ..checkpoint.sizes import ModelSizes
from ..errors import DeltafinError
from ..runtime.saved_state import model_identity
from ..settings import Settings, parse_placement
from ..units import GB, MB
from .transport import Group


class PlacementError(DeltafinError):
    pass


@dataclass(frozen=True)
class RankPlacement:
    ranges: tuple[range, ...]  # each rank's layers
    weight_bytes: tuple[int, ...]  # what each rank holds as stored (rank 0: with the globals)
    how: str  # where the ranges came from
    # Two ranks on one host may compute on the same cores (their CPU sets overlap, one of them
    # computing on the CPU) or on the same GPU: passes of theirs in flight at once then slow each other
    # down as much as they share, so one pass at a time (every request batched into it) is the faster
    # way there (Model.pipeline_depth). Ranks on GPUs of their own pipeline.
    shares_compute: bool = False

    def table(self) -> str:
        """The placement as a few lines (rank 0 prints it at start)."""
        lines = [f"deltafin: placement across {len(self.ranges)} ranks ({self.how}):"]
        for r, (layers, nbytes) in enumerate(zip(self.ranges, self.weight_bytes)):
            extra = " + embedding and head" if r == 0 else ""
            lines.append(f"deltafin:   rank {r}: layers {layers.start}-{layers.stop - 1} "
                         f"({len(layers)}){extra}, {_size(nbytes)}")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB else f"{nbytes / MB:.2f} MB"


def layer_bytes(sizes: ModelSizes) -> list[int]:
    """Each layer's weights as stored: its spine and, in a MoE layer, every routed expert."""
    return [s + sizes.num_experts * e for s, e in zip(sizes.spine_bytes, sizes.expert_bytes)]


def front_bytes(sizes: ModelSizes) -> int:
    """What rank 0 holds besides its layers: the embedding table, the head, the final norm."""
    return sizes.globals_bytes + sizes.embed_bytes


def split(per_layer: list[int], front: int, weights: list[float]) -> list[range]:
    """Contiguous ranges, one per weight, each about its weight's share of every byte (rank 0's
    share counts `front` too), at least one layer each."""
    n, L = len(weights), len(per_layer)
    total, share = front + sum(per_layer), sum(weights)
    ranges, start, held, target = [], 0, front, 0.0
    for r in range(n - 1):
        target += total * weights[r] / share
        end = start + 1
        held += per_layer[start]
        # Take the next layer while the cut lands nearer this rank's cumulative target, and leave
        # one layer for each rank after it.
        while end < L - (n - 1 - r) and held + per_layer[end] / 2 <= target:
            held += per_layer[end]
            end += 1
        ranges.append(range(start, end))
        start = end
    ranges.append(range(start, L))
    return ranges


def plan(sizes: ModelSizes, budgets: list[int | None], spec: list[range] | None) -> RankPlacement:
    """The ranks' ranges: `spec` (--placement), else by `budgets` (bytes, one per rank; None or 0 =
    none given), else equal weight bytes."""
    per_layer, front = layer_bytes(sizes), front_bytes(sizes)
    n, L = len(budgets), len(per_layer)
    if spec is not None:
        if len(spec) != n or spec[-1].stop != L:
            raise PlacementError(f"--placement lists {len(spec)} ranges ending at layer {spec[-1].stop - 1}; this "
                                 f"group has {n} ranks and the model {L} layers (0-{L - 1}): one range per rank, "
                                 f"covering every layer")
        ranges, how = spec, "set by --placement"
    elif n > L:
        raise PlacementError(f"{n} ranks, but the model has only {L} layers: each rank needs one at least")
    elif all(b for b in budgets):
        ranges = split(per_layer, front, [float(b) for b in budgets])
        how = "by each rank's --ram-budget"
    else:
        ranges, how = split(per_layer, front, [1.0] * n), "equal weight bytes"
    held = tuple(sum(per_layer[i] for i in r) + (front if k == 0 else 0) for k, r in enumerate(ranges))
    return RankPlacement(tuple(ranges), held, how)


def index_sha256(source) -> str:
    """A hash of every tensor's name, shape and dtype as stored (globals, spines, experts)."""
    cfg = source.config
    h = hashlib.sha256()
    groups = [source.global_infos()] + [source.spine_infos(i) for i in range(cfg.num_layers)]
    groups += [source.expert_infos(i, e) for i in range(cfg.num_layers) if cfg.is_moe(i)
               for e in range(cfg.num_experts)]
    for group in groups:
        for name in sorted(group):
            h.update(f"{name}:{tuple(group[name].shape)}:{group[name].dtype};".encode())
    return h.hexdigest()[:16]


def describe(source, settings: Settings) -> dict:
    """What this rank has: every field must be equal across ranks (but the budget)."""
    return {"model": {**model_identity(source, settings.dtype), "index_sha256": index_sha256(source),
                      "kda_chunk": settings.kda_chunk, "placement": settings.placement,
                      "dist_timeout": settings.dist_timeout},
            "budget": settings.ram_budget_bytes(),
            "compute": [socket.gethostname(), sorted(os.sched_getaffinity(0)), str(settings.torch_device())]}


def share_compute(compute: list) -> bool:
    """Whether two ranks of one host compute on the same cores (CPU sets that overlap, one of the two
    computing on the CPU) or on the same GPU. ``describe``'s "compute": each rank's host name, CPU
    numbers and device ("cpu" or "cuda:N", as the rank resolved it), checked here: a peer's
    description is not trusted."""
    seen = []
    for rank, c in enumerate(compute):
        if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], list)
                and all(type(n) is int for n in c[1]) and isinstance(c[2], str) and len(c[2]) <= 32):
            raise PlacementError(f"rank {rank} described where it computes as {str(c)[:80]!r}, not "
                                 "[host, [cpu, ...], device]")
        seen.append((c[0], set(c[1]), c[2]))

    def compete(a, b) -> bool:
        if a[0] != b[0]:
            return False  # hosts of their own
        if a[2].startswith("cuda") and b[2].startswith("cuda"):
            return a[2] == b[2]  # the launches' host threads are light beside a GPU's passes
        return bool(a[1] & b[1])
    return any(compete(a, b) for i, a in enumerate(seen) for b in seen[i + 1:])


def check_same(models: list[dict]) -> None:
    """Refuse when the ranks' models differ, naming the first field and the ranks per value."""
    for field in sorted(set().union(*models)):
        values = [m.get(field) for m in models]
        if len(set(map(repr, values))) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            which = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                              for v, rs in by_value.items())
            raise PlacementError(f"the ranks do not run the same model: '{field}' differs ({which}); start "
                                 "every rank with the same checkpoint and settings")


def agree(group: Group, source, settings: Settings) -> RankPlacement:
    """Every rank: exchange what each has, refuse a mismatch, and return the placement (the same
    on every rank)."""
    everyone = group.gather(describe(source, settings))
    check_same([d["model"] for d in everyone])
    placement = plan(ModelSizes.of(source), [d["budget"] for d in everyone], parse_placement(settings.placement))
    return dataclasses.replace(placement, shares_compute=share_compute([d["compute"] for d in everyone]))
