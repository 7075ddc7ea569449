"""Admission to the engine for ``deltafin serve``: how many generations run at once, and who waits.

``EngineGate`` hands out ``max_batch`` slots (the scheduler batches the generations holding them
into shared passes). Beyond them, at most ``queue_size`` requests wait, first come first served,
each for at most ``queue_timeout`` seconds; a request refused for either reason gets
``EngineBusy``, a 429. A client that goes away while waiting gives up its place. What it trusts:
its callers, all on the event loop thread; it holds no lock.
"""
from __future__ import annotations

import asyncio
import collections

from .protocol import APIError


class EngineBusy(APIError):
    def __init__(self, message: str, code: str):
        super().__init__(429, message, code=code, type="rate_limit_error")


class EngineGate:
    """Admits up to ``slots`` generations at a time. At most ``queue_size`` requests wait, first
    come first served, each for at most ``queue_timeout`` seconds. Used from the event loop thread
    only."""

    def __init__(self, queue_size: int, queue_timeout: float, slots: int = 1):
        self.queue_size = queue_size
        self.queue_timeout = max(float(queue_timeout), 0.0)
        self.slots = slots
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def busy(self) -> bool:
        return self.running >= self.slots

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, abandon: asyncio.Event) -> bool:
        """Wait for the engine. True: it is ours (call ``release`` once done). False: ``abandon``
        was set while waiting. Raises EngineBusy when the queue is full or the wait times out."""
        if not self.busy:
            self.running += 1
            return True
        if len(self._waiters) >= self.queue_size:
            raise EngineBusy(f"the engine is busy and {len(self._waiters)} request(s) are already waiting "
                             f"(queue_size={self.queue_size}); retry later", code="queue_full")
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        gone = asyncio.ensure_future(abandon.wait())
        try:
            await asyncio.wait({turn, gone}, timeout=self.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release()  # the engine was handed to us just as we were cancelled
            raise
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
                self._waiters.remove(turn)
        if turn.cancelled():
            if abandon.is_set():
                return False
            raise EngineBusy(f"the engine stayed busy for the whole queue_timeout of {self.queue_timeout:g} s; "
                             "retry later", code="queue_timeout")
        if abandon.is_set():
            self.release()
            return False
        return True

    def release(self) -> None:
        # A freed slot passes straight to the next live waiter, so a newcomer cannot jump the queue.
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
