"""Expert prefetch for the streaming provider: read a layer's likely experts before its router runs.

Two predictions (setting ``prefetch``):

- ``early``: the next MoE layer's router applied to this layer's residual stream (the input of
  this layer's MoE, normalized with the next layer's norm). The residual changes little from one
  layer to the next, so the guess is good (tools/routing_stats.py measures it: 0.75 of the
  experts chosen on the kl_medium benchmark model, 0.77 on a trained model), and it is made a whole
  layer ahead: the reads run while this layer's experts and the next layer's attention compute.
  It needs the next layer's router in memory (held by the host-RAM cache or pinned, or its spine's
  read-ahead already complete); otherwise that layer is not guessed.
- ``prev``: the experts the previous pass's last token chose at the same layer, queued when the
  layer's spine is asked for (trained routers repeat some of them from token to token).

The experts the host-RAM cache holds are left out: they cost nothing anyway.

Reads are queued at ``PREFETCH`` priority, behind every demand read (routed experts, at URGENT).
``take(i, e)``, asked by the demand path for every routed expert that the cache does not hold,
returns the expert's weights when its prefetch has completed, or the prefetch itself when it is
still under way (``Ahead``: the demand path waits for its batch instead of reading the same bytes
again; its ``weights`` are decoded by then). Guesses the router did not confirm are cancelled when the
next guesses are made (their queued pieces are skipped; at most one piece per worker is still
read).

What stays in memory: one buffer per guessed expert, reused layer after layer, and the buffers of
cancelled guesses until their last piece is read; while more than one layer's worth of those is
outstanding, nothing new is guessed, which bounds the buffers to about three layers' worth.
Buffers whose expert the cache admits are handed to the cache (no copy) and replaced.

When each guess is made (``Guesses``, for the streaming provider): ``prev`` queues a layer's guess
when its spine is asked for; ``early`` queues the next MoE layer's right after this layer's demand
reads. The first MoE layer has no MoE layer before it to guess from: in both modes its guess is
the previous pass's last token's experts there, queued when the pass starts.

Accounting (into the pass's ``PassStats``): bytes read by prefetch (also counted as disk bytes),
and of them the bytes of experts that the router then chose (``prefetch_useful_rate`` is their ratio).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.moe import chosen_experts, route
from ..model.ops import rms_norm
from .reader import EXPERT_CHUNK, PREFETCH, AlignedBuffer, Batch, Layout, ReadPool, chunked, views



@dataclass
class Ahead:
    expert: int
    buf: AlignedBuffer
    layout: Layout
    batch: Batch
    weights: object = None  # decoded once its read completed
    kept: bool = False  # its buffer went to the host-RAM cache
    taken_for: int | None = None  # the layer whose demand path took it (it computes from the buffer)


class Prefetcher:
    def __init__(self, pool: ReadPool, layout_of, decode, cache=None, guesses: int = 8, new_buffer=AlignedBuffer):
        """`layout_of(i, e)`: expert e of layer i's Layout; `decode(i, e, views)`: its weights;
        `guesses`: the most experts one layer's guess reads (top-k); `new_buffer(nbytes)`: makes a buffer."""
        self._new_buffer = new_buffer
        self._pool = pool
        self._layout_of = layout_of
        self._decode = decode
        self._cache = cache
        self._guesses = guesses
        self._last: dict[int, list[int]] = {}  # layer -> what the last token of the previous pass chose
        self._layer: int | None = None  # the layer whose experts are being prefetched
        self._ahead: dict[int, Ahead] = {}
        self._retiring: list[Ahead] = []  # cancelled, with pieces still queued or in flight
        self._taken: list[Ahead] = []  # taken while under way: the demand path waits for them
        self._free: list[AlignedBuffer] = []

    def observe(self, i: int, ids) -> None:
        """What the router of layer i chose this pass (``ids`` [rows, k], or a list of expert ids);
        the last row predicts the next pass."""
        last = ids[-1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else ids
        self._last[i] = chosen_experts(last)

    def start(self, i: int, stats, predicted: list[int] | None = None, computing: int | None = None) -> None:
        """Queue the reads of layer i's guessed experts (`predicted`, else what the previous pass
        chose there); the guesses for the layers before are done with, and so are the buffers of
        what they took, except layer `computing`'s (it has yet to compute from them)."""
        self._release(stats, computing)
        predicted = self._last.get(i) if predicted is None else predicted
        if not predicted or len(self._retiring) > self._guesses:
            return  # the disk has not caught up with the last guesses: no new ones (bounds memory)
        cache = self._cache
        self._layer = i
        # Only what the cache misses, and at most `guesses` of it (the best first): every guess
        # holds a buffer, and in a tight budget those buffers come out of the cache (k3-slice in
        # 6 GiB: 2 x top-k of them per layer left the cache no experts at all).
        missing = [e for e in predicted if cache is None or cache.expert(i, e) is None][:self._guesses]
        for e in missing:
            lay = self._layout_of(i, e)
            buf = self._buffer(lay.capacity, stats)
            jobs = [(run, buf.mem, s) for run, s in zip(lay.runs, lay.starts)]
            self._ahead[e] = Ahead(e, buf, lay, self._pool.submit(chunked(jobs, EXPERT_CHUNK), PREFETCH))

    def take(self, i: int, e: int, stats):
        """Expert e of layer i: its weights if its prefetch completed, the prefetch (an ``Ahead``
        whose batch to wait for; its ``weights`` are set by then) if it is under way, else None (read
        it on demand)."""
        a = self._ahead.get(e) if self._layer == i else None
        if a is None or a.batch.failed() or a.batch.cancelled:
            return None
        del self._ahead[e]
        # Counted now, as read in full: nothing cancels it any more.
        nbytes = sum(run.nbytes for run in a.layout.runs)
        stats.prefetch_bytes += nbytes
        stats.bytes_read += nbytes
        stats.prefetch_used_bytes += a.layout.nbytes
        a.taken_for = i
        self._taken.append(a)
        a.batch.add_done_callback(lambda error, i=i, a=a: self._keep(i, a) if error is None else None)
        return a.weights if a.batch.done() else a

    def _keep(self, i: int, a: Ahead) -> None:
        """Decode a taken prefetch (in the thread that completed its read) and offer it to the cache."""
        weights = self._decode(i, a.expert, views(a.buf.mem, a.layout))
        cache = self._cache
        if cache is not None and cache.admit_expert(i, a.expert, a.buf.nbytes, a.buf):
            weights = cache.expert_to_keep(weights)
            cache.put_expert(i, a.expert, a.buf, weights)  # the cache keeps the buffer; a new one replaces it
            a.kept = True
        a.weights = weights

    def resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._free) + \
            sum(a.buf.nbytes for a in [*self._ahead.values(), *self._retiring, *self._taken] if not a.kept)

    def close(self) -> None:
        """Cancel everything and wait for the pieces in flight (the buffers must outlive them)."""
        self._release(None, None)
        for a in [*self._retiring, *self._taken]:
            try:
                a.batch.wait()
            except Exception:
                pass
        self._retiring.clear()
        self._taken.clear()

    def _release(self, stats, computing: int | None) -> None:
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
        del self._free[self._guesses:]  # more than one layer's guesses are never needed again
        # A taken prefetch's buffer comes back once the layer that took it has computed.
        busy = []
        for a in self._taken:
            if a.taken_for == computing or not a.batch.done():
                busy.append(a)
            elif not a.kept:
                self._free.append(a.buf)
        self._taken = busy

    def _buffer(self, nbytes: int, stats) -> AlignedBuffer:
        for k, b in enumerate(self._free):
            if b.nbytes >= nbytes:
                return self._free.pop(k)
        return self._new_buffer(nbytes)


