"""Rank 0's engine: a pass flows through every rank, and every state operation is mirrored on them.

A pass on rank 0 (``FrontEngine.device_pass``): a control message to every other rank (the state
operations since the last pass, then each sequence's state, ids, keep_states and wanted logits),
then rank 0 embeds and runs its layers, sends the rows (the residual stream, and under Block
Attention Residuals the block summaries so far, stacked into one tensor) to rank 1; each rank runs
its layers and hands the rows on; the last sends back the rows whose logits are wanted, and rank 0
runs the head over them. Each rank keeps the decode states of its own layers, keyed by a number
rank 0 gives each state.

The states rank 0 hands out (``FrontState``) hold rank 0's layers and note every operation on
them in the ``Mirror``: a new state, a rollback after a keep_states pass, a snapshot, a restore,
and a state dropped (garbage-collected). The notes travel with the next pass, in order, so the
other ranks' parts of every state are what a single process's would be when a pass reads them.

For bench, rank 0 keeps running totals too (``FrontEngine.ranks_report``): its passes, the seconds
its own layers took, and each pass's round trip (from handing the rows on until the last rank's rows
are back), from which the other ranks' layer seconds subtract to the time spent between ranks.
"""
from __future__ import annotations

import collections
import itertools
import time
import weakref

import torch

from ..model.state import DecodeState
from ..runtime.engine import Engine, Seq, logit_rows
from ..runtime.pass_stats import PassStats
from .transport import Group, LinkError, RankFault


def blocks_before(cfg, layer: int) -> int:
    """Block summaries Block Attention Residuals holds when `layer` starts (one per block begun)."""
    B = cfg.attn_res_block_size
    return (layer + B - 1) // B if B else 0


class Mirror:
    """The state operations since the last pass, to be replayed on every other rank."""

    def __init__(self):
        self._ops: collections.deque = collections.deque()  # appended from any thread (finalizers)
        self._keys = itertools.count(1)

    def adopt(self, plain: DecodeState) -> "FrontState":
        """A front state with a new key, holding `plain`'s layers; its drop is noted when it is collected."""
        state = FrontState(plain.layers, plain.num_tokens, plain._pass_start, self, next(self._keys))
        weakref.finalize(state, self._ops.append, ["drop", state.key])
        return state

    def note(self, *op) -> None:
        self._ops.append(list(op))

    def drain(self) -> list:
        out = []
        while self._ops:
            out.append(self._ops.popleft())
        return out


class FrontState(DecodeState):
    """A decode state of a split model on rank 0: rank 0's layers here, the others' on their ranks."""

    def __init__(self, layers, num_tokens: int, pass_start, mirror: Mirror, key: int):
        super().__init__(layers=layers, num_tokens=num_tokens, _pass_start=pass_start)
        self.mirror, self.key = mirror, key

    def rollback(self, num_tokens: int) -> None:
        super().rollback(num_tokens)
        self.mirror.note("rollback", self.key, num_tokens)

    def snapshot(self) -> "FrontState":
        snap = self.mirror.adopt(DecodeState(self.layers, self.num_tokens, self._pass_start).snapshot())
        self.mirror.note("snapshot", self.key, snap.key)
        return snap

    def restore(self, snap: DecodeState) -> None:
        if not isinstance(snap, FrontState) or snap.mirror is not self.mirror:
            raise ValueError("a state of a model split across ranks restores only a snapshot of this model's states")
        DecodeState.restore(self, DecodeState(snap.layers, snap.num_tokens, snap._pass_start))
        self.mirror.note("restore", self.key, snap.key)

    def save(self, path, header: dict) -> None:
        raise ValueError("a decode state of a model split across ranks cannot be saved to a file yet")


class FrontEngine(Engine):
    """The engine of rank 0: its own layers, the embedding and the head; the rest on the other ranks."""

    def __init__(self, group: Group, cfg, provider, settings, row_threads, layers: range):
        super().__init__(cfg, provider, settings, row_threads, layers)
        self.group = group
        self.mirror = Mirror()
        self.passes, self.layer_seconds, self.round_trip_seconds = 0, 0.0, 0.0

    def ranks_report(self) -> list[dict]:
        """Every rank's running totals, rank 0's first (between passes: see worker.Tally); rank 0's
        pass statistics are its own PassStats, which the engine's observers see."""
        group = self.group
        group.check_up()
        mine = {"rank": 0, "passes": self.passes, "layer_seconds": self.layer_seconds,
                "round_trip_seconds": self.round_trip_seconds, "sent_bytes": group.sent_bytes}
        try:
            for r in range(1, group.world_size):
                group.send_message(r, "report")
            return [mine] + [group.recv_message(r) for r in range(1, group.world_size)]
        except LinkError as e:
            raise group.at_fault(e) from None

    def new_state(self) -> FrontState:
        state = self.mirror.adopt(super().new_state())
        self.mirror.note("new", state.key)
        return state

    def device_pass(self, h: torch.Tensor, seqs: list[Seq], stats: PassStats, routes=()) -> torch.Tensor:
        group, cfg = self.group, self.cfg
        group.check_up()
        for s in seqs:
            if not isinstance(s.state, FrontState) or s.state.mirror is not self.mirror:
                raise ValueError("a pass of a model split across ranks takes only states from its new_state()")
        message = {"ops": self.mirror.drain(),
                   "seqs": [[s.state.key, list(s.ids), s.keep_states, s.logits] for s in seqs]}
        wanted = len(logit_rows(seqs))
        try:
            for r in range(1, group.world_size):
                group.send_message(r, message)
            blocks: list[torch.Tensor] = []
            t0 = time.perf_counter()
            h = self.run_layers(h, blocks, seqs, stats, routes)
            t1 = time.perf_counter()
            group.send_rows(1, torch.stack([*blocks, h]))
            back = group.recv_rows(group.last, (blocks_before(cfg, cfg.num_layers) + 1, wanted, cfg.hidden_size))
            self.passes += 1
            self.layer_seconds += t1 - t0
            self.round_trip_seconds += time.perf_counter() - t1
        except LinkError as e:
            raise group.at_fault(e) from None
        except BaseException:
            # The other ranks wait for rows that will not come: the group cannot go on.
            group.fault = RankFault("rank 0 failed within a pass")
            raise
        return self.head(back[-1], list(back[:-1]), seqs, stats)
