"""Where time and bytes went: per-pass lines and a summary from the engine's ``PassStats``.

``PassRecorder`` is an engine observer (``with model.observe(recorder):``) that keeps each forward
pass's stats, optionally reporting every pass as it ends. ``deltafin run --profile`` and ``deltafin
bench`` both use it.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from .runtime.pass_stats import PassObserver, PassStats
from .units import GB, MB


class PassRecorder(PassObserver):
    """Every pass's stats (and when it ended); ``report(index, stats)`` is called as each one ends."""

    def __init__(self, report: Callable[[int, PassStats], None] | None = None):
        self.report = report
        self.passes: list[PassStats] = []
        self.ended: list[float] = []  # perf_counter() at the end of each pass

    def on_pass(self, stats: PassStats) -> None:
        self.passes.append(stats)
        self.ended.append(time.perf_counter())
        if self.report is not None:
            self.report(len(self.passes) - 1, stats)


SOURCES = (("network", "bytes_from_network"), ("disk_cache", "bytes_from_cache"), ("disk", "bytes_read"),
           ("ram", "bytes_from_ram"), ("device", "bytes_on_device"))


def _by_source(s: PassStats) -> str:
    """"net 1.00 cache 2.00 disk 3.00 ram 4.00 MB", leaving out the sources this model does not use."""
    used = [(name, getattr(s, field)) for name, field in SOURCES
            if getattr(s, field) or name in ("disk", "ram")]
    return " ".join(f"{name.replace('disk_cache', 'cache').replace('network', 'net')} {n / MB:.2f}"
                    for name, n in used) + " MB"


def format_pass(index: int, s: PassStats) -> str:
    """One line: pass number, tokens, time, bytes by source, I/O waits, compute."""
    return (f"pass {index:4d} {s.tokens:4d} tok {s.seconds * 1e3:9.1f} ms | {_by_source(s)} "
            f"| wait spine {s.spine_wait_seconds * 1e3:7.1f} ms "
            f"experts {s.expert_wait_seconds * 1e3:7.1f} ms | compute {s.compute_seconds * 1e3:8.1f} ms | "
            f"experts {s.experts_loaded}"
            + (f" | host->device {s.bytes_to_device / MB:.2f} MB" if s.bytes_to_device else "")
            + (f" | ram cache spines {s.spines_cached}/{s.spines_loaded} experts {s.experts_cached}/{s.experts_loaded}"
               if s.spines_cached or s.experts_cached else ""))


def summarize(passes: list[PassStats]) -> dict:
    """Totals and per-token means over the given passes."""
    total = PassStats()
    for s in passes:
        total.add(s)
    n = max(total.tokens, 1)
    other = total.seconds - total.compute_seconds - total.spine_wait_seconds - total.expert_wait_seconds
    return {
        "passes": len(passes),
        "tokens": total.tokens,
        "seconds": total.seconds,
        "tok_s": total.tokens / total.seconds if total.seconds > 0 else 0.0,
        "ms_per_token": total.seconds * 1e3 / n,
        "read_bytes_per_token": total.bytes_read / n,
        "ram_bytes_per_token": total.bytes_from_ram / n,
        "bytes_per_token": sum(getattr(total, field) for _, field in SOURCES) / n,
        # Where each byte a token used came from: fetched from the hub for it, the hub's local
        # cache, the model's own files, memory, or the compute device's memory.
        "bytes_by_source_per_token": {name: getattr(total, field) / n for name, field in SOURCES},
        "device_bytes_per_token": total.bytes_on_device / n,
        "h2d_bytes_per_token": total.bytes_to_device / n,  # of the bytes above, those copied to the device
        "host_compute_bytes_per_token": total.bytes_host_compute / n,  # ... and those computed on the host's cores
        "experts_per_token": total.experts_loaded / n,
        # Shares served by host RAM (pinned or cached) of the spines and of the routed experts the host
        # streamer served (under a device: those the device did not hold); None where nothing was streamed.
        "spine_cache_hit_rate": total.spines_cached / total.spines_loaded if total.spines_loaded else None,
        "expert_cache_hit_rate": (total.experts_cached / total.experts_streamed
                                  if total.experts_streamed else None),
        # Of all routed experts: those served by the device's memory, the host-RAM cache, the disk
        # (None but on a device that streams).
        "expert_hit_rates": ({"device": 1 - total.experts_streamed / total.experts_loaded,
                              "ram": total.experts_cached / total.experts_loaded,
                              "disk": (total.experts_streamed - total.experts_cached) / total.experts_loaded}
                             if total.bytes_on_device and total.experts_streamed else None),
        "spine_wait_seconds": total.spine_wait_seconds,
        "expert_wait_seconds": total.expert_wait_seconds,
        "compute_seconds": total.compute_seconds,
        "other_seconds": max(other, 0.0),
        "read_gbps": total.bytes_read / total.seconds / GB if total.seconds > 0 else 0.0,
        "prefetch_bytes_per_token": total.prefetch_bytes / n,
        # of the bytes read ahead of the router on a guess, the share the router then chose (None: no prefetch)
        "prefetch_useful_rate": total.prefetch_used_bytes / total.prefetch_bytes if total.prefetch_bytes else None,
    }