class Guesses:
    """When the streamer's prefetcher guesses, which layer, and from what (the setting ``prefetch``).
    It holds no memory of its own: the guesses' buffers are the prefetcher's."""

    def __init__(self, cfg, mode: str, prefetcher: Prefetcher, spine_in_memory):
        """`mode`: the setting ``prefetch`` ("prev" or "early"); `spine_in_memory(j)`: layer j's
        spine if it is in memory now, else None (its router makes an ``early`` guess)."""
        self._cfg, self._mode, self._prefetcher = cfg, mode, prefetcher
        self._spine_in_memory = spine_in_memory
        self._first_moe = next((i for i in range(cfg.num_layers) if cfg.is_moe(i)), None)

    def start_pass(self, stats) -> None:
        """The first MoE layer's guess, queued before the dense layers before it compute."""
        self._prefetcher.start(self._first_moe, stats)

    def before_spine(self, i: int, stats) -> None:
        """``prev``: layer i's guess, queued when its spine is asked for, ahead of the next spine's
        read (the experts are needed first)."""
        if self._mode == "prev" and self._cfg.is_moe(i) and i != self._first_moe:
            self._prefetcher.start(i, stats)

    def routed(self, i: int, ids, chosen: list[int], got: dict, stats) -> dict:
        """Layer i's router chose `chosen` (``ids``: its tensor, or a list); `got`: those at hand
        already. Adds to `got` the prefetched ones whose read completed; returns those still being
        read (expert -> ``Ahead``), to wait for instead of reading them again."""
        if self._mode == "prev" or i == self._first_moe:
            self._prefetcher.observe(i, ids)
        under_way = {}
        for e in chosen:
            w = self._prefetcher.take(i, e, stats) if e not in got else None
            if isinstance(w, Ahead):
                under_way[e] = w
            elif w is not None:
                got[e] = w
        return under_way

    def after_experts(self, i: int, residual, stats) -> None:
        """``early``: the next MoE layer's router on this layer's residual stream (the rows of this
        pass at its MoE), queued behind this layer's demand reads."""
        if self._mode != "early":
            return
        cfg = self._cfg
        j = next((n for n in range(i + 1, cfg.num_layers) if cfg.is_moe(n)), None)
        router = self._spine_in_memory(j) if j is not None else None
        guess = early_guess(cfg, residual, router) if router is not None else None
        if guess:
            self._prefetcher.start(j, stats, guess, computing=i)


def early_guess(cfg, residual: torch.Tensor, spine: dict) -> list[int]:
    """The experts layer j's router (in `spine`, layer j's weights) would choose for rows of an
    earlier layer's residual stream: each row's top-k, the most often chosen first, at most 2k.
    None for a long pass (a prefill), whose demand reads cover most experts anyway."""
    rows, k = residual.shape[0], cfg.experts_per_token
    if rows * k > cfg.num_experts // 2 or "mlp.gate" not in spine:
        return []
    gate = spine["mlp.gate"]
    bias = spine.get("mlp.e_score_correction_bias")
    x = residual.detach().to("cpu", torch.float32)
    x = rms_norm(x, spine["post_attention_layernorm"].float(), cfg.rms_norm_eps)
    ids, _ = route(cfg, x, gate, bias if bias is not None else torch.zeros(gate.shape[0]))
    counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
    ranked = counts.argsort(descending=True, stable=True)
    return [int(e) for e in ranked[:2 * k] if counts[e] > 0]


def _count(stats, batch: Batch) -> None:
    """A prefetch's bytes read from disk: disk bytes of the pass, and prefetched bytes."""
    stats.prefetch_bytes += batch.read_bytes
    stats.bytes_read += batch.read_bytes
