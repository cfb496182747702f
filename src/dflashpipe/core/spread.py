"""A measured figure with its spread over repeats, and the one rule that tells noise from change.

A throughput figure is recorded as its median under its own key, with a sibling
`<key>_spread` object {low, high, repeats} (the min and max over the repeats), so
`dvc metrics diff` shows both. Two figures differ by *change* only when their ranges do
not overlap; overlapping ranges are *noise*. A side without a recorded spread (one
repeat, or a record older than spreads) cannot be told apart: *unmeasured*.

A rate measured by a process can move because the machine gave it less, with no input changed. So each
measuring window also times a control (`control_ms`: a fixed matmul on the same device, before and after the
work) and records it in the spread's `machine` facts. A rate that changed is called *machine* when undoing the
control's move (its factor) brings the two ranges back to overlap: only what is
left beyond the control is a change an input could have made.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflashpipe.core.artifacts import json_number

Verdict = Literal["noise", "change", "unmeasured", "machine"]
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
    control_ms: tuple[float, float] | None = None
    """The control (`control_ms()`) timed just before and just after the work; None when it could not run."""
    cuda: dict[str, Any] | None = None
    """On a CUDA device, what NVML says decides its speed at the end (`cuda_facts`); None elsewhere or unread."""

    def to_json(self) -> dict[str, Any]:
        control = {}
        if self.control_ms is not None:
            control = {CONTROL: {"before": self.control_ms[0], "after": self.control_ms[1]}}
        return {
            "cpu_s": round(self.cpu_s, 3),
            "wall_s": round(self.wall_s, 3),
            "cpu_over_wall": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "cpus": self.cpus,
            "load_1m": None if self.load_1m is None else round(self.load_1m, 2),
            **control,
            **({"cuda": self.cuda} if self.cuda is not None else {}),
        }


def cuda_facts(device: Any) -> dict[str, Any] | None:
    """A CUDA device's speed as NVML reports it now: the SM clock against its maximum, the power draw against
    the enforced limit, and how many other processes compute on it. None off CUDA, or without NVML
    (`pynvml`, the nvidia-ml-py package): absent, never guessed."""
    try:
        import torch

        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
            return None
        import pynvml

        pynvml.nvmlInit()
        # NVML numbers the devices physically; torch maps its index through CUDA_VISIBLE_DEVICES
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(dev))
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return {
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "power_draw_w": round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000, 1),
            "power_limit_w": round(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000, 1),
            "other_processes": sum(1 for p in processes if p.pid != os.getpid()),
        }
    except Exception:  # no NVML library, no permission, an old driver: the facts are absent, the run goes on
        return None


CONTROL = "control_ms"
"""The key, inside a spread's `machine` facts, of the control's {before, after} times in milliseconds."""
CONTROL_SHAPE = (256, 1024, 1024)
CONTROL_BLOCK = 16
"""Matmuls timed together: ~45 ms on 2 quiet cores, longer than the scheduler's slices, so a busy neighbour
shows in it as it does in the work (beside two spinning processes a block slowed 3.1-3.7x as a 64-matmul
round did 2.9-3.1x; one matmul alone, 4.5-5.5x)."""
CONTROL_REPEATS = 3


def control_ms(device: Any = None) -> float | None:
    """The control: milliseconds per fixed float32 matmul ([256, 1024] @ [1024, 1024], about 0.5 GFLOP), the
    median over CONTROL_REPEATS blocks of CONTROL_BLOCK after one untimed call, on `device` (a torch.device or
    name; None: the CPU) at this thread's intra-op count. The same work at every commit, so its time moves
    only with the machine. None (absent, never zero) when it cannot run there."""
    try:
        import torch

        dev = torch.device(device if device is not None else "cpu")
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            return None
        m, k, n = CONTROL_SHAPE
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(m, k, generator=generator).to(dev)
        b = torch.randn(k, n, generator=generator).to(dev)
        torch.mm(a, b)  # allocates and warms up: not timed
        times = []
        for _ in range(CONTROL_REPEATS):
            began = clock(dev)
            for _ in range(CONTROL_BLOCK):
                torch.mm(a, b)
            times.append((clock(dev) - began) / CONTROL_BLOCK)
        return round(statistics.median(times) * 1000, 3)
    except (ImportError, RuntimeError):
        return None


class Measuring:
    """`with Measuring(device) as m: <the timed work>`, then `m.busy`: the Busy of that window, the control
    timed on `device` just before and just after it (outside the window's wall time; its OpenMP threads may
    spin a few milliseconds into the window's CPU time, nothing beside a stage's seconds-long windows)."""

    busy: Busy | None = None

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def __enter__(self) -> Measuring:
        self._control = control_ms(self.device)
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
        cpu, wall = time.process_time() - self._cpu, time.perf_counter() - self._wall
        after = control_ms(self.device)
        control = None if self._control is None or after is None else (self._control, after)
        self.busy = Busy(cpu, wall, cpus, load, control, cuda_facts(self.device))


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


@dataclass(frozen=True)
class Control:
    """One side's control times (ms), before and after its measurement."""

    before: float
    after: float

    @classmethod
    def read(cls, machine: dict | None) -> Control | None:
        """From a spread's `machine` facts (nested or as flattened `control_ms.before/after` keys); None if absent."""
        if not isinstance(machine, dict):
            return None
        nested = machine.get(CONTROL)
        pair = (
            (nested.get("before"), nested.get("after"))
            if isinstance(nested, dict)
            else (machine.get(f"{CONTROL}.before"), machine.get(f"{CONTROL}.after"))
        )
        if not all((json_number(v) or 0) > 0 for v in pair):
            return None
        return cls(float(pair[0]), float(pair[1]))

    @property
    def low(self) -> float:
        return min(self.before, self.after)

    @property
    def high(self) -> float:
        return max(self.before, self.after)

    @property
    def mean(self) -> float:
        return (self.before + self.after) / 2


