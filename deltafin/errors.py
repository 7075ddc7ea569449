"""The one error type for input deltafin refuses and faults it can name.

Every problem with a data file (config, index, shard, store manifest), a setting, or reading
the weights is raised as a ``DeltafinError`` (or a subclass naming where it came from). The
command line prints it as one ``deltafin: error: ...`` line and exits with code 2; the server
answers it without local paths. It is a ``ValueError`` so callers that already catch that keep
working.
"""
from __future__ import annotations


class DeltafinError(ValueError):
    """Bad input or a fault deltafin can name: the message says what, where, and what to do."""


class DeviceOutOfMemory(DeltafinError):
    """The compute device had no memory left for a pass: too many sequences or too long a prompt piece.
    Only the requests of that pass end; the server is not degraded by it."""
