"""The plan of the run train last made here, against what train measured: its tokens/s and FLOP/s must fall within
the spread of its steps' own rates.

The CPU's MFUs are calibrated on the same run's busy seconds (calibration.py), so what this checks is the rest of
the plan: the FLOP count (train's own, exactly), and the pipeline model, in which a step lasts as long as the
binding side is busy and the other side's time hides behind it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflashpipe.commands.plan.calibration import measured_run
from dflashpipe.commands.plan.model import feature_bytes_per_token
from dflashpipe.core.pipeline import TRAIN_METRICS

if TYPE_CHECKING:
    from dflashpipe.commands.plan import Plan

TRAIN_SECTIONS = ("model", "compile", "topology", "train", "features", "compute")
"""What decides a train run's speed: the plan is checked only against a run of the same values."""


def against_train(plan: Plan, root: Path) -> dict | None:
    """Predicted vs measured for the run in metrics/train/metrics.json, or None when this plan is not of that run
    (other params, or devices other than this CPU)."""
    if plan.devices.target.name != "cpu" or plan.devices.drafter.name != "cpu":
        return None
    try:
        metrics = json.loads((root / TRAIN_METRICS).read_text())
    except (OSError, ValueError):
        return None
    measured = measured_run(root)
    if any(getattr(plan.run, s) != getattr(measured, s) for s in TRAIN_SECTIONS):
        return None
    run, sh = plan.run, plan.shapes
    rows_per_step = len(run.topology.drafter_devices) * run.compile.micro_batch
    step_s = rows_per_step / plan.rows_per_s
    steps = (metrics.get("balance") or {}).get("steps", metrics["steps"])
    spread, median = metrics["tokens_per_s_spread"], metrics["tokens_per_s"]
    low, high = spread["low"] / median, spread["high"] / median
    supervised = metrics["supervised_tokens"] / metrics["steps"] / step_s
    flops = plan.flops_per_step / step_s
    measured_flops = metrics["throughput"]["flops_per_s"]
    if run.features.mode == "offline":  # each target worker read at the calibrated rate
        n_t = len(run.topology.target_devices)
        t_busy = n_t * steps * rows_per_step * run.model.seq_len * feature_bytes_per_token(sh, run.model)
        t_busy /= plan.calibration.read.value
    else:
        t_busy = steps * rows_per_step / plan.target.per_worker
    return {
        "run": f"{TRAIN_METRICS}: {metrics['steps']} steps",
        "flops_per_step": {"predicted": plan.flops_per_step, "measured": metrics["throughput"]["flops_per_step"]},
        "tokens_per_s": {
            "predicted": round(supervised, 1),
            "measured": median,
            "low": spread["low"],
            "high": spread["high"],
            "within": spread["low"] <= supervised <= spread["high"],
            "what": "supervised tokens/s (train's tokens_per_s): its mean supervised tokens a step / predicted step",
        },
        "flops_per_s": {
            "predicted": float(f"{flops:.4g}"),
            "measured": measured_flops,
            "low": float(f"{measured_flops * low:.4g}"),
            "high": float(f"{measured_flops * high:.4g}"),
            "within": measured_flops * low <= flops <= measured_flops * high,
            "what": "train's flops_per_s; its spread is tokens_per_s's, relative",
        },
        "busy_s": {
            "target": {"predicted": round(t_busy, 3), "measured": metrics["busy_s"]["target"]},
            "drafter": {
                "predicted": round(steps * rows_per_step / plan.drafter.per_worker, 3),
                "measured": metrics["busy_s"]["drafter"],
            },
            "what": "calibrated on these very seconds: equal by construction, shown for the record",
        },
        "bound_by": {"predicted": plan.bound_by, "measured": metrics["throughput"].get("bound_by")},
    }
