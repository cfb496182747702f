"""The train stage: inputs checked and loaded, the loop run (resumed when it may be), outputs written."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from dflashpipe.compile.artifact import load_artifact_or_go_cold
from dflashpipe.compile.guard import COUNTER, CompileGuard, dynamo_counters
from dflashpipe.core.artifacts import atomic_directory, write_file_listing
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import write_metrics
from dflashpipe.core.pipeline import (
    COMPILE,
    DRAFTER,
    FEATURES,
    TARGET,
    TOKENS,
    TRAIN_METRICS_DIR,
    TRAIN_STATE,
    StageKey,
)
from dflashpipe.core.spread import Measuring
from dflashpipe.features.shards import FeatureLayout, FeatureStore, refuse_distillation
from dflashpipe.model.drafter import PUBLISHED_DTYPE
from dflashpipe.tokens.shards import load_tokens
from dflashpipe.train.card import write_model_card
from dflashpipe.train.checkpoint import CheckpointPolicy, checkpoint_key, load_checkpoint
from dflashpipe.train.data import run_length
from dflashpipe.train.loop import Trainer, decay_start, lr_at
from dflashpipe.train.metrics import LiveCurves, train_metrics, write_plots
from dflashpipe.train.nodes import join
from dflashpipe.train.parity import check_parity
from dflashpipe.train.state import TrainInputs
from dflashpipe.train.topology import Topology, check_topology, train_threads


@dataclass(frozen=True)
class TrainPaths:
    """Where the stage reads (tokens, target, compile artifact) and writes (drafter, checkpoint, metrics)."""

    tokens: Path
    target: Path
    compile: Path
    drafter: Path
    state: Path
    metrics: Path
    features: Path | None = None
    """The features stage's output; read only when features.mode is offline."""

    @classmethod
    def pipeline(cls, root: Path | str = ".") -> TrainPaths:
        """dvc.yaml's paths, under the project root `root`."""
        root = Path(root)
        return cls(*(root / p for p in (TOKENS, TARGET, COMPILE, DRAFTER, TRAIN_STATE, TRAIN_METRICS_DIR, FEATURES)))


def offline_features(inputs: TrainInputs, paths: TrainPaths, data, target) -> FeatureStore:
    """data/features checked against the drafter's layout and the token shards, before any step."""
    refuse_distillation(inputs.model)
    if paths.features is None:
        raise DflashpipeError("features.mode is offline, but no features directory was given")
    return FeatureStore.load(
        paths.features, paths.tokens, data, FeatureLayout.of(target.config, inputs.model, target.dtype)
    )


def train_drafter(inputs: TrainInputs, paths: TrainPaths, key: StageKey | None, compile_key: StageKey | None) -> dict:
    """The whole train stage. Returns the metrics it wrote.

    `key`: what decides this run's trajectory (`reuse_key("train")` under DVC); a checkpoint in
    `paths.state` is resumed only if it was saved under the same key and process count, as a prefix of this
    run's schedule (train/checkpoint.py); None never resumes. `compile_key`: warmup's key, which the compile
    artifact must have been built under to be used (None: compile cold)."""
    topology = check_topology(inputs.topology)  # before anything loads
    key = checkpoint_key(key, topology.world_size, [*topology.targets, *topology.drafters])
    paths.state.mkdir(parents=True, exist_ok=True)  # a declared output, even when no checkpoint is due
    trainer, compile_note = load_trainer(inputs, paths, topology, key, compile_key)
    parity = check_parity(trainer)  # before any step: a drafter taught other inputs than decoding's is no result
    length = run_length(inputs.train, trainer.plan)
    if length.epochs and topology.rank == 0:
        print(
            f"train: train.epochs {length.epochs} = {length.rows:,} packed rows / {length.rows_per_step} a step "
            f"= {length.steps:,} steps (warmup {length.warmup_steps})",
            flush=True,
        )
    # The loop, its schedule, checkpoints and held-out cadence run on the resolved count; the card keeps the params
    # as stated.
    trainer.inputs = dataclasses.replace(inputs, train=inputs.train.for_steps(length.steps))
    train = trainer.inputs.train
    checkpoint = load_checkpoint(paths.state, key, train.max_steps, functools.partial(lr_at, p=train))
    if checkpoint is not None:
        trainer.restore(checkpoint)
    warm_s = trainer.warm_up_compiled()
    guard = CompileGuard(strict=inputs.compile.guard == "error")
    if inputs.compile.enabled:
        guard.arm()
    before, by_replica = dynamo_counters(), trainer.compiled_by_replicas()

    # built once the Trainer has restored: it writes the TrainState that the Trainer then holds
    checkpoints = CheckpointPolicy(
        paths.state,
        key,
        inputs.train.checkpoint_every,
        writes=topology.rank == 0,
        state=trainer.state,
        drafter=trainer.replicas[0].drafter,
        optimizer=trainer.replicas[0].optimizer,
        minutes=inputs.train.checkpoint_minutes,
        keep_at=decay_start(train) if train.schedule == "wsd" else None,
    )
    curves = LiveCurves(paths.metrics, trainer.state.history) if topology.rank == 0 else None
    with Measuring(trainer.replicas[0].device) as window:  # what the machine gave the steps, and the control
        trainer.run(guard, checkpoints, curves)
    if inputs.compile.enabled:
        guard.disarm()
    after = dynamo_counters()
    mismatches = trainer.replica_mismatches()
    metrics = train_metrics(
        trainer.state,
        inputs,
        topology,
        trainer.replicas[0].drafter,
        trainer.targets[0].model,
        before,
        after,
        warm_s,
        compile_note,
        replicas_identical=not mismatches,
        busy=window.busy,
    )
    metrics["compile"]["replicas"] = trainer.replica_compiles(by_replica)
    metrics["threads"] = trainer.threads.to_json()
    metrics["run_length"] = length.to_json()
    metrics["parity"] = parity.to_json()
    # the numerics the drafter learnt in (compute.target_dtype resolved here): evaluate says when it judges in others
    metrics["target_dtype"] = str(trainer.targets[0].dtype).removeprefix("torch.")
    if mismatches:  # before any output: a drafter from diverged replicas is no result
        raise diverged(mismatches)
    if topology.rank == 0:
        write_outputs(trainer, inputs, paths, metrics)
        checkpoints.save(trainer.state.step, last_step=True)  # only now: a refused run leaves no finished one
    return metrics


