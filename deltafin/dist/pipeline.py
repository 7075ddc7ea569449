"""Rank 0's engine: a pass flows through every rank, and every state operation is mirrored on them.

A pass on rank 0 (``FrontEngine.device_pass``): a control message to every other rank (the state
operations since the last pass, then each sequence's state, ids, keep_states and wanted logits),
then rank 0 embeds and runs its layers, sends the rows (the residual stream, and under Block
Attention Residuals the block summaries so far, stacked into one tensor) to rank 1; each rank runs
its layers and hands the rows on; the last sends back the rows whose logits are wanted, and rank 0
runs the head over them. Each rank keeps the decode states of its own layers, keyed by a number
rank 0 gives each state.

Passes pipeline: ``start_device_pass`` returns once rank 0's layers are done and its rows handed
on (the receive of the last rank's rows posted first, and its sends posted, not waited for: see
transport.Sent), so rank 0 can start the pass of another group
of sequences while rank 1 runs the first's; every rank takes the messages and rows of passes in the
order they were sent, and rank 0 ends passes in the order it began them (the scheduler keeps
``--pipeline`` passes in flight, one per rank by default).

The states rank 0 hands out (``FrontState``) hold rank 0's layers and note every operation on
them in the ``Mirror``: a new state, a rollback after a keep_states pass, a snapshot, a restore,
and a state dropped (garbage-collected). The notes travel with the next pass, in order, so the
other ranks' parts of every state are what a single process's would be when a pass reads them.

A state saved to a file (``FrontState.save``: a conversation's saved state, the prompt cache) is
the file one process writes, the same tensor names for every layer: rank 0 asks each rank for its
layers' part (``state_out``: the names, dtypes and shapes in a control message, then the tensors),
checks the announcement against the rank's layers before receiving anything, and writes one file.
Loading reads rank 0's layers and sends every other rank its part (``state_in``), which the rank
checks against its own fresh state before receiving it. Either way a file written by one process
is read by a split model and the other way round.

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

from ..model.state import STATE_DTYPES, DecodeState, StateFileError, read_state_tensors, state_tensor_names, \
    write_state_file
from ..runtime.engine import Engine, Seq, logit_rows
from ..runtime.pass_stats import PassStats
from .transport import Group, LinkError, RankFault


def blocks_before(cfg, layer: int) -> int:
    """Block summaries Block Attention Residuals holds when `layer` starts (one per block begun)."""
    B = cfg.attn_res_block_size
    return (layer + B - 1) // B if B else 0


def layer_rows(engine: Engine, x: torch.Tensor, seqs: list[Seq], stats: PassStats, base: int,
               routes=()) -> torch.Tensor:
    """The engine's layers (a rank's) over a pass's rows x [summaries + 1, rows, H] (the block
    summaries so far, then the residual stream), stacked alike after them: a replayed graph of them
    where the pass's shape records (runtime.decode_graph; its states in the slots from `base` on),
    else each layer's kernels launched."""
    g = engine.graphs
    if g is not None and not routes and g.applies(seqs, base):
        return g.run_rows(seqs, x, stats, base)
    return engine.run_stacked(x, seqs, stats, routes)


class Mirror:
    """The state operations since the last pass, to be replayed on every other rank."""

    def __init__(self, engine: "FrontEngine"):
        self._ops: collections.deque = collections.deque()  # appended from any thread (finalizers)
        self._keys = itertools.count(1)
        self._engine = weakref.ref(engine)  # saves and loads go through it

    @property
    def engine(self) -> "FrontEngine":
        return self._engine()

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
        self.check_savable()
        write_state_file(path, self.mirror.engine.gather_state(self), self.num_tokens, header)

    def loaded(self, path) -> "FrontState":
        return self.mirror.engine.scatter_state(self, path)