def slowdown(before: Control, after: Control) -> float:
    """How many times slower the machine ran the control on the after side (< 1: faster)."""
    return after.mean / before.mean


def compare_rates(
    before: Spread | None, after: Spread | None, control_before: Control | None, control_after: Control | None
) -> Verdict:
    """`compare` for a rate (work per second), the control taken into account: a change that undoing the
    control's move explains is *machine*. The after side's range is scaled by the control's factor (the mean
    of its before and after times on each side, `slowdown`) and compared again; a change still left is a
    change. (Scaling by the extremes of the two controls instead called a 2x slower commit measured beside
    two busy processes "machine": benchmarks/bisect_slowdown.py.) Without a control on both sides,
    `compare` as it is."""
    call = compare(before, after)
    if call != "change" or control_before is None or control_after is None:
        return call
    assert before is not None and after is not None
    factor = slowdown(control_before, control_after)
    low, high = after.low * factor, after.high * factor
    return "machine" if before.low <= high and low <= before.high else "change"


def pool(spreads: Sequence[Spread], controls: Sequence[Control | None] = ()) -> tuple[Spread, Control | None]:
    """Repeated runs of one measurement as one figure, by the one rule every rerun uses (bisect's probes, the
    arms of `explain --verify`): the median of the runs' medians, the widest range, every repeat counted.

    For a rate whose every run timed the control (`controls`, one per run), each run's range is first brought
    to one machine speed, scaled by its control's mean time over the runs' mean control time as `compare_rates`
    scales a side, so that runs taken under different loads pool as one measurement; the pooled figure then
    carries that mean control, and is compared with `compare_rates` like any recorded one. A figure recorded
    without a spread is a run of one repeat (`Spread.of([value])`)."""
    if not spreads:
        raise ValueError("pooling needs at least one run")
    joined = None
    if len(controls) == len(spreads) and all(c is not None for c in controls):
        joined = statistics.mean(c.mean for c in controls)
        spreads = [
            Spread(s.median * f, s.low * f, s.high * f, s.repeats)
            for s, f in ((s, c.mean / joined) for s, c in zip(spreads, controls, strict=True))
        ]
    pooled = Spread(
        statistics.median(s.median for s in spreads),
        min(s.low for s in spreads),
        max(s.high for s in spreads),
        sum(s.repeats for s in spreads),
    )
    return pooled, None if joined is None else Control(joined, joined)


def clock(device) -> float:
    """Wall time after `device` (a torch.device) has finished what was queued: CUDA runs asynchronously, so
    a timer read without the sync would stop before the work. The one clock of bench's and evaluate's timings."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()
