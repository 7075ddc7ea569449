"""Byte units, defined once.

Budgets a person sets (``--ram-budget``, ``--gpu-budget``, ``--hub-cache-gb``) and the lines that
print them, or what counts against them, are in decimal units: GB = 10^9 bytes, as disks and
memory sticks are sold. The binary units size buffers and headroom in code, where a power of two
is the natural step; they are not what a budget's number means.
"""
from __future__ import annotations

MB = 10**6
GB = 10**9

MiB = 2**20
GiB = 2**30
