"""Time: the rows each side can handle per second, which side binds, the split of the devices that balances the
two, what moving the features between devices costs the link (or storing them, the disk), and the wall time.

The model is train's pipeline: target workers run ahead of the drafter replicas (train.prefetch), so at steady
state a step takes as long as the slower side and the faster one waits. A side's rate is its workers' peak x a
calibrated MFU / the FLOPs of one row (train/flops.py's count); offline, the target side only reads stored
features, at the disk's rate. The optimizer step and the gradient all-reduce are not counted (SpecForge measured
1.3 ms of a ~240 ms step; on a CPU they are part of what the calibration measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflashpipe.commands.plan.calibration import Calibration
from dflashpipe.commands.plan.inputs import DataSize, DeviceChoice, Run
from dflashpipe.commands.plan.model import Shapes, feature_bytes_per_token
from dflashpipe.core.threads import training_budget


@dataclass(frozen=True)
class Side:
    name: str
    workers: int
    rows_per_s: float
    """The whole side's rate, if the other side never kept it waiting."""
    per_worker: float | None
    """One worker's rate; None where the workers share one resource (offline: the disk)."""
    how: str


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    rows_per_s: float
    bound_by: str


def worker_peaks(run: Run, sh: Shapes, devices: DeviceChoice) -> dict[str, float]:
    """Each role's peak for one worker: a GPU's own, or its share of this CPU's cores (dflashpipe.core.threads)."""
    budget = training_budget(run.topology.target_devices, run.topology.drafter_devices)
    peaks = {}
    for role, device, dtype in (
        ("target", devices.target, sh.target_dtype),
        ("drafter", devices.drafter, sh.drafter_dtype),
    ):
        share = budget.threads[role] / budget.cores if device.name == "cpu" else 1.0
        peaks[role] = device.peak(dtype) * share
    return peaks


def sides(run: Run, sh: Shapes, devices: DeviceChoice, cal: Calibration) -> tuple[Side, Side]:
    peaks = worker_peaks(run, sh, devices)
    n_t, n_d = len(run.topology.target_devices), len(run.topology.drafter_devices)
    if run.features.mode == "offline":
        bytes_per_row = run.model.seq_len * feature_bytes_per_token(sh, run.model)
        target = Side(
            "target",
            n_t,
            cal.read.value / bytes_per_row,
            None,
            f"reads stored features at {cal.read.value / 1e9:.3g} GB/s, {bytes_per_row / 1e6:.3g} MB a row",
        )
    else:
        each = peaks["target"] * cal.target.value / sh.target_flops
        target = Side(
            "target", n_t, n_t * each, each, _how(n_t, devices.target.name, cal.target.value, sh.target_flops)
        )
    each = peaks["drafter"] * cal.drafter.value / sh.drafter_flops
    drafter = Side(
        "drafter", n_d, n_d * each, each, _how(n_d, devices.drafter.name, cal.drafter.value, sh.drafter_flops)
    )
    return target, drafter


def _how(workers: int, device: str, mfu: float, flops: int) -> str:
    return f"{workers} x {device} at MFU {mfu:.3g}, {flops / 1e12:.3g} TFLOP a row"


def bound(target: Side, drafter: Side) -> str:
    return "target" if target.rows_per_s <= drafter.rows_per_s else "drafter"


def splits(run: Run, target: Side, drafter: Side) -> list[Split]:
    """Every split of the topology's devices between the two sides, when they are distinct GPUs of one kind (on
    a CPU the workers share cores, not devices): what each gives, online per target worker, offline by the disk."""
    topology = run.topology
    names = [*topology.target_devices, *topology.drafter_devices]
    if any(not n.startswith("cuda") for n in names) or len(set(names)) != len(names) or drafter.per_worker is None:
        return []
    result = []
    for k in range(1, len(names)):
        supply = k * target.per_worker if target.per_worker is not None else target.rows_per_s
        demand = (len(names) - k) * drafter.per_worker
        result.append(Split(k, len(names) - k, min(supply, demand), "target" if supply <= demand else "drafter"))
    return result


def balanced(found: list[Split]) -> Split | None:
    """The fastest split (the fewer target devices on a tie)."""
    return max(found, key=lambda s: (s.rows_per_s, -s.targets)) if found else None


@dataclass(frozen=True)
class Transfer:
    """Online: the features' traffic against the link; offline: their disk, and the read rate training needs."""

    bytes_per_token: float
    bytes_per_s: float
    per_device_bytes_per_s: float
    """The busiest device's share: a target device sending, or a drafter device receiving."""
    link_bytes_per_s: float | None
    offline_bytes: float | None


def transfer(run: Run, sh: Shapes, devices: DeviceChoice, tokens_per_s: float, data: DataSize) -> Transfer:
    per_token = feature_bytes_per_token(sh, run.model)
    total = per_token * tokens_per_s
    n_t, n_d = len(run.topology.target_devices), len(run.topology.drafter_devices)
    stored = data.samples * min(data.tokens_per_sample, run.model.seq_len) * per_token
    return Transfer(
        per_token,
        total,
        total / min(n_t, n_d),
        devices.drafter.link_bytes_per_s,
        stored,
    )


@dataclass(frozen=True)
class Wall:
    rows: int
    """Rows train.max_steps trains (every replica's micro-batch each step)."""
    seconds: float
    epoch_rows: float
    """Rows in one pass over the data, packed (the mean sample, cut to model.seq_len)."""

    @property
    def epochs(self) -> float:
        return self.rows / self.epoch_rows if self.epoch_rows else 0.0


def wall(run: Run, rows_per_s: float, data: DataSize) -> Wall:
    rows = run.train.max_steps * len(run.topology.drafter_devices) * run.compile.micro_batch
    epoch_rows = data.samples * min(data.tokens_per_sample, run.model.seq_len) / run.model.seq_len
    return Wall(rows, rows / rows_per_s, epoch_rows)
