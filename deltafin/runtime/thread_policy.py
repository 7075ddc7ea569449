"""How many threads the native products of a streamed model's one-token passes run on, decided from
where the pass's bytes came from.

While a one-token pass reads from the disk as it computes, product threads beyond the one the readers
leave free buy nothing: they only take the core the pread workers need. Once the tiers serve the pass
from RAM (the RAM cache warm and hitting, or a model that fits), the pass is compute-bound and every
core should compute. The policy watches each one-token pass's share of time spent waiting for weights
(``PassStats`` spine and expert waits) over the last ``WINDOW`` such passes, and moves between the two
counts with hysteresis, so a single slow read or a single cached pass does not flip it.

A pass that read no spine from the disk and guessed no experts ahead counts as not waiting, however
long it waited: its only reads were the experts its routers chose, which it waits for with its
products stopped, so the readers never needed a core while the products ran. (kl_medium q8 in a 3 GiB
group, every spine cached and 0.42 of the experts: 78-80 ms of products a token on one thread, 59-62
on two, the same waits for the experts.)
"""
from __future__ import annotations

from collections import deque

from .pass_stats import PassStats

WINDOW = 4  # one-token passes the decision looks back on
EVERY_CORE_BELOW = 0.05  # mean share of a pass spent waiting for weights: below it, every core computes
READERS_ABOVE = 0.20  # above it, the product threads leave the readers their core again


class ThreadPolicy:
    def __init__(self, waiting: int, every: int):
        """waiting: the threads while passes wait on the disk; every: the threads once they do not."""
        self.waiting, self.every = waiting, every
        self.now = waiting
        self._shares: deque[float] = deque(maxlen=WINDOW)
        self.switches = 0  # times the count changed (bench reports it)

    def after(self, stats: PassStats) -> None:
        """Account a one-token pass that has ended."""
        if stats.seconds <= 0:
            return
        read_beside = stats.spines_loaded > stats.spines_cached or stats.prefetch_bytes > 0
        waited = stats.spine_wait_seconds + stats.expert_wait_seconds if read_beside else 0.0
        self._shares.append(waited / stats.seconds)
        if len(self._shares) < WINDOW:
            return
        share = sum(self._shares) / len(self._shares)
        want = (self.every if share < EVERY_CORE_BELOW else self.waiting if share > READERS_ABOVE else self.now)
        if want != self.now:
            self.now = want
            self.switches += 1
            self._shares.clear()  # the next decision sees passes run with the new count only

    def summary(self) -> dict:
        return {"now": self.now, "waiting": self.waiting, "every": self.every, "switches": self.switches}
