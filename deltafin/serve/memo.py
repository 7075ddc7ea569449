"""Answers to deterministic requests, kept so that a repeated request is answered without the engine.

A deterministic request (greedy, or sampling from a fixed seed: ``SamplingParams.deterministic``)
for the same served name, prompt tokens and parameters always gets the same answer, so the server
keeps the last ``memo_size`` of them, least recently used first out. What an entry holds: the text
as it was streamed (its pieces, so a remembered answer streams the same way), the token counts and
the finish reason. The key is the caller's (the service's: the served name and the job); nothing
here looks inside it. Used from the event loop thread only; it holds no lock.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoEntry:
    pieces: tuple[str, ...]  # the text as it was streamed
    completion_tokens: int
    finish_reason: str
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ResponseMemo:
    """Least-recently-used answers to deterministic requests; size 0 keeps nothing."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict[tuple, MemoEntry] = collections.OrderedDict()

    def get(self, key: tuple) -> MemoEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: MemoEntry) -> None:
        if self.size <= 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
