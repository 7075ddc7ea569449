"""Messages and rows between the ranks of a split model, over torch.distributed (gloo on the CPU).

One process group of every rank, two kinds of traffic told apart by tag:

- control (rank 0 -> each rank): a JSON message per pass, saying what the pass carries and which
  state operations come before it, or "stop". A rank between passes waits for it without a deadline
  (a server may idle for days); the wait ends when rank 0's process ends (its connection closes).
- rows (along the chain 0 -> 1 -> ... -> N-1 -> 0): the residual stream of the pass's rows, as one
  float32 tensor whose shape both ends know from the control message. Every wait for rows, and every
  send, within a pass is bounded by ``dist_timeout``. Ranks that compute on a GPU send their rows
  from host memory and receive them there, then move them onto their device (gloo carries CPU
  tensors); a pass's rows are a few kB a token, so the copies cost microseconds.
- state tensors (rank 0 <-> one rank, between passes): a saved decode state's part for that rank's
  layers, whose names, dtypes and shapes a control message announced and the receiver checked
  against its own fresh state first (``send_tensor`` / ``recv_tensor``).

A rank that fails a wait or a send within a pass files a fault report in the rendezvous store naming
the rank it was talking to, and exits. Rank 0, when its own wait fails, names the rank at fault from
the reports: a rank some report names that filed none itself (the others only saw it go); without a
report, the rank it was waiting for.

JSON, not pickle: the transport has no authentication, and a message must not be able to run code.
"""
from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist

from ..errors import DeltafinError

CONTROL, ROWS, STATE = 1, 2, 3  # message tags
# A control message lists a pass's sequences (their new token ids) and state operations: a few MB at
# the most. A length beyond this is refused before anything is allocated.
MAX_MESSAGE_BYTES = 64 << 20


class RankFault(DeltafinError):
    """A rank of the group exited, was killed or stopped answering; the message names it."""


class LinkError(Exception):
    """A send or receive with one peer failed (closed connection or timeout)."""

    def __init__(self, peer: int, why: str):
        super().__init__(f"rank {peer} {why}")
        self.peer, self.why = peer, why


def _why(e: Exception, timeout: float) -> str:
    text = str(e)
    if "Timed out" in text or "timeout" in text.lower():
        return f"stopped answering (nothing within --dist-timeout {timeout:g} s)"
    return "is gone (its connection closed: the process exited or was killed)"


