"""Drafter training: target workers feed drafter replicas, one thread each; the main thread holds the loop.

    target_worker (a thread per target) ──step inputs──▶ mailbox[r] ──▶ drafter_worker (thread r)
                                                                              │ result (grads on the replica)
    main thread, once per step:                                               ▼
      collect every replica's result ◀──────────────────────────────── results[r]
      average over replicas (and processes), clip, AdamW step on every replica, record the step,
      measure the held-out sequences when due; release the drafter threads into the next step;
      then the checkpoint when due (`CheckpointPolicy`), the step's curves (`LiveCurves`) and the progress, while
      they compute it

- Each target device holds a frozen copy of the target; its thread runs the forward
  (no grad) for the (step, replica) items assigned to it round-robin, draws that item's
  anchors and hands the chosen layers' hidden states to that replica (when distilling,
  also the target's final hidden states at the anchors' slots). A target worker runs at
  most `train.prefetch` items ahead of the drafters, so memory stays bounded.
- Each drafter device holds one replica and one thread: forward and backward on its step's inputs,
  its result to the main thread, then it waits until the main thread has stepped. All replicas start
  from the same initialisation and apply the same averaged gradient with identical optimizers, so
  they stay identical, which the run checks at the end.
- The threads share one `RunState` (train/workers.py: the mailboxes both ways, the abort on the first
  error, the target workers' busy time). The main thread alone writes the weights, the optimizers and
  the `TrainState`: the checkpoint runs beside the next step's forwards and backwards, which read the
  weights and write only gradients.
- The main thread loads the warmup artifact and runs every compiled graph once before
  any worker starts, then arms the compile guard: the workers compile nothing.
- Under torchrun (WORLD_SIZE > 1) the averaged gradient is all-reduced across
  processes; only rank 0 writes outputs.
- Everything that decides the numbers (data order, anchors, initialisation) derives
  from the seed and the step, so a run resumed from a checkpoint ends where an
  uninterrupted one does.

The stage around this loop is train/stage.py; the threads' plumbing, train/workers.py; the run's state,
train/state.py; checkpoints, train/checkpoint.py; metrics, train/metrics.py.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from dflashpipe.compile.guard import COUNTER, CompileGuard, inductor_cache_counters
from dflashpipe.compile.warmup import autocast, compiled_step, run_step_once
from dflashpipe.core.params import ModelParams, TrainParams
from dflashpipe.core.threads import ThreadBudget
from dflashpipe.features.packing import Batch, collate, pack_rows
from dflashpipe.model import DFlashDrafter, DraftLoss, StepInputs, TargetHead, sample_anchor_positions
from dflashpipe.model.loss import prediction_positions
from dflashpipe.target.adapter import Target
from dflashpipe.target.hidden_states import target_features_and_predictions, target_layer_features
from dflashpipe.train.checkpoint import Checkpoint, CheckpointPolicy
from dflashpipe.train.data import BatchPlan, held_out, without
from dflashpipe.train.nodes import every_replica
from dflashpipe.train.state import StepRecord, TrainInputs, TrainState, simulated_tau
from dflashpipe.train.topology import Topology, train_threads
from dflashpipe.train.workers import RunState, StepResult, TargetFeatures

if TYPE_CHECKING:  # only an annotation: training imports no pyarrow (the GPU check's machine has none)
    from dflashpipe.features.shards import FeatureStore
    from dflashpipe.tokens.shards import TokenData
    from dflashpipe.train.metrics import LiveCurves


@dataclass
class Trainer:
    """One training run: the target copies and drafter replicas it builds (`build`, `restore`), the loop the main
    thread holds (`run`), and what its target and drafter threads compute (`target_worker`, `drafter_worker`)."""

    inputs: TrainInputs
    data: TokenData
    topology: Topology
    target_dir: Path
    pad_id: int
    features: FeatureStore | None = None
    """Offline (features.mode): the stored features, read in place of the target's forward."""
    replicas: list[Replica] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)
    state: TrainState = field(default_factory=TrainState)

    @functools.cached_property
    def held_out_sequences(self) -> list[int]:
        return held_out(self.data.starts, self.inputs.train.heldout_sequences)

    @functools.cached_property
    def plan(self) -> BatchPlan:
        """One plan for the run, the held-out sequences left out: its target threads share its packed epochs."""
        p = self.inputs
        return BatchPlan(
            without(self.data.lengths, self.held_out_sequences),
            p.model.seq_len,
            self.topology.world_size,
            self.topology.replicas,
            p.compile.micro_batch,
            p.train.seed,
        )

    @functools.cached_property
    def threads(self) -> ThreadBudget:
        """Each worker thread's intra-op threads, which it sets for itself (dflashpipe.core.threads)."""
        return train_threads(self.topology)

    def global_replica(self, r: int) -> int:
        return self.topology.rank * self.topology.replicas + r

    # -- set-up, all in the main thread -------------------------------------------------------

    def build(self, tokenizer) -> None:
        p = self.inputs
        self.targets = [Target.load(self.target_dir, d, p.compute.target_dtype) for d in self.topology.targets]
        for device in self.topology.drafters:
            g = torch.Generator().manual_seed(p.train.seed)
            target = self.targets[0]
            drafter = DFlashDrafter.for_target(target.model, tokenizer, p.model, generator=g)
            drafter.target = TargetHead.of(target.model).on(device)
            drafter = drafter.to(device)
            step_fn = compiled_step(drafter) if p.compile.enabled else drafter
            trainable = [t for t in drafter.parameters() if t.requires_grad]
            optimizer = torch.optim.AdamW(
                trainable, lr=p.train.lr, betas=(0.9, 0.95), weight_decay=p.train.weight_decay, **self.adamw_kernel
            )
            self.replicas.append(Replica(drafter, step_fn, optimizer, device))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from `checkpoint`: its weights and optimizer state into every replica, its run state."""
        for rep in self.replicas:
            rep.drafter.load_state_dict({k: v.to(rep.device) for k, v in checkpoint.weights.items()}, strict=False)
            # A private copy each: load_state_dict keeps same-device tensors as they are, and two
            # optimizers stepping one shared exp_avg would pull the replicas apart.
            rep.optimizer.load_state_dict(copy.deepcopy(checkpoint.optimizer))
        self.state = checkpoint.state

    def target_side(
        self, rows: list[list[int]], batch: Batch, anchors: torch.Tensor, target: Target | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What training hands the drafter from the target for the collated `rows`: what the features stage stored
        for their sequences (offline), or `target`'s pass over them (online), with distillation's targets."""
        drafter = self.replicas[0].drafter
        if self.features is not None:
            return self.features.rows(rows, drafter.feature_dtype), None
        layer_ids = drafter.config.target_layer_ids
        return target_inputs(target or self.targets[0], batch, anchors, layer_ids, self.inputs.model)

    def held_out(self) -> HeldOut | None:
        """The held-out sequences' step inputs on replica 0's device, their features computed now (in the main
        thread, before any worker starts), or None when none are held out."""
        p, ids = self.inputs, self.held_out_sequences
        if not ids:
            return None
        drafter, device = self.replicas[0].drafter, self.replicas[0].device
        rows = pack_rows(ids, self.data.lengths, p.model.seq_len)
        rows += [[]] * (-len(rows) % p.compile.micro_batch)  # whole compiled shapes
        chunks = []
        for k in range(0, len(rows), p.compile.micro_batch):
            part = rows[k : k + p.compile.micro_batch]
            batch = collate(self.data, part, p.model.seq_len, self.pad_id)
            generator = torch.Generator().manual_seed(p.train.seed + 0x5EED + k)
            anchors, valid = sample_anchor_positions(
                batch.loss_mask, p.model.num_anchors, generator, batch.document_ids
            )
            features, target_hidden = self.target_side(part, batch, anchors)
            inputs = step_inputs(batch, features, anchors, valid, target_hidden)
            chunks.append(inputs.to(device, drafter.feature_dtype))
        return HeldOut(chunks, len(ids))

    def warm_up_compiled(self) -> float:
        """Run every replica's compiled step once, forward and backward, in the main thread; each replica keeps
        what inductor's cache gave it (hits: kernels warmup compiled for its device and shapes)."""
        began = time.perf_counter()
        for r in self.replicas:
            cache = inductor_cache_counters()
            run_step_once(r.step_fn, r.drafter, self.inputs.model, self.inputs.compile.micro_batch, r.device)
            r.warm_start = {name: n - cache[name] for name, n in inductor_cache_counters().items()}
        return time.perf_counter() - began

    def compiled_by_replicas(self) -> list[dict[str, int]]:
        """What each replica's thread has compiled so far (graphs, recompiles): taken around `run`."""
        return [COUNTER.of_thread(drafter_thread(r)) for r in range(len(self.replicas))]

    def replica_compiles(self, before: list[dict[str, int]]) -> dict[str, dict]:
        """Per replica (by global index): its device, what inductor's cache gave it in the main thread's warm-up,
        and the graphs its own thread compiled since `before` (compiled_by_replicas): 0 when warmup compiled it."""
        return {
            str(self.global_replica(r)): {
                "device": str(rep.device),
                "warm_start": rep.warm_start,
                **{f"{name}_in_thread": n - was[name] for name, n in now.items()},
            }
            for r, (rep, was, now) in enumerate(zip(self.replicas, before, self.compiled_by_replicas(), strict=True))
        }

    # -- the run --------------------------------------------------------------------------------

    def run(
        self, guard: CompileGuard, checkpoints: CheckpointPolicy | None = None, curves: LiveCurves | None = None
    ) -> None:
        """Train from state.step to max_steps. This (main) thread holds the loop: each step it collects every
        replica's result, ends the step (`end_step`) and releases the drafter threads into the next step; while
        they compute it, it writes the checkpoint when due, the step's curves and the progress. The last step's
        checkpoint is the stage's to write, after its outputs: a run whose outputs are refused leaves no finished
        checkpoint."""
        max_steps = self.inputs.train.max_steps
        run = RunState.of(
            self.state.step, max_steps, self.inputs.train.prefetch, guard, len(self.targets), len(self.replicas)
        )
        held_out = self.held_out()
        workers = {f"target-{t}": functools.partial(self.target_worker, run, t) for t in range(len(self.targets))}
        workers |= {
            drafter_thread(r): functools.partial(self.drafter_worker, run, r) for r in range(len(self.replicas))
        }
        # rank 0 alone (every process runs the same steps), on a terminal: tokens/s and the ETA at a glance
        bar = tqdm(
            desc="train", total=max_steps, initial=run.first_step, unit="step", disable=self.topology.rank != 0 or None
        )
        with run.threads(workers), bar:
            for step in range(run.first_step, max_steps):
                results = [mailbox.get(step) for mailbox in run.results]
                self.end_step(run, results, held_out)
                run.stepped.finished(step)
                # Beside the next step's forwards and backwards, which read the weights and write only gradients.
                if checkpoints is not None and self.state.step < max_steps:
                    checkpoints.save(self.state.step, last_step=False)
                if curves is not None:
                    curves.step(self.state.history[-1])
                self.report_step(bar)

    def target_worker(self, run: RunState, t: int) -> None:
        """Target t's thread: for each of its (step, replica) items, the frozen forward (offline: the stored
        features) and the anchors, into that replica's mailbox."""
        target = self.targets[t]
        self.threads.apply("target", target.device)
        p = self.inputs
        for step, r, release in run.target_items(t):
            rows = self.plan.rows(step, self.topology.rank, r)
            batch = collate(self.data, rows, p.model.seq_len, self.pad_id)
            began = time.perf_counter()
            anchors, valid = sample_anchor_positions(
                batch.loss_mask,
                p.model.num_anchors,
                anchor_generator(p.train.seed, step, self.global_replica(r)),
                batch.document_ids,
            )
            dtype = self.replicas[r].drafter.feature_dtype
            features, target_hidden = self.target_side(rows, batch, anchors, target)
            drafter_device = self.replicas[r].device
            features = features.to(drafter_device, dtype)
            if target_hidden is not None:
                target_hidden = target_hidden.to(drafter_device, dtype)
            run.target_busy_s[t] += time.perf_counter() - began
            inputs = step_inputs(batch, features, anchors, valid, target_hidden)
            run.mailboxes[r].put(step, TargetFeatures(batch, inputs, release))

    def drafter_worker(self, run: RunState, r: int) -> None:
        """Replica r's thread: each step's forward and backward on its inputs, its result to the main thread."""
        replica = self.replicas[r]
        self.threads.apply("drafter", replica.device)
        for step, item in run.drafter_items(r):
            began = time.perf_counter()
            inputs = item.inputs.to(replica.device, replica.drafter.feature_dtype)
            with autocast(replica.device):
                out = run.guard.call(f"drafter step (replica {r})", replica.step_fn, *inputs.args())
            out.loss.backward()
            replica.busy_s += time.perf_counter() - began
            run.results[r].put(step, StepResult(out, item.batch.truncated, item.batch.padding_fraction))

    def end_step(self, run: RunState, results: list[StepResult], held_out: HeldOut | None) -> None:
        """In the main thread, once every replica's backward is done and while the drafter threads wait: the
        optimizer step on the averaged gradient, the step's record, and the held-out measurement when due (it
        runs replica 0's compiled step with the cores the drafter threads would otherwise use)."""
        lr = lr_at(self.state.step, self.inputs.train)
        self.average_gradients()
        self.optimizer_step(lr)
        results = every_replica(results, self.replicas[0].device)  # every process's: the record is the run's
        self.state.truncated += sum(res.truncated for res in results)
        now = time.perf_counter()
        self.state.history.append(
            StepRecord.of(
                self.state.step,
                lr,
                [res.loss_terms for res in results],
                seconds=now - run.step_began,
                target_busy_s=sum(run.target_busy_s),
                drafter_busy_s=sum(rep.busy_s for rep in self.replicas),
                padding_fraction=sum(res.padding_fraction for res in results) / len(results),
            )
        )
        done, every = self.state.step + 1, self.inputs.train.heldout_every
        if held_out is not None and (done == 1 or done == self.inputs.train.max_steps or (every and done % every == 0)):
            rep = self.replicas[0]  # every replica holds the same weights
            self.state.history[-1].heldout_acceptance = held_out.acceptance(rep.step_fn, run.guard, rep.device)
        run.step_began = time.perf_counter()
        self.state.step += 1

    def report_step(self, bar: tqdm) -> None:
        """The progress of the step just ended: the bar, and a line for the log (rank 0 alone)."""
        if self.topology.rank != 0:
            return
        last = self.state.history[-1]
        rate = last.tokens / max(last.seconds, 1e-9)
        bar.set_postfix_str(f"loss {last.loss:.4f} {rate:,.0f} tok/s", refresh=False)
        bar.update()
        line = f"train: step {last.step + 1}/{self.inputs.train.max_steps} loss {last.loss:.4f} lr {last.lr:.2e} "
        tqdm.write(line + f"{rate:.0f} tok/s", file=sys.stdout)  # above the bar, on a terminal
        sys.stdout.flush()  # the log under DVC, as it goes

    @property
    def adamw_kernel(self) -> dict[str, bool]:
        """Fused AdamW where every drafter device has the kernel, else foreach: one choice per run, since
        the two round differently and every replica must step exactly alike."""
        if all(d.type in FUSED_ADAMW_DEVICES for d in self.topology.drafters):
            return {"fused": True}
        return {"foreach": True}

    def average_gradients(self) -> None:
        """Mean of the replicas' gradients (then over processes), clipped, written back into every replica.

        Each replica's gradients are copied into one flat bucket: one sum, one all-reduce and one clip
        for the whole drafter, however many tensors it has. Every replica's .grad then views the same
        averaged bucket (one copy per device), so the replicas step on identical gradients by construction."""
        groups = [
            [t for t in rep.drafter.parameters() if t.requires_grad and t.grad is not None] for rep in self.replicas
        ]
        buckets = [torch.cat([t.grad.reshape(-1) for t in group]) for group in groups]
        total = mean_gradient(buckets, self.topology.world_size, self.inputs.train.grad_clip)
        on_device: dict[torch.device, torch.Tensor] = {}
        sizes = [t.numel() for t in groups[0]]
        for rep, group in zip(self.replicas, groups, strict=True):
            if rep.device not in on_device:
                on_device[rep.device] = total.to(rep.device)
            bucket = on_device[rep.device]
            for t, g in zip(group, bucket.split(sizes), strict=True):
                t.grad = g.view_as(t)

    def optimizer_step(self, lr: float) -> None:
        """Step every replica alike (same clipped gradient, same optimizer state: same weights)."""
        for rep in self.replicas:
            for group in rep.optimizer.param_groups:
                group["lr"] = lr
            rep.optimizer.step()
            rep.optimizer.zero_grad(set_to_none=True)

    def replica_mismatches(self) -> list[str]:
        return replica_mismatches([rep.drafter for rep in self.replicas])


