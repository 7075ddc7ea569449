"""Host memory as the RAM caches see it: how much is genuinely free, and whether it is under pressure.

What counts as free: ``MemFree`` of ``/proc/meminfo`` and, inside a memory cgroup (v1 or v2, every
level up to the root that has a limit), the limit minus the group's usage. Reclaimable page cache
is never counted as free: it is already serving someone's reads (and in a cgroup it is part of the
usage), and a cache that grows into it only moves the misses elsewhere.

Pressure: the share of time tasks stalled on memory since the last look, from the stall totals of
the process's own cgroup (``memory.pressure``, cgroup v2) where present, else of the host
(``/proc/pressure/memory``, its ``full`` line: a neighbour's cgroup reclaiming at its own limit
shows up in the host's ``some`` line without concerning us).

Every reader takes the root of the file tree (``/`` on a real machine), so tests point them at a
tree they write. A file that is missing, unreadable or garbled reads as "unknown" (None), never as
an error: the budget then falls back to what it does know.

``MemoryBudget`` turns these readings into the bytes the caches may hold now (see ``check``), and
``Watcher`` asks it a few times a second from a daemon thread and applies the answer to a cache, so
memory goes back while decode runs (or while a server idles) without the decode thread waiting.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from ..units import GB, MiB

# Room left free under an automatic budget (activations, states, the allocator, other programs).
HEADROOM_MIN = 256 * MiB
HEADROOM_FRACTION = 0.04
# A memory stall share above this (since the last look) makes the caches give back an eighth of
# what they hold, and stop growing for COOLDOWN_S seconds.
PRESSURE_SHARE = 0.05
COOLDOWN_S = 5.0
GROW_WINDOW_S = 3.0
# The streamer's own buffers come and go (expert slots, prefetch buffers), and free memory counts
# them only while they exist. Measured against their peak over this window, the caches do not give
# memory back each time those buffers come and take it again when they go. (The spine read-ahead
# buffers, which made a spine go out and back in every few tokens on k3-slice in a 6 GiB group, are
# planned with the spines instead: see ram_cache.)
FIXED_WINDOW_S = 10.0
WATCH_INTERVAL_S = 0.2
# cgroup v1 writes "no limit" as a huge page-rounded number; anything above this is no limit.
NO_LIMIT = 1 << 60


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/")), "r", encoding="ascii", errors="replace") as f:
            return f.read(1 << 16)
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return v if 0 <= v < NO_LIMIT else None


def read_meminfo(root: str = "/") -> dict[str, int]:
    """/proc/meminfo in bytes ({} when unreadable); garbled lines are skipped."""
    out = {}
    for line in (_read(root, "/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def read_stall_us(root: str, path: str, line: str) -> int | None:
    """The ``total=`` microseconds of a PSI file's ``some`` or ``full`` line, or None."""
    for row in (_read(root, path) or "").splitlines():
        words = row.split()
        if words and words[0] == line:
            for w in words[1:]:
                if w.startswith("total="):
                    return _int(w[6:])
    return None


@dataclass(frozen=True)
class CgroupLevel:
    version: int
    path: str  # relative to the root of the file tree
    limit: int | None  # bytes; None = no limit at this level
    usage: int | None


def cgroup_levels(root: str = "/", pid: str = "self") -> list[CgroupLevel]:
    """The process's memory cgroup and its ancestors (innermost first), v1 or v2; [] when none."""
    text = _read(root, f"/proc/{pid}/cgroup") or ""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    if v1 is not None and _read(root, "/sys/fs/cgroup/memory/memory.usage_in_bytes") is not None:
        return _levels(root, "/sys/fs/cgroup/memory", v1, 1, "memory.limit_in_bytes", "memory.usage_in_bytes")
    for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if v2 is not None and _read(root, mount + "/cgroup.controllers") is not None:
            return _levels(root, mount, v2, 2, "memory.max", "memory.current")
    return []


def _levels(root: str, mount: str, path: str, version: int, limit_file: str, usage_file: str) -> list[CgroupLevel]:
    parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
    # Inside a container without a cgroup namespace the path names the host's hierarchy, which
    # is then not mounted: its own group is the mount's root.
    while parts and not os.path.isdir(os.path.join(root, mount.lstrip("/"), *parts)):
        parts.pop(0)
    out = []
    while True:
        rel = "/".join([mount, *parts])
        limit = _int(_read(root, f"{rel}/{limit_file}"))
        if version == 2:
            high = _int(_read(root, f"{rel}/memory.high"))
            limit = high if limit is None or (high is not None and high < limit) else limit
        out.append(CgroupLevel(version, rel, limit, _int(_read(root, f"{rel}/{usage_file}"))))
        if not parts:
            return out
        parts.pop()


@dataclass(frozen=True)
class Reading:
    """One look at memory."""
    free: int | None  # genuinely free bytes (the least over the host and every limited cgroup level)
    limit: int | None  # the binding memory size: the tightest cgroup limit, else MemTotal
    where: str  # what set `free`: "host" or "cgroup v1 /path" / "cgroup v2 /path"
    stall_us: int | None  # cumulative memory-stall microseconds (the cgroup's, else the host's)


def read_memory(root: str = "/", pid: str = "self") -> Reading:
    info = read_meminfo(root)
    free, limit, where = info.get("MemFree"), info.get("MemTotal"), "host"
    stall = None
    for level in cgroup_levels(root, pid):
        if level.version == 2 and stall is None:
            stall = read_stall_us(root, f"{level.path}/memory.pressure", "some")
        if level.limit is None or level.usage is None:
            continue
        room = max(0, level.limit - level.usage)
        if free is None or room < free:
            free, where = room, f"cgroup v{level.version} {level.path}"
        if limit is None or level.limit < limit:
            limit = level.limit
    if stall is None:
        stall = read_stall_us(root, "/proc/pressure/memory", "full")
    return Reading(free, limit, where, stall)


