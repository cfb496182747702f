"""The MFUs a plan runs each side at, calibrated from measurements, never assumed: every figure carries where it
comes from.

- A GPU side: SpecForge's disaggregated run on 8 H200 (published.py), restated in this project's FLOP
  convention: one capture GPU's prefill tokens/s x the target's FLOPs a token, and one trainer GPU's samples/s
  inside the running pipeline x the drafter's FLOPs a sample, over the H200's peak. The trainer's MFU alone on
  one GPU (43.5%) is higher; the pipeline's is what a plan of a pipeline needs, and only it orders the published
  splits right (docs/plan.md).
- This CPU: its own train stage (metrics/train/metrics.json at dvc.lock's train params): the drafter's FLOPs over
  its busy seconds, the target's (online) or the stored features' bytes (offline) over the target's; the target's
  forward also from the features stage's rate. The CPU's peak is measured now, so an MFU here is a ratio of two
  measurements of this machine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflashpipe.commands.plan.inputs import DeviceChoice, PlanError, Run, TargetConfig, resolve_run, target_config
from dflashpipe.commands.plan.model import Models, Shapes, feature_bytes_per_token, whole_forward_flops
from dflashpipe.commands.plan.published import SPECFORGE_QWEN3_8B, TARGET_CONFIGS, PublishedRun
from dflashpipe.core.devices import published
from dflashpipe.core.params import PARAMS_FILE
from dflashpipe.core.pipeline import BENCH_METRICS, FEATURES_METRICS, TRAIN_METRICS
from dflashpipe.train.flops import side_flops

DISK_READ = 3e9
"""Assumed: bytes/s one node reads stored features at (one NVMe drive, sequentially; no measurement here)."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


@dataclass(frozen=True)
class Calibration:
    target: Figure
    """MFU of the target's forward on the target devices' kind."""
    drafter: Figure
    """MFU of the drafter's forward and backward on the drafter devices' kind."""
    read: Figure
    """Bytes/s at which stored (offline) features are read, per node."""
    notes: tuple[str, ...] = ()


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
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
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