@dataclass
class Replica:
    """One drafter replica on its device: its weights, compiled step and optimizer, and its thread's busy time."""

    drafter: DFlashDrafter
    step_fn: Callable[..., DraftLoss]
    optimizer: torch.optim.Optimizer
    device: torch.device
    busy_s: float = 0.0
    warm_start: dict[str, int] = field(default_factory=dict)
    """Inductor's cache hits and misses when the main thread first ran its step (Trainer.warm_up_compiled)."""


@dataclass(frozen=True)
class HeldOut:
    """The held-out sequences (train.heldout_sequences) as the drafter step's inputs: chunks of the compiled
    step's rows (micro_batch; the last padded with empty rows), fixed anchors, and their features computed
    once. Measured with the training step itself, so no new graph is compiled and no kernel differs."""

    chunks: list[StepInputs]
    sequences: int

    def acceptance(self, step_fn: Callable[..., DraftLoss], guard: CompileGuard, device: torch.device) -> float:
        """Simulated tau on the held-out blocks: what the drafter's weights now would get verified."""
        accepted = blocks = 0.0
        for inputs in self.chunks:
            with autocast(device):
                out = guard.call("held-out acceptance", step_fn, *inputs.args())
            accepted += float(out.accepted.detach())
            blocks += float(out.blocks.detach())
            del out  # its graph: this forward is never backpropagated
        return simulated_tau(accepted, blocks)