def format_summary(passes: list[PassStats], prefill: bool = True, made: int | None = None) -> str:
    """A short report: the prefill pass (the first, when `prefill`) and the decode passes after it.
    ``made``: the tokens those decode passes produced, where checked drafts make them fewer than the
    rows the passes fed (a speculating run): the rate is then of tokens made, the means per row fed."""
    lines = []
    if prefill and passes:
        p = passes[0]
        lines.append(f"prefill: {p.tokens} tok in {p.seconds * 1e3:.1f} ms "
                     f"({p.tokens / p.seconds if p.seconds > 0 else 0:.1f} tok/s), {_by_source(p)}")
        passes = passes[1:]
    if passes:
        d = summarize(passes)
        t = max(d["seconds"], 1e-12)
        drafts = made is not None and made != d["tokens"]
        if drafts:
            lines.append(f"decode: {made} tok in {d['passes']} passes ({d['tokens']} rows fed, drafts included), "
                         f"{made / t:.2f} tok/s, {t * 1e3 / max(made, 1):.1f} ms/tok")
        else:
            lines.append(f"decode: {d['tokens']} tok in {d['passes']} passes, {d['tok_s']:.2f} tok/s, "
                         f"{d['ms_per_token']:.1f} ms/tok")
        per = PassStats(**{field: round(d["bytes_by_source_per_token"][name]) for name, field in SOURCES})
        lines.append(f"  per {'row' if drafts else 'token'}: {_by_source(per)}, {d['experts_per_token']:.1f} experts; "
                     f"disk {d['read_gbps']:.2f} GB/s"
                     + (f"; host->device {d['h2d_bytes_per_token'] / MB:.2f} MB" if d["h2d_bytes_per_token"] else ""))
        if d["spine_cache_hit_rate"] is not None:
            lines.append(f"  ram cache hits: spines {d['spine_cache_hit_rate'] * 100:.0f}%"
                         + (f", experts {d['expert_cache_hit_rate'] * 100:.0f}%"
                            if d["expert_cache_hit_rate"] is not None else ""))
        if d["prefetch_useful_rate"] is not None:
            lines.append(f"  prefetch: {d['prefetch_bytes_per_token'] / MB:.2f} MB/token read ahead, "
                         f"{100 * d['prefetch_useful_rate']:.0f}% of it then routed to")
        lines.append(f"  time: compute {100 * d['compute_seconds'] / t:.0f}%, spine wait "
                     f"{100 * d['spine_wait_seconds'] / t:.0f}%, "
                     f"expert wait {100 * d['expert_wait_seconds'] / t:.0f}%, "
                     f"other {100 * d['other_seconds'] / t:.0f}%")
    return "\n".join(lines)