class FrontEngine(Engine):
    """The engine of rank 0: its own layers, the embedding and the head; the rest on the other ranks."""

    def __init__(self, group: Group, cfg, provider, settings, row_threads, layers: range, ranges: list[range]):
        super().__init__(cfg, provider, settings, row_threads, layers)
        self.group = group
        self.ranges = ranges  # every rank's layers
        self.mirror = Mirror(self)
        self.passes, self.layer_seconds, self.round_trip_seconds = 0, 0.0, 0.0
        # passes begun, oldest first: (token, the state slots their sequences take)
        self._in_flight: collections.deque = collections.deque()

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

    def gather_state(self, state: FrontState) -> dict[str, torch.Tensor]:
        """Every layer's state tensors of `state` (named as one process names them): rank 0's, and
        each other rank's, asked for and checked against that rank's layers before they are read."""
        group = self.group
        group.check_up()
        out = state.tensors(self.layers.start)
        ops = self.mirror.drain()  # every rank replays the same operations first
        try:
            for r in range(1, group.world_size):
                group.send_message(r, {"ops": ops, "state_out": state.key})
            for r in range(1, group.world_size):
                told = group.recv_message(r)
                for name, like in _announced(told, self.ranges[r], state.num_tokens, r).items():
                    out[name] = group.recv_tensor(r, like) if like.numel() else like
        except LinkError as e:
            raise group.at_fault(e) from None
        return out

    def scatter_state(self, fresh: FrontState, path) -> FrontState:
        """`fresh` holding the state saved in `path`: rank 0's layers read here, each other rank's
        part read here and sent to it (the rank checks it against its own layers)."""
        group, cfg = self.group, self.cfg
        group.check_up()
        n = DecodeState.read_header(path)["num_tokens"]
        names = state_tensor_names(cfg.kda_layers, range(cfg.num_layers))
        layout = DecodeState(fresh.layers)
        mine = layout.expected(n, self.layers.start)
        got = layout.assembled(read_state_tensors(path, mine, names), n, self.layers.start)
        parts = []
        for r in range(1, group.world_size):
            parts.append(_read_raw(path, sorted(state_tensor_names(cfg.kda_layers, self.ranges[r]))))
        ops = self.mirror.drain()
        try:
            for r, part in enumerate(parts, 1):
                group.send_message(r, {"ops": ops, "state_in": fresh.key, **state_announcement(part, n)})
                for t in part.values():
                    if t.numel():
                        group.send_tensor(r, t)
        except LinkError as e:
            raise group.at_fault(e) from None
        fresh.layers, fresh.num_tokens = got.layers, n
        return fresh

    def new_state(self) -> FrontState:
        state = self.mirror.adopt(super().new_state())
        self.mirror.note("new", state.key)
        return state

    def device_pass(self, h: torch.Tensor, seqs: list[Seq], stats: PassStats, routes=()) -> torch.Tensor:
        return self.start_device_pass(h, seqs, stats, routes)()

    def _slot_base(self, seqs: list[Seq]) -> int:
        """The first of the state slots a pass's sequences take on every rank where passes replay
        graphs (runtime.decode_graph): where they sit already if no pass in flight holds those slots,
        else past the slots of the passes in flight, so that groups taking turns never move each
        other's states out (every rank follows the same bases, so where they sit on rank 0 is where
        they sit on every rank)."""
        B = len(seqs)

        def free(base: int) -> bool:
            return not any(base < r.stop and r.start < base + B for _, r in self._in_flight)
        here = self.graphs.slot_of(seqs[0].state) if self.graphs is not None else None
        if here is not None and free(here):
            return here
        base = 0
        while not free(base):
            base = next(r.stop for _, r in self._in_flight if base < r.stop and r.start < base + B)
        return base

    def start_device_pass(self, h: torch.Tensor, seqs: list[Seq], stats: PassStats, routes=()):
        """Rank 0's layers over the pass's rows, handed on to rank 1; the function returned waits for
        the last rank's rows and runs the head. Between the two, rank 0 may start other passes (of
        other sequences): their control messages and rows queue behind this one's on every rank, and
        the rows come back in the order the passes started, which is the order they must end in."""
        group, cfg = self.group, self.cfg
        group.check_up()
        for s in seqs:
            if not isinstance(s.state, FrontState) or s.state.mirror is not self.mirror:
                raise ValueError("a pass of a model split across ranks takes only states from its new_state()")
        base = self._slot_base(seqs)
        message = {"ops": self.mirror.drain(), "base": base,
                   "seqs": [[s.state.key, list(s.ids), s.keep_states, s.logits, s.reach] for s in seqs]}
        wanted = len(logit_rows(seqs))
        try:
            # Posted, not waited for: a rank still busy with an earlier pass takes them when it is done.
            sends = [group.send_message(r, message, wait=False) for r in range(1, group.world_size)]
            t0 = time.perf_counter()
            rows = layer_rows(self, h.unsqueeze(0), seqs, stats, base, routes)
            t1 = time.perf_counter()
            back = group.expect_rows(group.last, (blocks_before(cfg, cfg.num_layers) + 1, wanted, cfg.hidden_size),
                                     self.device)
            sends.append(group.send_rows(1, rows, wait=False))
        except LinkError as e:
            raise group.at_fault(e) from None
        except BaseException:
            # The other ranks wait for rows that will not come: the group cannot go on.
            group.fault = RankFault("rank 0 failed within a pass")
            raise
        self.layer_seconds += t1 - t0
        token = object()
        self._in_flight.append((token, range(base, base + len(seqs))))

        def finish() -> torch.Tensor:
            if not self._in_flight or self._in_flight[0][0] is not token:
                group.fault = RankFault("rank 0 ended passes out of order")
                raise RuntimeError("passes of a model split across ranks end in the order they began")
            self._in_flight.popleft()
            group.check_up()
            try:
                for sent in sends:
                    sent.wait()
                rows = back.wait()
            except LinkError as e:
                raise group.at_fault(e) from None
            self.passes += 1
            # With other passes in flight this includes their turns on the other ranks.
            self.round_trip_seconds += time.perf_counter() - t1
            return self.head(rows[-1], list(rows[:-1]), seqs, stats)
        return finish


