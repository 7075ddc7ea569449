"""Counters and gauges, rendered in the Prometheus text format (``GET /metrics`` of the server).

A ``Registry`` holds named metrics; any part of deltafin that has something to count asks the
registry for a counter (``registry.counter(name, help, labels)``) once and calls ``inc`` on it,
from any thread. Gauges are read when the page is rendered, from a function the owner gives
(queue depth, cache sizes), so nothing has to keep them up to date. Asking twice for the same
name returns the same metric, so independent parts may share one.

Only the two metric types deltafin needs; names follow Prometheus' conventions (``_total`` for
counters, base units: bytes, seconds).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Counter:
    """A monotonically increasing count per combination of label values."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labels = name, help, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0)

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        with self._lock:
            return sorted(self._values.items())


class Gauge:
    """A value read from ``fn`` each time the metrics are rendered."""

    kind = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float]):
        self.name, self.help, self.labels, self.fn = name, help, (), fn

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        return [((), self.fn())]


class ReadCounter:
    """A count kept by its owner and read when the page is rendered: ``fn()`` gives the value, or,
    with labels, a dict from the tuple of label values to the value."""

    kind = "counter"

    def __init__(self, name: str, help: str, fn: Callable, labels: tuple[str, ...] = ()):
        self.name, self.help, self.fn, self.labels = name, help, fn, tuple(labels)

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        return sorted(self.fn().items()) if self.labels else [((), self.fn())]


class Registry:
    def __init__(self):
        self._metrics: dict[str, Counter | Gauge | ReadCounter] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(name, lambda: Counter(name, help, labels), Counter)

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> Gauge:
        return self._add(name, lambda: Gauge(name, help, fn), Gauge)

    def read_counter(self, name: str, help: str, fn: Callable, labels: tuple[str, ...] = ()) -> ReadCounter:
        return self._add(name, lambda: ReadCounter(name, help, fn, labels), ReadCounter)

    def _add(self, name: str, make, kind):
        with self._lock:
            m = self._metrics.get(name)
            if m is None:
                m = self._metrics[name] = make()
            elif not isinstance(m, kind):
                raise ValueError(f"metric {name} is already registered as a {m.kind}")
            return m

    def render(self) -> str:
        """Every metric in the Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines = []
        for m in metrics:
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            for key, v in m.samples():
                labels = ",".join(f'{k}="{_escape(val)}"' for k, val in zip(m.labels, key))
                lines.append(f"{m.name}{{{labels}}} {_number(v)}" if labels else f"{m.name} {_number(v)}")
        return "\n".join(lines) + "\n"
