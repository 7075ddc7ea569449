"""The loop of every rank but 0: wait for rank 0's next pass, run this rank's layers, hand the rows on.

The rank keeps its layers' part of every decode state by the key rank 0 gave it and replays the
state operations each control message lists before its pass (see pipeline.py). It prints nothing
to stdout. It ends with rank 0's "stop" (0), or when a peer fails (a fault report filed, then
RankFault: exit status 1). Between passes rank 0 may ask for the rank's running totals
("report": ``Tally.report``), which bench turns into per-rank figures.
"""
from __future__ import annotations

import time

import torch

from ..model.state import STATE_DTYPES, DecodeState
from ..runtime.engine import Engine, Seq, logit_rows
from ..runtime.pass_stats import PassStats
from .pipeline import blocks_before, layer_rows, state_announcement
from .transport import Group, LinkError, RankFault, Sent


class Tally:
    """A rank's running totals since it started: its passes, the seconds its layers took (compute
    and their weights' reads) and their pass statistics."""

    def __init__(self):
        self.passes, self.layer_seconds, self.stats = 0, 0.0, PassStats()

    def report(self, group: Group) -> dict:
        return {"rank": group.rank, "passes": self.passes, "layer_seconds": self.layer_seconds,
                "compute_seconds": self.stats.compute_seconds, "disk_bytes": self.stats.bytes_read,
                "ram_bytes": self.stats.bytes_from_ram, "sent_bytes": group.sent_bytes}


def serve_passes(group: Group, engine: Engine) -> int:
    """Serve rank 0's passes until it says stop (or a peer fails, which raises RankFault)."""
    states: dict[int, DecodeState] = {}
    tally = Tally()
    sent: Sent | None = None  # the last pass's rows, handed on (transport.Sent)
    while True:
        try:
            message = group.recv_message(0, bounded=False)
            if message == "report":
                group.send_message(0, tally.report(group))
                continue
        except LinkError as e:
            raise RankFault(f"rank {group.rank}: rank 0 {e.why}; stopping") from None
        if message == "stop":
            return 0  # rank 0 stops once every pass it began has ended: their rows were taken
        if isinstance(message, dict) and ("state_out" in message or "state_in" in message):
            try:
                _state_transfer(group, engine, message, states)
            except LinkError as e:
                group.report(e)
                raise RankFault(f"rank {group.rank}: {e}; stopping") from None
            continue
        try:
            seqs = _pass_of(message, states, engine)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RankFault(f"rank {group.rank}: rank 0 sent a pass this rank cannot run ({type(e).__name__}: {e}); "
                            "stopping") from None
        try:
            sent = _run_pass(group, engine, seqs, message["base"], tally, sent)
        except LinkError as e:
            group.report(e)
            raise RankFault(f"rank {group.rank}: {e}; stopping") from None


def _apply(op: list, states: dict, engine: Engine) -> None:
    kind, key, *rest = op
    if kind == "new":
        states[key] = engine.new_state()
    elif kind == "drop":
        states.pop(key, None)
    elif kind == "rollback":
        states[key].rollback(rest[0])
    elif kind == "snapshot":
        states[rest[0]] = states[key].snapshot()
    elif kind == "restore":
        states[key].restore(states[rest[0]])
    else:
        raise ValueError(f"unknown state operation {kind!r} from rank 0")


def _state_transfer(group: Group, engine: Engine, message: dict, states: dict) -> None:
    """Rank 0 saves a state (``state_out``: send this rank's part) or loads one (``state_in``:
    receive it, checked against a fresh state of this rank's layers before anything is received)."""
    try:
        for op in message["ops"]:
            _apply(op, states, engine)
        if "state_out" in message:
            state = states[message["state_out"]]
            state.check_savable()
            tensors = state.tensors(engine.layers.start)
            group.send_message(0, state_announcement(tensors, state.num_tokens))
            for t in tensors.values():
                if t.numel():
                    group.send_tensor(0, t)
            return
        key, n = message["state_in"], message["num_tokens"]
        if not (type(n) is int and 0 <= n <= MAX_STATE_TOKENS):
            raise ValueError(f"a state of {n!r} tokens")
        layout = engine.new_state()
        expect = layout.expected(n, engine.layers.start)
        order = [name for name, _, _ in message["tensors"]]  # the tensors come in the order announced
        told = {name: (dtype, shape) for name, dtype, shape in message["tensors"]}
        want = {name: (STATE_DTYPES[t.dtype], list(t.shape)) for name, t in expect.items()}
        if told != want or len(order) != len(want):
            raise ValueError("the state's tensors do not match this rank's layers")
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise LinkError(0, f"asked for a state transfer this rank cannot make ({type(e).__name__}: {e})") from None
    got = {name: group.recv_tensor(0, expect[name]).to(expect[name].device) if expect[name].numel() else expect[name]
           for name in order}
    states[key] = layout.assembled(got, n, engine.layers.start)


# The longest state rank 0 may hand a rank (tokens): far beyond any context, far below a size that
# could not be allocated anyway (an MLA layer's cache is ~2 kB a token).
MAX_STATE_TOKENS = 1 << 24

# Rows one pass may carry: a pass of max_batch sequences' prompt pieces stays far below it; a message
# asking for more is refused before its rows are allocated.
MAX_PASS_ROWS = 1 << 16


def _pass_of(message: dict, states: dict, engine: Engine) -> list[Seq]:
    """The pass a control message describes, after its state operations (raises on a malformed one)."""
    for op in message["ops"]:
        _apply(op, states, engine)
    seqs = []
    for key, ids, keep, logits, reach in message["seqs"]:
        if type(reach) is not int or not 0 <= reach <= MAX_STATE_TOKENS:
            raise ValueError(f"a sequence reaching {reach!r} tokens")
        seqs.append(Seq(list(ids), states[key], bool(keep), logits, reach=reach))
    rows = sum(len(s.ids) for s in seqs)
    if not 0 < rows <= MAX_PASS_ROWS:
        raise ValueError(f"a pass of {rows} rows (at most {MAX_PASS_ROWS})")
    base = message["base"]  # where its states sit in the slots (past MAX_SLOTS the plain pass runs)
    if type(base) is not int or not 0 <= base <= MAX_PASS_ROWS:
        raise ValueError(f"state slots from {base!r}")
    return seqs


@torch.inference_mode()
def _run_pass(group: Group, engine: Engine, seqs: list[Seq], base: int, tally: Tally, before: Sent | None) -> Sent:
    """This rank's layers over a pass's rows, handed on to the next rank without waiting for it to
    take them (it may be busy with the pass before); `before`, the last pass's rows, must have been
    taken first."""
    cfg = engine.cfg
    n = sum(len(s.ids) for s in seqs)
    x = group.recv_rows(group.rank - 1, (blocks_before(cfg, engine.layers.start) + 1, n, cfg.hidden_size),
                        engine.device)
    stats = PassStats(tokens=n)
    for s in seqs:
        s.state.begin_pass(s.keep_states)
    t0 = time.perf_counter()
    with engine.pass_threads(n):
        rows = layer_rows(engine, x, seqs, stats, base)
    tally.layer_seconds += time.perf_counter() - t0
    for s in seqs:
        s.state.num_tokens += len(s.ids)
    engine.last_pass = stats
    tally.passes += 1
    tally.stats.add(stats)
    if group.rank == group.last:  # only the rows whose logits rank 0 wants go back
        wanted = logit_rows(seqs)
        if len(wanted) != n:
            rows = rows[:, wanted.to(rows.device)]
    if before is not None:
        before.wait()
    return group.send_rows(group.next_rank(), rows, wait=False)
