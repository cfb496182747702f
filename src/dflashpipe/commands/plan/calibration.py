"""The MFUs a plan runs each side at, calibrated from measurements, never assumed: every figure carries where it
comes from.

- A GPU side: SpecForge's disaggregated run on 8 H200 (SPECFORGE_QWEN3_8B, below), restated in this project's FLOP
  convention: one capture GPU's prefill tokens/s x the target's FLOPs a token, and one trainer GPU's samples/s
  inside the running pipeline x the drafter's FLOPs a sample, over the H200's peak. The trainer's MFU alone on
  one GPU (43.5%) is higher; the pipeline's is what a plan of a pipeline needs, and only it orders the published
  splits right (docs/plan.md).
- This CPU: its own train stage (metrics/train/metrics.json at dvc.lock's train params): the drafter's FLOPs over
  its busy seconds, the target's (online) or the stored features' bytes (offline) over the target's; the target's
  forward also from the features stage's rate. The CPU's peak is measured now, so an MFU here is a ratio of two
  measurements of this machine.

The plan of the run train last made here is then checked against what train measured (`against_train`): its
tokens/s and FLOP/s must fall within the spread of its steps' own rates. The CPU's MFUs are calibrated on the same
run's busy seconds, so what that checks is the rest of the plan: the FLOP count (train's own, exactly), and the
pipeline model, in which a step lasts as long as the binding side is busy and the other side's time hides behind it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dflashpipe.commands.plan.cost import (
    Calibration,
    Figure,
    Models,
    Shapes,
    feature_bytes_per_token,
    whole_forward_flops,
)
from dflashpipe.commands.plan.inputs import (
    TARGET_CONFIGS,
    DeviceChoice,
    PlanError,
    Run,
    TargetConfig,
    resolve_run,
    target_config,
)
from dflashpipe.core.devices import published
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params import PARAMS_FILE
from dflashpipe.core.pipeline import BENCH_METRICS, FEATURES_METRICS, TRAIN_METRICS
from dflashpipe.train.flops import side_flops

if TYPE_CHECKING:
    from dflashpipe.commands.plan import Plan

DISK_READ = 3e9
"""Assumed: bytes/s one node reads stored features at (one NVMe drive, sequentially; no measurement here)."""


def calibrate(run: Run, devices: DeviceChoice, root: Path, config: TargetConfig) -> Calibration:
    """Each side's MFU from the measurements of its device's kind: this CPU's own records, or the published GPU run
    (carried to another GPU as an assumption, said so)."""
    gpus = [d for d in (devices.target, devices.drafter) if d.name != "cpu"]
    gpu = cpu = None
    if gpus:
        gpu = published_mfus(SPECFORGE_QWEN3_8B, root)
        if gpus[0].name.lower() != SPECFORGE_QWEN3_8B.device.lower():
            carried = f"; assumed the same on {gpus[0].name}"
            gpu = dataclasses.replace(
                gpu,
                target=dataclasses.replace(gpu.target, source=gpu.target.source + carried),
                drafter=dataclasses.replace(gpu.drafter, source=gpu.drafter.source + carried),
            )
    if len(gpus) < 2:
        cpu = measured_here(run, devices, root, config)
    target = cpu if devices.target.name == "cpu" else gpu
    drafter = cpu if devices.drafter.name == "cpu" else gpu
    notes = target.notes + (drafter.notes if drafter is not target else ())
    return Calibration(target.target, drafter.drafter, target.read, notes)


# -- published: SpecForge on H200 ------------------------------------------------------------------


# Facts, not code: the numbers are the publication's own; what is derived from them (an MFU in this project's
# FLOP convention) is derived below, in the open.


@dataclass(frozen=True)
class PublishedRun:
    """A measured drafter-training run on real GPUs, as its authors published it."""

    source: str
    device: str
    """The GPU it ran on (a row of dflashpipe.core.devices)."""
    target: str
    """Its target's config (a key of TARGET_CONFIGS)."""
    drafter_layers: int
    block_size: int
    num_anchors: int
    tokens_per_sample: int
    """The samples' mean length: what the capture server prefilled per sample."""
    capture_tokens_per_s: float
    """What one capture (target) GPU supplied, in prefill tokens/s, while the run was supply-bound."""
    trainer_samples_per_s: float
    """What one trainer (drafter) GPU consumed inside the running pipeline."""
    trainer_mfu_alone: float
    """The trainer's MFU measured on one GPU alone, no data path (the authors' own FLOP count)."""
    splits: dict[tuple[int, int], float]
    """(capture GPUs, trainer GPUs) -> samples/s of the whole run."""