_DTYPES = {v: k for k, v in STATE_DTYPES.items()}
# The most bytes one rank's part of a decode state may announce (a long conversation's MLA caches
# over a few layers take far less); more is refused before anything is allocated.
MAX_STATE_PART_BYTES = 16 << 30


def state_announcement(tensors: dict[str, torch.Tensor], num_tokens: int) -> dict:
    """What a rank tells rank 0 before sending its part of a state."""
    return {"num_tokens": num_tokens,
            "tensors": [[k, STATE_DTYPES[t.dtype], list(t.shape)] for k, t in tensors.items()]}


def _announced(told, layers: range, num_tokens: int, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors of the dtypes and shapes rank `rank` announced for its part of a state, after
    checking the announcement: its layers' names, known dtypes, the state's length, a bounded size."""
    try:
        if told.get("num_tokens") != num_tokens:
            raise ValueError(f"holds {told.get('num_tokens')!r} tokens, rank 0 holds {num_tokens}")
        out, total = {}, 0
        prefixes = {f"layers.{i}." for i in layers}
        for name, dtype, shape in told["tensors"]:
            if not (isinstance(name, str) and name.rsplit(".", 1)[0] + "." in prefixes and dtype in _DTYPES
                    and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                raise ValueError(f"announced {name!r} {dtype!r} {shape!r}")
            like = torch.empty(0, dtype=_DTYPES[dtype])
            total += like.element_size() * int(torch.Size(shape).numel())
            if total > MAX_STATE_PART_BYTES:
                raise ValueError(f"announced more than {MAX_STATE_PART_BYTES} bytes")
            out[name] = torch.empty(shape, dtype=_DTYPES[dtype])
        return out
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise LinkError(rank, f"announced a state part this model cannot hold ({e})") from None


def _read_raw(path, want: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a saved state file as stored (the rank they go to checks them)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return {name: f.get_tensor(name) for name in want}
    except Exception as e:
        raise StateFileError(f"{path}: cannot read the state ({type(e).__name__}: {e})") from None
