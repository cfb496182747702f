"""A measured figure with its spread over repeats, and the one rule that tells noise from change.

A throughput figure is recorded as its median under its own key, with a sibling
`<key>_spread` object {low, high, repeats} (the min and max over the repeats), so
`dvc metrics diff` shows both. Two figures differ by *change* only when their ranges do
not overlap; overlapping ranges are *noise*. A side without a recorded spread (one
repeat, or a record older than spreads) cannot be told apart: *unmeasured*.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Verdict = Literal["noise", "change", "unmeasured"]
SUFFIX = "_spread"
BUSY = "machine"
"""The key, inside a `<key>_spread`, of what the machine gave the process while it measured (`Busy`)."""


@dataclass(frozen=True)
class Busy:
    """What the machine gave this process while it measured: its CPU time (user + system, all threads) against
    the wall time, the CPUs it may run on, and the 1-minute load average at the end. A process that wanted T
    threads of CPU and got less was waiting on other work (cpu_over_wall < T); a load above the CPUs says the
    machine had more runnable threads than cores. No root needed, nothing changed."""

    cpu_s: float
    wall_s: float
    cpus: int
    load_1m: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "cpu_s": round(self.cpu_s, 3),
            "wall_s": round(self.wall_s, 3),
            "cpu_over_wall": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "cpus": self.cpus,
            "load_1m": None if self.load_1m is None else round(self.load_1m, 2),
        }


class Measuring:
    """`with Measuring() as m: <the timed work>`, then `m.busy`: the Busy of that window."""

    busy: Busy | None = None

    def __enter__(self) -> Measuring:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
        self.busy = Busy(time.process_time() - self._cpu, time.perf_counter() - self._wall, cpus, load)


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        values = [float(v) for v in samples]
        if not values:
            raise ValueError("a spread needs at least one sample")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def to_json(self, digits: int = 2) -> dict:
        return {"low": round(self.low, digits), "high": round(self.high, digits), "repeats": self.repeats}

    def record(self, key: str, digits: int = 2, busy: Busy | None = None) -> dict:
        """{key: median, key_spread: {low, high, repeats}}: how a metrics file holds this figure; with `busy`, the
        spread also says what the machine gave the process while it measured (`machine`: Busy.to_json)."""
        spread = self.to_json(digits) | ({BUSY: busy.to_json()} if busy is not None else {})
        return {key: round(self.median, digits), key + SUFFIX: spread}

    @classmethod
    def read(cls, metrics: dict, key: str) -> Spread | None:
        """The figure `key` of a metrics dict with its `<key>_spread`; None when either is missing or malformed."""
        value, spread = metrics.get(key), metrics.get(key + SUFFIX)
        if not isinstance(value, int | float) or not isinstance(spread, dict):
            return None
        try:
            return cls(float(value), float(spread["low"]), float(spread["high"]), int(spread["repeats"]))
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        return f"{self.median:g} (range {self.low:g}..{self.high:g}, {self.repeats} repeats)"


def compare(before: Spread | None, after: Spread | None) -> Verdict:
    """noise: the two ranges overlap; change: they do not; unmeasured: a side has no spread of 2+ repeats."""
    if before is None or after is None or before.repeats < 2 or after.repeats < 2:
        return "unmeasured"
    return "noise" if before.low <= after.high and after.low <= before.high else "change"


def clock(device) -> float:
    """Wall time after `device` (a torch.device) has finished what was queued: CUDA runs asynchronously, so
    a timer read without the sync would stop before the work. The one clock of bench's and evaluate's timings."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()