SPECFORGE_QWEN3_8B = PublishedRun(
    source=(
        "SpecForge examples/disagg/PERF_FINDINGS.md (sgl-project/SpecForge, PR #661: "
        "https://github.com/sgl-project/SpecForge/pull/661), 1x8 H200, samples over >= 390 s"
    ),
    device="H200",
    target="qwen3-8b",
    drafter_layers=5,
    block_size=16,
    num_anchors=256,
    tokens_per_sample=550,
    capture_tokens_per_s=27_000,
    trainer_samples_per_s=7.0,
    trainer_mfu_alone=0.435,
    splits={(1, 7): 50.1, (2, 6): 39.0},
)
"""SpecForge's disaggregated DFlash-family training of a ~1.1B draft for Qwen3-8B on 8 H200s."""


def published_run_models(pub: PublishedRun, base: Run) -> tuple[Models, object]:
    """The published run's target and drafter, shapes only, with one sample a row."""
    from transformers import AutoConfig

    values, _ = TARGET_CONFIGS[pub.target]
    model = dataclasses.replace(
        base.model,
        layers=pub.drafter_layers,
        block_size=pub.block_size,
        num_anchors=pub.num_anchors,
        seq_len=pub.tokens_per_sample,
        target_layers=0,
        target_layer_ids=(),
        distill="none",
    )
    return Models.build(AutoConfig.for_model(**values), model), model


def published_mfus(pub: PublishedRun, root: Path) -> Calibration:
    base = resolve_run(None, [], root)
    models, model = published_run_models(pub, base)
    peak = published(pub.device).bf16_flops
    _, drafter_flops = side_flops(model, models.drafter, models.target)
    per_token = whole_forward_flops(models, pub.tokens_per_sample) / pub.tokens_per_sample
    target = pub.capture_tokens_per_s * per_token / peak
    drafter = pub.trainer_samples_per_s * drafter_flops / peak
    alone = pub.trainer_mfu_alone * peak / drafter_flops
    where = f"published: {pub.source}"
    return Calibration(
        Figure(
            target,
            f"{where}: {pub.capture_tokens_per_s:,.0f} prefill tokens/s on one {pub.device} x "
            f"{per_token / 1e9:.3g} GFLOP a token (every layer: assumed, a serving engine's prefill)",
        ),
        Figure(
            drafter,
            f"{where}: {pub.trainer_samples_per_s:g} samples/s per trainer {pub.device} in the pipeline x "
            f"{drafter_flops / 1e12:.3g} TFLOP a sample",
        ),
        Figure(DISK_READ, "assumed: one NVMe drive's sequential read per node"),
        (
            f"SpecForge's trainer alone reached MFU {pub.trainer_mfu_alone} (its own FLOP count): "
            f"{alone:.3g} samples/s by this count, {pub.trainer_samples_per_s / alone:.0%} of which it kept in the "
            f"pipeline",
        ),
    )


# -- measured here: this CPU's own stages ----------------------------------------------------------


def measured_run(root: Path) -> Run:
    """The params train last ran with: params.yaml with dvc.lock's recorded train params over it."""
    lock = root / "dvc.lock"
    recorded = {}
    if lock.is_file():
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        recorded = stages.get("train", {}).get("params", {}).get(PARAMS_FILE, {})
    sets = [f"{key}={json.dumps(value)}" for key, value in recorded.items()]
    run = resolve_run(None, sets, root)
    return dataclasses.replace(run, label=f"{PARAMS_FILE} with dvc.lock's train params" if recorded else PARAMS_FILE)


