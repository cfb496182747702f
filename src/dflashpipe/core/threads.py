"""One thread budget: how many intra-op threads each worker of a stage gets, from the cores it may use.

A stage's workers share the process's cores: train runs a thread per target and per drafter replica,
regenerate a thread per target device, evaluate and bench run in the main thread, tokenize forks
processes. Left alone, torch gives every thread the whole intra-op pool, so train's three threads on two
cores ran up to six busy threads (measured: docs/design.md, "Facts the code relies on"). `thread_budget`
divides the cores among the workers that compute on the CPU; each worker calls `ThreadBudget.apply` for
itself, in its own thread, before its first op; the stage records `ThreadBudget.to_json()` in its metrics.

The cores this process may use are the fewest of: its CPU affinity (`os.sched_getaffinity`), its cgroup
v2 quota (`/sys/fs/cgroup/cpu.max`, quota / period rounded up), and `DFLASHPIPE_CORES` when set (a
process sharing cores with siblings the OS does not know about: the pytest-xdist workers set it).
`os.cpu_count()` is none of these: it counts the machine's cores, not this process's.

How an idle thread waits is decided here too: `bound_the_spinning` caps libgomp's spinning (SPIN_COUNT),
which beside a busy neighbour process cost more than half of our speed.

What `torch.set_num_threads` does, with this torch (2.13 CPU build, OpenMP backend; measured, see
docs/design.md): it sets the *calling thread's* count (OpenMP's per-thread nthreads, which ATen's
parallel_for, MKL's sgemm and oneDNN's bf16 matmul all follow), but every thread first initialises its
count once, lazily at its first parallel op, from whatever value any thread of the process set last. A
worker that sets its count and then meets another worker's later set at its own first op runs with the
other's count. So `apply` forces this thread's initialisation first (`torch.get_num_threads()`), then sets.

A compiled function is bound to the count it was compiled at: dynamo guards on it (GLOBAL_STATE
num_threads: a drafter thread calling the step with another count than the main thread compiled it at
needs a recompile, which the compile guard stops), and inductor's FX cache key holds it (another count
misses warmup's artifact). So the drafter's count is decided once, by `training_budget`, from the topology
and this process's cores, and warmup (its compile), train (its main thread's load and warm-up, then each
drafter thread) and bench (its compile and its timed step) all set it; warmup records it in its
report, and train and bench refuse the artifact, compiling cold and saying why, when theirs differs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SPIN_ENV, WAIT_POLICY_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"
SPIN_COUNT = "10000"
"""How long an idle OpenMP thread of torch (GNU libgomp in the CPU wheels) spins before it sleeps: libgomp's
default is 300,000 spins, which beside another busy process burns the cores that process needs and is
descheduled mid-spin. Measured (benchmarks/neighbour.py, 2 cores, one busy matmul process beside, 3 round
pairs): busy / quiet speed of a decode step, 16 continuously batched replies and a features forward went
from 0.23 / 0.23 / 0.30 at the default to 0.39 / 0.43 / 0.48 at 10,000, quiet speed unchanged (39.8 vs 39.3
tokens/s, 68 vs 76, 778 vs 787); 1,000 cost quiet decoding 20%, 0 (sleep at once) half of it."""

CORES_ENV = "DFLASHPIPE_CORES"
"""Environment variable: at most this many cores for this process (pytest-xdist workers set it)."""
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2: `QUOTA PERIOD` in microseconds, or `max PERIOD` when unlimited."""


def bound_the_spinning(environ: dict[str, str] | None = None) -> None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless the user chose how idle threads wait (GOMP_SPINCOUNT or
    OMP_WAIT_POLICY set). libgomp reads it once, when torch loads it: dflashpipe's package import calls this,
    before any of its modules imports torch. The fingerprint records it with the other thread variables."""
    environ = os.environ if environ is None else environ
    if SPIN_ENV not in environ and WAIT_POLICY_ENV not in environ:
        environ[SPIN_ENV] = SPIN_COUNT


def quota_cores(cpu_max: str | None) -> int | None:
    """Cores a cgroup v2 `cpu.max` line allows (quota / period, rounded up, at least 1); None: no quota."""
    if not cpu_max:
        return None
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _read_cpu_max() -> str | None:
    try:
        return CPU_MAX.read_text(encoding="ascii")
    except OSError:
        return None


def _affinity() -> Collection[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadBudget:
    """The cores this process may use, what limits them, and the intra-op threads each worker role gets."""

    cores: int
    limited_by: str
    """affinity | cgroup cpu.max | DFLASHPIPE_CORES: the smallest of the three."""
    workers: dict[str, int]
    """Per role, how many of its workers compute on the CPU side by side."""
    threads: dict[str, int]
    """Per role, the intra-op threads each of its workers sets for itself."""

    def apply(self, role: str, device: object = "cpu") -> int:
        """Set the calling thread's intra-op threads to `role`'s budget (1 on an accelerator: that worker only
        launches kernels) and return it. Call in the worker's own thread before its first op."""
        import torch

        n = self.threads[role] if str(device).startswith("cpu") else 1
        torch.get_num_threads()  # this thread's one lazy initialisation, now, so it cannot undo the set below
        torch.set_num_threads(n)
        return n

    def to_json(self) -> dict:
        return {"cores": self.cores, "limited_by": self.limited_by, "workers": self.workers, "threads": self.threads}


def thread_budget(
    workers: Mapping[str, int],
    *,
    affinity: Collection[int] | None = None,
    cpu_max: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ThreadBudget:
    """The intra-op threads of each worker: this process's cores split evenly (rounded down, at least 1)
    among all the `workers` (role -> how many of that role run on the CPU at once; a role with 0 gets 1).

    `affinity`, `cpu_max` (the text of cgroup v2's cpu.max) and `env` default to this process's own."""
    affinity = _affinity() if affinity is None else affinity
    cpu_max = _read_cpu_max() if cpu_max is None else cpu_max
    env = os.environ if env is None else env
    limits = {"affinity": max(1, len(affinity))}
    quota = quota_cores(cpu_max)
    if quota is not None:
        limits["cgroup cpu.max"] = quota
    if env.get(CORES_ENV, "").strip():
        try:
            limits[CORES_ENV] = max(1, int(env[CORES_ENV]))
        except ValueError:
            from dflashpipe.core.errors import DflashpipeError

            raise DflashpipeError(f"{CORES_ENV}={env[CORES_ENV]!r}: not a whole number of cores") from None
    limited_by = min(limits, key=lambda k: limits[k])
    cores = limits[limited_by]
    busy = sum(max(0, n) for n in workers.values())
    each = max(1, cores // busy) if busy else cores
    return ThreadBudget(
        cores=cores,
        limited_by=limited_by,
        workers={role: n for role, n in workers.items()},
        threads={role: each if n > 0 else 1 for role, n in workers.items()},
    )


def training_budget(target_devices: Sequence[object], drafter_devices: Sequence[object]) -> ThreadBudget:
    """train's split: the target threads and the drafter threads that compute on the CPU share the cores.
    warmup and bench compile and time the drafter step at its "drafter" count, the one train runs it at."""
    return thread_budget(
        {
            "target": sum(str(d).startswith("cpu") for d in target_devices),
            "drafter": sum(str(d).startswith("cpu") for d in drafter_devices),
        }
    )
