"""Decode states kept between requests, keyed by the exact token ids they hold.

OpenAI-style clients resend the whole conversation every turn. A state that holds a prefix of a
new prompt lets the engine prefill only the rest, so a conversation's history is read through
the model once instead of once per turn.

What it holds: ``DecodeState`` objects, each for one exact token sequence (a KDA state cannot be
cut back to a shorter prefix, so only whole entries are reused). ``lookup`` returns a copy of the
longest entry that is a proper prefix of the prompt (at least one prompt token must still be fed
to get the next token's logits). How it is sized: by the bytes of the states' tensors, against
``budget_bytes`` (the ``prefix_cache_mb`` setting); a state larger than the budget is not kept.
What makes it give memory back: every ``put`` evicts least-recently-used entries until the total
fits; pinned entries (a saved prompt state loaded at start) are never evicted and do not count
against the budget.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..model.state import DecodeState


@dataclass
class _Entry:
    state: DecodeState
    nbytes: int
    pinned: bool = False


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server's engine thread writes, /health and /metrics read
        # Running totals, kept under the lock, so readers never walk the entries while a put changes them.
        self._bytes = 0  # of the entries that count against the budget (not pinned)
        self._pinned = 0
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0  # prompt tokens served from the cache, summed over lookups
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 or self._pinned > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> tuple[int, DecodeState | None]:
        """(n, a copy of the state holding ids[:n]) for the longest cached proper prefix; (0, None) if none."""
        ids = tuple(ids)
        with self._lock:
            best = None
            for key in self._entries:
                if len(key) < len(ids) and (best is None or len(key) > len(best)) and ids[:len(key)] == key:
                    best = key
            if best is None:
                self.misses += 1
                return 0, None
            self._entries.move_to_end(best)
            self.hits += 1
            self.cached_tokens += len(best)
            kept = self._entries[best].state
        # Copied outside the lock (a kept state is never changed), so a large copy does not hold up puts.
        return len(best), kept.snapshot()

    def put(self, ids: Sequence[int], state: DecodeState, *, copy: bool = True, pinned: bool = False) -> bool:
        """Keep ``state`` (which holds exactly ``ids``); a copy unless ``copy=False`` hands it over.
        Returns False when it was not kept (the cache is off or the state alone exceeds the budget)."""
        ids = tuple(ids)
        if state.num_tokens != len(ids):
            raise ValueError(f"the state holds {state.num_tokens} tokens, but {len(ids)} token ids were given")
        if not ids:
            return False
        size = state.nbytes()
        if not pinned and size > self.budget_bytes:
            return False
        kept = state.snapshot() if copy else state
        with self._lock:
            old = self._entries.pop(ids, None)
            if old is not None:
                self._count(old, -1)
            self._entries[ids] = entry = _Entry(kept, size, pinned or (old is not None and old.pinned))
            self._count(entry, +1)
            self._evict()
        return True

    def _count(self, entry: _Entry, sign: int) -> None:
        if entry.pinned:
            self._pinned += sign
        else:
            self._bytes += sign * entry.nbytes

    def _evict(self) -> None:
        for key in list(self._entries):
            if self._bytes <= self.budget_bytes:
                break
            entry = self._entries[key]
            if entry.pinned:
                continue
            del self._entries[key]
            self._count(entry, -1)
            self.evictions += 1

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                    "hits": self.hits, "misses": self.misses, "cached_tokens": self.cached_tokens,
                    "evictions": self.evictions}
