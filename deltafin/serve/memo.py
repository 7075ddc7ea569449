"""Answers to deterministic requests, kept so that a repeated request is answered without the engine.

A deterministic request (greedy, or sampling from a fixed seed: ``SamplingParams.deterministic``)
for the same served name, prompt tokens and parameters always gets the same answer, so the server
keeps the last ``memo_size`` of them, least recently used first out. What an entry holds: each
choice's pieces as they were streamed (text and logprobs, so a remembered answer streams the same
way and is read for tool calls the same way), its token count and its generation's finish reason,
and the prompt tokens that were cached. The key is the caller's (the service's: the served name and
the job); nothing here looks inside it. Used from the event loop thread only; it holds no lock.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoChoice:
    pieces: tuple  # (text, logprob entry or None) per returned token, as it was streamed
    completion_tokens: int
    finish_reason: str  # the generation's (the response reads tool calls from the text)


@dataclass(frozen=True)
class MemoEntry:
    choices: tuple[MemoChoice, ...]
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


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
