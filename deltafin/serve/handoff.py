"""Items the engine thread hands to asyncio queues (each request's pieces), delivered on their loop."""
from __future__ import annotations

import asyncio
import contextlib
import threading


class Handoff:
    """What the engine thread hands to asyncio queues, delivered on their event loop. A hand-off wakes
    the loop (``call_soon_threadsafe``: a write to its self-pipe) only when none is pending there: the
    tokens a pass gives every stream go over in one wake-up, where a wake-up per token and stream was
    most of the engine thread's work between passes with 8 streams (on the CPU, 15 of the 25 samples it
    spent handing out tokens). Inside ``deferred()`` (the scheduler's hand-out of a pass) the wake-ups
    wait for the block's end, so the loop does not start writing the streams, and take the GIL, while
    the engine thread is still handing the pass's tokens out. Each queue gets its items in the order
    they were put."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}  # loop -> [(queue, item)], a wake-up owed
        self._owed: list[asyncio.AbstractEventLoop] = []  # loops whose wake-up a deferred block holds back
        self._local = threading.local()

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        """From any thread: `item` into `queue` on `loop` (RuntimeError if the loop is closed and the
        wake-up is not deferred; a deferred one drops what a closed loop would get)."""
        with self._lock:
            waiting = self._pending.get(loop)
            if waiting is not None:
                waiting.append((queue, item))
                return
            self._pending[loop] = [(queue, item)]
            if getattr(self._local, "deferring", False):
                self._owed.append(loop)
                return
        self._wake(loop, raising=True)

    @contextlib.contextmanager
    def deferred(self):
        """Puts from this thread inside the block wake their loops once, when it ends."""
        self._local.deferring = True
        try:
            yield
        finally:
            self._local.deferring = False
            with self._lock:
                owed, self._owed = self._owed, []
            for loop in owed:
                self._wake(loop, raising=False)

    def _wake(self, loop: asyncio.AbstractEventLoop, raising: bool) -> None:
        try:
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # the loop has closed: nobody will take what waits for it
            with self._lock:
                self._pending.pop(loop, None)
            if raising:
                raise

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            items = self._pending.pop(loop)
        for queue, item in items:
            queue.put_nowait(item)


HANDOFF = Handoff()  # one for the process: it keys what it holds by event loop
