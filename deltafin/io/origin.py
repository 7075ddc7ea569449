"""Where a streamed read's bytes come from, and which byte counter of the pass they go to: the
model's files on disk, or for a hub source its local cache or the network."""
from __future__ import annotations

from .reader import Layout


class ReadOrigin:
    def __init__(self, source):
        self._origin = getattr(source, "origin", None)  # a hub source's: "cache" / "network" per file

    def of(self, layout: Layout) -> str:
        """"disk", or for a hub source "cache" / "network" (decided when the read is asked for:
        the hub cache fetches what is missing first)."""
        if self._origin is None or not layout.runs:
            return "disk"
        return self._origin(layout.runs[0].file)


def count(stats, origin: str, nbytes: int) -> None:
    if origin == "disk":
        stats.bytes_read += nbytes
    elif origin == "cache":
        stats.bytes_from_cache += nbytes
    else:
        stats.bytes_from_network += nbytes