def _window(seen: deque, now: float, value: int, span: float) -> deque:
    """`seen` with (now, value) added and the entries older than `span` seconds dropped."""
    seen.append((now, value))
    while seen[0][0] < now - span:
        seen.popleft()
    return seen


class MemoryBudget:
    """The bytes the RAM caches may hold, from a fixed setting and what memory looks like now.

    ``ceiling``: bytes the setting allows for the caches and the streamer's own buffers together
    (None = auto: no ceiling but free memory). Either way the caches grow only into memory that
    stayed free above the headroom for the last few seconds, shrink at once by the shortfall when
    free memory falls below it, and by an eighth (and stop growing for a while) when memory
    pressure appears."""

    def __init__(self, ceiling: int | None, root: str = "/", clock=time.monotonic):
        self.ceiling = ceiling
        self.root = root
        self.clock = clock
        self._last_stall: tuple[float, int] | None = None
        self._cooldown_until = 0.0
        self._seen: deque[tuple[float, int]] = deque()
        self._fixed_seen: deque[tuple[float, int]] = deque()
        self.last: Reading | None = None

    def headroom(self, r: Reading) -> int:
        return max(HEADROOM_MIN, int(HEADROOM_FRACTION * r.limit)) if r.limit else HEADROOM_MIN

    def pressure_share(self, r: Reading) -> float:
        """Share of wall time stalled on memory since the previous call (0 on the first)."""
        now = self.clock()
        prev, self._last_stall = self._last_stall, (now, r.stall_us) if r.stall_us is not None else None
        if prev is None or r.stall_us is None or now <= prev[0]:
            return 0.0
        return max(0, r.stall_us - prev[1]) / 1e6 / (now - prev[0])

    def fixed_peak(self, fixed: int, now: float) -> int:
        """The most the streamer's own buffers took over the last FIXED_WINDOW_S seconds."""
        return max(f for _, f in _window(self._fixed_seen, now, fixed, FIXED_WINDOW_S))

    def check(self, held: int, fixed: int, target: int) -> tuple[int, str]:
        """(new cache target in bytes, why) given what the caches hold now (`held`), the streamer's
        own buffers now (`fixed`) and the current target."""
        r = self.last = read_memory(self.root)
        now = self.clock()
        peak = self.fixed_peak(fixed, now)
        top = None if self.ceiling is None else max(0, self.ceiling - peak)
        if r.free is None:  # nothing known about memory: only a set budget can be trusted
            return (top if top is not None else held), "free memory unknown"
        headroom = self.headroom(r)
        free = r.free - (peak - fixed)  # as if the streamer's buffers were at their recent peak
        room = free - headroom
        share = self.pressure_share(r)
        _window(self._seen, now, held + free, GROW_WINDOW_S)  # what the caches could reach now
        where = f"{r.where} free {r.free / GB:.2f} GB, headroom {headroom / GB:.2f}"
        if peak > fixed:
            where += f", {(peak - fixed) / GB:.2f} kept for the streamer's buffers"
        if share > PRESSURE_SHARE:
            self._cooldown_until = self.clock() + COOLDOWN_S
            new = min(target, held - max(held // 8, 1), held + room)
            why = f"memory pressure {share * 100:.0f}% ({where})"
        elif room < 0:
            new, why = min(target, held + room), f"{where}"
        elif self.clock() < self._cooldown_until:
            new, why = min(target, held + room), f"cooling down after pressure ({where})"
        else:
            # Grow only into what stayed free through the last GROW_WINDOW_S seconds (the process's
            # own transient allocations come and go within that), less a margin: the caches do
            # not flap with every swing of free memory.
            low = min(reach for _, reach in self._seen) - headroom - headroom // 4
            new, why = (min(low, held + room) if low > target else min(target, held + room)), where
        if top is not None:
            new = min(new, top)
            why += f", set budget {self.ceiling / GB:g} GB less the streamer's {peak / GB:.2f}"
        return max(0, new), why

    def describe(self, fixed: int) -> str:
        """The start-up line: the budget and how it was set."""
        r = read_memory(self.root)
        what = (f"{self.ceiling / GB:g} GB set" if self.ceiling is not None
                else "auto (grows into free memory, gives it back under pressure)")
        seen = (f"{r.free / GB:.2f} GB free now ({r.where}; page cache not counted), headroom "
                f"{self.headroom(r) / GB:.2f} GB" if r.free is not None else "free memory unknown")
        return f"ram budget {what}: {seen}; the streamer's own buffers take {fixed / GB:.2f} GB of it"


class Watcher:
    """Applies ``budget.check`` to a cache: on ``check()``, and every `interval` seconds from a
    daemon thread (none when `interval` is None).

    The thread references the watcher weakly, so dropping the watcher (with its provider) stops it."""

    def __init__(self, budget: MemoryBudget, cache, interval: float | None = WATCH_INTERVAL_S):
        self.budget, self.cache = budget, cache
        self._stop = threading.Event()
        self._thread = None
        if interval is not None:
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, interval),
                                            daemon=True, name="deltafin-memory")
            self._thread.start()

    def check(self) -> None:
        c = self.cache
        target, why = self.budget.check(c.charged_bytes(), c.fixed_bytes, c.target)
        c.set_target(target, why)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _watch(ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        w = ref()
        if w is None:
            return
        try:
            w.check()
        except Exception as e:  # a watcher must never take decode down; say it once and stop
            print(f"deltafin: memory watch stopped: {e}", file=sys.stderr)
            return
        del w