def target_inputs(
    target: Target, batch: Batch, anchors: torch.Tensor, layer_ids: Sequence[int], model: ModelParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's side of one training item, on its device: the drafter's layers' hidden states of every
    row [B, S, n*H] (each packed document attending only within itself, as if alone: what decoding captures
    for that document), and when distilling its final hidden states where it predicts each slot, else None.

    Without distillation only decoder layers 0..max(layer_ids) run: no later layer, LM head or logits."""
    device = target.device
    ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
    documents, positions = batch.document_ids.to(device), batch.position_ids.to(device)
    with torch.no_grad():
        if model.distill == "none":
            return target_layer_features(target.model, ids, attention, layer_ids, documents, positions), None
        at = prediction_positions(anchors, model.block_size, model.seq_len).to(device)
        return target_features_and_predictions(target.model, ids, attention, layer_ids, at, documents, positions)


def step_inputs(
    batch: Batch,
    features: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    target_hidden: torch.Tensor | None,
) -> StepInputs:
    """The drafter step's inputs for a collated batch: the target's side, the batch's tokens, the anchors."""
    return StepInputs(
        features,
        batch.input_ids,
        batch.loss_mask,
        anchors,
        valid,
        batch.document_ids,
        batch.position_ids,
        target_hidden,
    )


def drafter_thread(r: int) -> str:
    """The name of replica r's thread, by which the compile counter tells its compiles apart."""
    return f"drafter-{r}"


def anchor_generator(seed: int, step: int, replica: int) -> torch.Generator:
    """Anchors are resampled every step, per sequence, from (seed, step, global replica) alone."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + replica)


def lr_at(step: int, p: TrainParams) -> float:
    """Linear warmup to lr, then train.schedule down to lr * min_lr_ratio at the last step (max_steps - 1)."""
    if step < p.warmup_steps:
        return p.lr * (step + 1) / p.warmup_steps
    if p.schedule == "wsd":
        start = decay_start(p)
        if step < start:
            return p.lr
        return p.lr * (1 - (1 - p.min_lr_ratio) * min(1.0, (step + 1 - start) / (p.max_steps - start)))
    progress = (step - p.warmup_steps) / max(1, p.max_steps - p.warmup_steps)
    return p.lr * (p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decay_start(p: TrainParams) -> int:
    """wsd: the first step of the decay. Every step before it trains at lr, whatever max_steps: the checkpoint
    taken here is where a longer run of the same inputs continues from (CheckpointPolicy keeps it)."""
    return max(p.warmup_steps, p.max_steps - round(p.decay_ratio * p.max_steps))


FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Device types with torch's fused AdamW kernel."""


def mean_gradient(buckets: list[torch.Tensor], world_size: int, clip: float) -> torch.Tensor:
    """The mean of the replicas' flat gradient buckets (on the first one's device), then over processes
    (world_size > 1: one all-reduce), clipped to total norm `clip` (0: no clipping)."""
    total = buckets[0].clone()
    for bucket in buckets[1:]:
        total += bucket.to(total.device)
    total /= len(buckets)
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total /= world_size
    if clip > 0:  # what clip_grad_norm_ does, over the one tensor
        total.mul_((clip / (torch.linalg.vector_norm(total) + 1e-6)).clamp_max(1.0))
    return total


def replica_mismatches(replicas: list[torch.nn.Module]) -> list[str]:
    """The tensors (as `replica N: name`) in which a replica differs from replica 0; [] when all are identical."""
    first = {k: v.detach().cpu() for k, v in replicas[0].state_dict().items()}
    return [
        f"replica {r}: {k}"
        for r, rep in enumerate(replicas[1:], start=1)
        for k, v in rep.state_dict().items()
        if k not in first or not torch.equal(first[k], v.detach().cpu())
    ]