def _read_json(path: Path) -> dict | None:
    """A stage's whole record: its metrics file with its detail file (core.metrics); None where unreadable."""
    try:
        return read_record_at(path)
    except DflashpipeError:
        return None


def measured_here(run: Run, devices: DeviceChoice, root: Path, config: TargetConfig) -> Calibration:
    metrics = _read_json(root / TRAIN_METRICS)
    if metrics is None or "busy_s" not in metrics:
        raise PlanError(
            f"{root / TRAIN_METRICS}: no measured train run to calibrate this CPU's rates with: "
            f"run `dvc repro train` here first (or plan for a GPU with --device)"
        )
    measured = measured_run(root)
    # the plan's target config when it is the measured run's target (a GGUF's takes seconds to read)
    same = measured.target.source == run.target.source
    models = Models.build((config if same else target_config(measured, root, None)).config, measured.model)
    sh = Shapes.of(models, measured.model, measured.compute, "cpu", "cpu")
    cpu = devices.drafter if devices.drafter.name == "cpu" else devices.target
    per_core = {dtype: cpu.peak(dtype) / devices.cores for dtype in ("float32", "bfloat16")}
    threads = (metrics.get("threads") or {}).get("threads", {})
    steps = (metrics.get("balance") or {}).get("steps", metrics["steps"])
    rows = steps * len(measured.topology.drafter_devices) * measured.compile.micro_batch
    busy = metrics["busy_s"]
    where = f"measured here: {TRAIN_METRICS} ({steps} steps at {measured.label})"

    drafter = rows * sh.drafter_flops / busy["drafter"] / (per_core[sh.drafter_dtype] * threads.get("drafter", 1))
    notes = []
    bench = _read_json(root / BENCH_METRICS)
    if bench and bench.get("tokens_per_s"):
        alone = bench["tokens_per_s"] * sh.drafter_flops / measured.model.seq_len
        alone /= per_core[sh.drafter_dtype] * (bench.get("threads") or {}).get("threads", {}).get("drafter", 1)
        notes.append(
            f"this CPU's drafter step alone ({BENCH_METRICS}): MFU {alone:.3g}; inside train's loop {drafter:.3g}"
        )

    n_t = len(measured.topology.target_devices)
    features = _read_json(root / FEATURES_METRICS)
    if measured.features.mode == "online":
        target = rows * sh.target_flops / busy["target"] / (per_core[sh.target_dtype] * threads.get("target", 1))
        target_where = where + ", the target's busy seconds"
    elif features and features.get("tokens_per_s"):
        target = (
            features["tokens_per_s"]
            * sh.target_flops
            / measured.model.seq_len
            / (per_core[sh.target_dtype] * devices.cores)
        )
        target_where = f"measured here: {FEATURES_METRICS} (the target's forward on every core)"
    else:
        raise PlanError(f"{root / FEATURES_METRICS}: no target rate measured here: run `dvc repro features` first")
    offline_bytes = rows * measured.model.seq_len * feature_bytes_per_token(sh, measured.model)
    read = offline_bytes / (busy["target"] / n_t) if measured.features.mode == "offline" and busy["target"] else None
    return Calibration(
        Figure(target, target_where),
        Figure(drafter, where + ", the drafter's busy seconds"),
        Figure(read, where + ", the target side's busy seconds reading stored features")
        if read
        else Figure(DISK_READ, "assumed: one NVMe drive's sequential read"),
        tuple(notes),
    )


# -- against the measured train run ----------------------------------------------------------------


TRAIN_SECTIONS = ("model", "compile", "topology", "train", "features", "compute")
"""What decides a train run's speed: the plan is checked only against a run of the same values."""


def against_train(plan: Plan, root: Path) -> dict | None:
    """Predicted vs measured for the run in metrics/train/metrics.json, or None when this plan is not of that run
    (other params, or devices other than this CPU)."""
    if plan.devices.target.name != "cpu" or plan.devices.drafter.name != "cpu":
        return None
    metrics = _read_json(root / TRAIN_METRICS)
    if metrics is None:
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