class Group:
    """This process's place in the group: its rank, the world size, and the channels above."""

    def __init__(self, rank: int, world_size: int, store, timeout: float, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.store = store  # the rendezvous store: fault reports
        self.timeout = timeout
        self.fault: RankFault | None = None  # set once a pass failed: the group is down for good
        self.sent_bytes = 0  # everything this rank sent (control and rows): the wire's share of bench

    @property
    def last(self) -> int:
        return self.world_size - 1

    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    # -- control -----------------------------------------------------------------------------
    def send_message(self, dst: int, message, wait: bool = True) -> "Sent":
        """A JSON value to `dst`, bounded by the timeout (a stopped rank's socket fills); with
        wait=False the send is only posted (see ``Sent``)."""
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        return self._send([torch.tensor([data.numel()], dtype=torch.int64), data], dst, CONTROL, wait)

    def recv_message(self, src: int, bounded: bool = True):
        """The next JSON value from `src`; unbounded: wait as long as it takes (between passes)."""
        n = torch.zeros(1, dtype=torch.int64)
        self._recv(n, src, CONTROL, bounded)
        size = int(n.item())
        if not 0 <= size <= MAX_MESSAGE_BYTES:
            raise LinkError(src, f"sent a control message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
        data = torch.empty(size, dtype=torch.uint8)
        self._recv(data, src, CONTROL, bounded)
        try:
            return json.loads(bytes(data.numpy()).decode())
        except ValueError:  # not UTF-8, or not JSON
            raise LinkError(src, "sent a control message that is not JSON") from None

    def gather(self, value) -> list:
        """Every rank's JSON value, in rank order, on every rank (at start: no deadline but the
        launcher's; every rank calls it)."""
        data = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(got, mine)
        return [json.loads(bytes(g[:int(s.item())].numpy()).decode()) for g, s in zip(got, sizes)]

    # -- rows --------------------------------------------------------------------------------
    def send_rows(self, dst: int, rows: torch.Tensor, wait: bool = True) -> "Sent":
        """`rows` (float32, on any device: a GPU's are copied to host memory first) to `dst`."""
        return self._send([rows.detach().to("cpu").contiguous()], dst, ROWS, wait)

    def recv_rows(self, src: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
        return self.expect_rows(src, shape, device).wait()

    def expect_rows(self, src: int, shape: tuple[int, ...], device=None) -> "Expected":
        """Rows from `src` received into a buffer posted now; ``wait()`` returns them (bounded by the
        timeout from when it is called), on `device` (default the CPU). Receives posted for one peer
        are filled in the order posted, so rank 0 posts the receive of a pass's rows before it hands
        them on: the last rank's send back never waits on rank 0, which may be busy with the next pass."""
        out = torch.empty(shape, dtype=torch.float32)
        try:
            return Expected(self, src, out, dist.irecv(out, src, tag=ROWS), device)
        except RuntimeError as e:
            raise LinkError(src, _why(e, self.timeout)) from None

    # -- state tensors -----------------------------------------------------------------------
    def send_tensor(self, dst: int, t: torch.Tensor) -> None:
        self._send([t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)], dst, STATE)

    def recv_tensor(self, src: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s dtype and shape (which the caller checked), on the CPU."""
        out = torch.empty(like.shape, dtype=like.dtype)
        self._recv(out.view(torch.uint8).reshape(-1), src, STATE, bounded=True)
        return out

    # -- faults ------------------------------------------------------------------------------
    def report(self, e: LinkError) -> None:
        """File this rank's fault report (a rank other than 0, before it exits)."""
        try:
            self.store.set(f"fault/{self.rank}", json.dumps({"rank": e.peer, "why": e.why}))
        except Exception:  # the store went with rank 0's host: nobody is left to read the report
            pass

    def at_fault(self, e: LinkError) -> RankFault:
        """Rank 0: the error naming the rank at fault, after its own link to `e.peer` failed."""
        reports = {}
        for r in range(1, self.world_size):
            key = f"fault/{r}"
            try:
                if self.store.check([key]):
                    reports[r] = json.loads(self.store.get(key))
            except Exception:
                continue
        named = sorted({rep["rank"] for rep in reports.values() if rep["rank"] not in reports and rep["rank"] != 0})
        if named:
            culprit = named[0]
            why = next(rep["why"] for rep in reports.values() if rep["rank"] == culprit)
        else:
            culprit, why = e.peer, e.why
        self.fault = RankFault(f"rank {culprit} of {self.world_size} {why}; the request is lost. Restart the "
                               "group (torchrun --max-restarts restarts it by itself)")
        return self.fault

    def check_up(self) -> None:
        if self.fault is not None:
            raise RankFault(f"the group is down: {self.fault}")

    # -- internals ---------------------------------------------------------------------------
    def _send(self, tensors: list[torch.Tensor], dst: int, tag: int, wait: bool = True) -> "Sent":
        try:
            sent = Sent(self, dst, [(t, dist.isend(t, dst, tag=tag)) for t in tensors])
        except RuntimeError as e:
            raise LinkError(dst, _why(e, self.timeout)) from None
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if wait:
            sent.wait()
        return sent

    def _recv(self, t: torch.Tensor, src: int, tag: int, bounded: bool) -> None:
        try:
            work = dist.irecv(t, src, tag=tag)
            work.wait(datetime.timedelta(seconds=self.timeout)) if bounded else work.wait()
        except RuntimeError as e:
            raise LinkError(src, _why(e, self.timeout)) from None


class Expected:
    """A receive posted (``Group.expect_rows``) and not yet waited for."""

    def __init__(self, group: Group, src: int, out: torch.Tensor, work, device=None):
        self.group, self.src, self.out, self.work, self.device = group, src, out, work, device

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait(datetime.timedelta(seconds=self.group.timeout))
        except RuntimeError as e:
            raise LinkError(self.src, _why(e, self.group.timeout)) from None
        return self.out if self.device is None else self.out.to(self.device)


class Sent:
    """Sends posted to one peer (``wait=False``). A send completes once the peer has posted its receive,
    so a rank that is busy with an earlier pass would hold the sender up: rank 0 posts a pass's
    sends and goes on to its next pass, and waits for them when the pass ends; a rank waits for its
    last pass's rows to be taken before it hands on the next pass's. The tensors stay referenced
    until then."""

    def __init__(self, group: Group, dst: int, parts: list):
        self.group, self.dst, self.parts = group, dst, parts

    def wait(self) -> None:
        """Bounded by the timeout from when it is called (each part)."""
        for _, work in self.parts:
            try:
                work.wait(datetime.timedelta(seconds=self.group.timeout))
            except RuntimeError as e:
                raise LinkError(self.dst, _why(e, self.group.timeout)) from None
        self.parts = []
