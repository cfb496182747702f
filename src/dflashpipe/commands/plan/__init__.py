"""`dflashpipe plan`: a training run on paper, before its devices are paid for.

Invariant: every figure is computed from the run's params (a profile and `-S` values over params.yaml), the
target's config.json, the device table (dflashpipe.core.devices, the user's own rows, this CPU measured now) and MFUs
calibrated from measurements; every input figure carries its source (measured here, published with its source, or
assumed), in the text and in the JSON. `make_plan` reads in the order of the modules: `inputs` (params, config,
devices, data size), `cost` (shapes, memory per device, then time at the calibrated MFUs), `calibration` (the MFUs,
and the plan of the run train last made against what it measured), `render` (text and JSON)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.commands.plan.calibration import against_train, calibrate
from dflashpipe.commands.plan.cost import (
    Calibration,
    DeviceMemory,
    Fit,
    Models,
    Shapes,
    Side,
    Split,
    Transfer,
    Wall,
    balanced,
    bound,
    device_memory,
    largest_fit,
    sides,
    splits,
    transfer,
    wall,
)
from dflashpipe.commands.plan.inputs import (
    DataSize,
    DeviceChoice,
    PlanError,
    Run,
    TargetConfig,
    choose_devices,
    data_size,
    resolve_run,
    target_config,
)
from dflashpipe.commands.plan.render import gib, plan_json, plan_lines

__all__ = ["Plan", "PlanError", "make_plan", "plan_json", "plan_lines"]


@dataclass(frozen=True)
class Plan:
    run: Run
    target_config: TargetConfig
    devices: DeviceChoice
    shapes: Shapes
    calibration: Calibration
    data: DataSize
    memory: list[DeviceMemory]
    fit: Fit
    target: Side
    drafter: Side
    splits: list[Split]
    transfer: Transfer
    wall: Wall
    check: dict | None

    @property
    def bound_by(self) -> str:
        return bound(self.target, self.drafter)

    @property
    def rows_per_s(self) -> float:
        return min(self.target.rows_per_s, self.drafter.rows_per_s)

    @property
    def tokens_per_s(self) -> float:
        return self.rows_per_s * self.run.model.seq_len

    @property
    def balanced(self) -> Split | None:
        return balanced(self.splits)

    @property
    def flops_per_step(self) -> int:
        """train's `throughput.flops_per_step`, for one process."""
        rows = len(self.run.topology.drafter_devices) * self.run.compile.micro_batch
        return rows * (self.shapes.target_flops + self.shapes.drafter_flops)


def make_plan(
    profile: str | None = None,
    sets: list[str] | None = None,
    device: str | None = None,
    devices_file: str | None = None,
    target: str | None = None,
    root: Path | str = ".",
) -> Plan:
    """The plan of params.yaml under `root` (with `profile` and `sets` over it) on `device`; PlanError when an
    input is bad or the run does not fit its devices."""
    root = Path(root)
    run = resolve_run(profile, list(sets or []), root)
    config = target_config(run, root, target)
    devices = choose_devices(run, device, Path(devices_file) if devices_file else None, root)
    data = data_size(run, root)

    topology = run.topology
    models = Models.build(config.config, run.model)
    shapes = Shapes.of(models, run.model, run.compute, topology.target_devices[0], topology.drafter_devices[0])
    memory = device_memory(shapes, run, devices.target, devices.drafter)
    fit = largest_fit(shapes, run, devices.target, devices.drafter)
    refuse_what_does_not_fit(run, memory, fit)

    calibration = calibrate(run, devices, root, config)
    target_side, drafter_side = sides(run, shapes, devices, calibration)
    tokens_per_s = min(target_side.rows_per_s, drafter_side.rows_per_s) * run.model.seq_len
    plan = Plan(
        run,
        config,
        devices,
        shapes,
        calibration,
        data,
        memory,
        fit,
        target_side,
        drafter_side,
        splits(run, target_side, drafter_side),
        transfer(run, shapes, devices, tokens_per_s, data),
        wall(run, tokens_per_s / run.model.seq_len, data),
        None,
    )
    return dataclasses.replace(plan, check=against_train(plan, root))


def refuse_what_does_not_fit(run: Run, memory: list[DeviceMemory], fit: Fit) -> None:
    over = [d for d in memory if not d.fits]
    if not over:
        return
    d = max(over, key=lambda d: d.total / d.usable)
    if fit.seq_len is None and fit.micro_batch is None:
        largest = "none: even one row of the shortest length overflows"
    else:
        largest = " or ".join(
            s
            for s in (
                fit.seq_len and f"model.seq_len {fit.seq_len} at compile.micro_batch {run.compile.micro_batch}",
                fit.micro_batch and f"compile.micro_batch {fit.micro_batch} at model.seq_len {run.model.seq_len}",
            )
            if s
        )
    raise PlanError(
        f"{run.label} does not fit {d.device} ({d.kind.name}, {gib(d.usable)} usable): its {' and '.join(d.roles)} "
        f"worker(s) need {gib(d.total)} (largest term: {d.largest.name}, {gib(d.largest.bytes)}); the largest "
        f"setting that fits: {largest}"
    )