def load_trainer(
    inputs: TrainInputs, paths: TrainPaths, topology: Topology, key: StageKey | None, compile_key: StageKey | None
) -> tuple[Trainer, str]:
    """This process set up for training (its threads, its process group under torchrun, checked to hold `key` on
    every node), the Trainer built on `topology`'s devices, and how its drafter step was compiled (the metrics'
    compile note)."""
    from transformers import AutoTokenizer

    # The main thread loads (or compiles) and warms up the drafter step at the drafter threads' count: the
    # compiled step is bound to the count it was compiled at (dflashpipe.core.threads), warmup's too.
    train_threads(topology).apply("drafter", topology.drafters[0])
    join(topology, inputs.topology.nodes, key)
    data = load_tokens(paths.tokens)
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    compile_note = "eager: compile.enabled is false"
    if inputs.compile.enabled:
        compile_note = load_artifact_or_go_cold(paths.compile, paths.state / "inductor-cache", compile_key)
        if compile_note != "artifact":
            print(f"train: {compile_note}, in the main thread")
    COUNTER.install()

    trainer = Trainer(inputs, data, topology, paths.target, pad_id)
    trainer.build(tokenizer)
    if inputs.features.mode == "offline":
        trainer.features = offline_features(inputs, paths, data, trainer.targets[0])
    return trainer, compile_note


def diverged(mismatches: list[str]) -> DflashpipeError:
    """The refusal of a drafter whose replicas differ (`mismatches`: Trainer.replica_mismatches)."""
    shown = ", ".join(mismatches[:3]) + (f" and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")
    return DflashpipeError(
        f"drafter replicas diverged ({shown} differ from replica 0): their gradients were "
        f"not averaged identically, a bug in dflashpipe/train/loop.py; no output written"
    )


def write_outputs(trainer: Trainer, inputs: TrainInputs, paths: TrainPaths, metrics: dict) -> None:
    """The drafter (with its model card and file listing), the plots and metrics.json."""
    with atomic_directory(paths.drafter) as tmp:
        # bf16 to serve (the checkpoint keeps the exact fp32 weights), with its model card: only what
        # train's inputs decide (no revision, no dvc.lock hash), so the same inputs give the same bytes
        trainer.replicas[0].drafter.save_pretrained(tmp, dtype=PUBLISHED_DTYPE)
        params = {name: asdict(getattr(inputs, name)) for name in ("model", "train", "compile", "topology")}
        params["compute"] = {**asdict(inputs.compute), "trained_in": metrics["target_dtype"]}
        write_model_card(tmp, target_dir=paths.target, tokens_dir=paths.tokens, params=params)
        write_file_listing(tmp)  # evaluate checks the drafter against it before use
    write_plots(trainer.state.history, paths.metrics)
    write_metrics(paths.metrics / "metrics.json", metrics, name="train")
