"""Drafter training: target workers feed drafter replicas, one thread each, in lockstep.

    target worker threads ──features──▶ mailbox[r] ──▶ drafter thread r ──grads──▶ barrier
                                                                                   │
          average over replicas (and processes), clip, AdamW step on every replica ◀┘

- Each target device holds a frozen copy of the target; its thread runs the forward
  (no grad) for the (step, replica) items assigned to it round-robin and hands the
  chosen layers' hidden states to that replica. A target worker runs at most
  `train.prefetch` items ahead of the drafters, so memory stays bounded.
- Each drafter device holds one replica and one thread. All replicas start from the
  same initialisation and apply the same averaged gradient with identical optimizers,
  so they stay identical, which the run checks at the end.
- The main thread loads the warmup artifact and runs every compiled graph once before
  any worker starts, then arms the compile guard: the workers compile nothing.
- Under torchrun (WORLD_SIZE > 1) the averaged gradient is all-reduced across
  processes; only rank 0 writes outputs.
- Everything that decides the numbers (data order, anchors, initialisation) derives
  from the seed and the step, so a run resumed from a checkpoint ends where an
  uninterrupted one does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflashpipe.artifacts import (PARTIAL, atomic_directory, canonical_json, file_sha256, verify_file_listing,
                                  write_file_listing, write_json_atomic)
from dflashpipe.compile.guard import COUNTER, CompileGuard, dynamo_counters
from dflashpipe.compile.warmup import autocast, compiled_step, feature_dtype, run_step_once
from dflashpipe.errors import DflashpipeError
from dflashpipe.model import DFlashDrafter, TargetHead, sample_anchor_positions, target_features
from dflashpipe.params import CompileParams, ModelParams, TopologyParams, TrainParams
from dflashpipe.target import load_materialised_target
from dflashpipe.train.data import BatchPlan, TokenData, collate, load_tokens
from dflashpipe.train.topology import Topology, check_topology

CHECKPOINT = "checkpoint"
POLL_S = 0.05


@dataclass(frozen=True)
class TrainInputs:
    model: ModelParams
    compile: CompileParams
    topology: TopologyParams
    train: TrainParams


def lr_at(step: int, p: TrainParams) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at max_steps."""
    if step < p.warmup_steps:
        return p.lr * (step + 1) / p.warmup_steps
    progress = (step - p.warmup_steps) / max(1, p.max_steps - p.warmup_steps)
    return p.lr * (p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def anchor_generator(seed: int, step: int, replica: int) -> torch.Generator:
    """Anchors are resampled every step, per sequence, from (seed, step, global replica) alone."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + replica)


def head_on(target, device: torch.device) -> TargetHead:
    """The target's embedding, final norm and LM head on `device` (shared when it is the target's device)."""
    head = TargetHead.of(target)
    if target.device == device:
        return head
    return TargetHead(*(copy.deepcopy(m).to(device) for m in (head.embed_tokens, head.final_norm, head.lm_head)))


class Mailbox:
    """Features for one replica, by step. `get` waits; an abort wakes every waiter."""

    def __init__(self, abort: threading.Event) -> None:
        self.items: dict[int, Any] = {}
        self.cond = threading.Condition()
        self.abort = abort

    def put(self, step: int, item: Any) -> None:
        with self.cond:
            self.items[step] = item
            self.cond.notify_all()

    def get(self, step: int) -> Any:
        with self.cond:
            while step not in self.items:
                if self.abort.is_set():
                    raise _Aborted()
                self.cond.wait(POLL_S)
            return self.items.pop(step)


class TrainCheckpointError(DflashpipeError):
    """The resumable checkpoint in data/train-state/ is damaged."""


class _Aborted(Exception):
    """Another thread failed; this one stops quietly and the first error is reported."""


@dataclass
class Replica:
    drafter: DFlashDrafter
    step_fn: Callable
    optimizer: torch.optim.Optimizer
    device: torch.device
    busy_s: float = 0.0
    result: Any = None


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    tokens: int
    seconds: float
    slot_correct: list[float]
    slot_count: list[float]
    target_busy_s: float
    drafter_busy_s: float


@dataclass
class Trainer:
    inputs: TrainInputs
    data: TokenData
    topology: Topology
    target_dir: Path
    pad_id: int
    replicas: list[Replica] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)
    history: list[StepRecord] = field(default_factory=list)
    step: int = 0
    truncated: int = 0

    @property
    def plan(self) -> BatchPlan:
        p = self.inputs
        return BatchPlan(len(self.data), self.topology.world_size, self.topology.replicas,
                         p.compile.micro_batch, p.train.seed)

    def global_replica(self, r: int) -> int:
        return self.topology.rank * self.topology.replicas + r

    # -- set-up, all in the main thread -------------------------------------------------------

    def build(self, tokenizer) -> None:
        p = self.inputs
        self.targets = [load_materialised_target(self.target_dir, d) for d in self.topology.targets]
        for device in self.topology.drafters:
            g = torch.Generator().manual_seed(p.train.seed)
            target = self.targets[0]
            drafter = DFlashDrafter.for_target(target, tokenizer, p.model, generator=g)
            drafter.target = head_on(target, device)
            drafter = drafter.to(device)
            step_fn = compiled_step(drafter) if p.compile.enabled else drafter
            trainable = [t for t in drafter.parameters() if t.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=p.train.lr, betas=(0.9, 0.95),
                                          weight_decay=p.train.weight_decay)
            self.replicas.append(Replica(drafter, step_fn, optimizer, device))

    def warm_up_compiled(self) -> float:
        """Run every replica's compiled step once, forward and backward, in the main thread."""
        began = time.perf_counter()
        for r in self.replicas:
            run_step_once(r.step_fn, r.drafter, self.inputs.model, self.inputs.compile.micro_batch, r.device)
        return time.perf_counter() - began

    # -- the run --------------------------------------------------------------------------------

    def run(self, guard: CompileGuard, on_step: Callable[[Trainer], None]) -> None:
        p = self.inputs
        abort = threading.Event()
        errors: list[BaseException] = []
        mailboxes = [Mailbox(abort) for _ in self.replicas]
        layer_ids = self.replicas[0].drafter.config.target_layer_ids
        n_targets, n_replicas = len(self.targets), len(self.replicas)
        start_step = self.step
        total_items = (p.train.max_steps - start_step) * n_replicas
        target_busy = [0.0] * n_targets
        lock = threading.Lock()

        def guarded(fn: Callable, *args) -> None:
            try:
                fn(*args)
            except _Aborted:
                pass
            except threading.BrokenBarrierError:
                pass
            except BaseException as exc:  # the first failure stops every thread, then is re-raised
                with lock:
                    errors.append(exc)
                abort.set()
                barrier.abort()

        def target_worker(t: int) -> None:
            slots = threading.Semaphore(p.train.prefetch)
            target, device = self.targets[t], self.topology.targets[t]
            for i in range(t, total_items, n_targets):  # (step, replica) items, round-robin over targets
                step, r = divmod(i, n_replicas)
                step += start_step
                while not slots.acquire(timeout=POLL_S):
                    if abort.is_set():
                        return
                batch = collate(self.data, self.plan.indices(step, self.topology.rank, r), p.model.seq_len, self.pad_id)
                began = time.perf_counter()
                with torch.no_grad():
                    out = target(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                                 output_hidden_states=True)
                    features = target_features(out.hidden_states, layer_ids)
                drafter_device = self.replicas[r].device
                features = features.to(drafter_device, feature_dtype(drafter_device))
                target_busy[t] += time.perf_counter() - began
                mailboxes[r].put(step, (batch, features, slots.release))

        def drafter_worker(r: int) -> None:
            replica = self.replicas[r]
            for step in range(start_step, p.train.max_steps):
                batch, features, release = mailboxes[r].get(step)
                release()
                began = time.perf_counter()
                ids, mask = batch.input_ids.to(replica.device), batch.loss_mask.to(replica.device)
                anchors, valid = sample_anchor_positions(
                    mask, p.model.num_anchors, anchor_generator(p.train.seed, step, self.global_replica(r)))
                with autocast(replica.device):
                    out = guard.call(f"drafter step (replica {r})", replica.step_fn, features, ids, mask, anchors, valid)
                out.loss.backward()
                replica.busy_s += time.perf_counter() - began
                replica.result = (out, batch.truncated)
                barrier.wait()

        step_began = [time.perf_counter()]

        def sync() -> None:  # the barrier's action: runs once per step, in one of the drafter threads
            self.average_gradients()
            lr = lr_at(self.step, p.train)
            for rep in self.replicas:
                if p.train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([t for t in rep.drafter.parameters() if t.requires_grad],
                                                   p.train.grad_clip)
                for group in rep.optimizer.param_groups:
                    group["lr"] = lr
                rep.optimizer.step()
                rep.optimizer.zero_grad(set_to_none=True)
            outs = [rep.result[0] for rep in self.replicas]
            self.truncated += sum(rep.result[1] for rep in self.replicas)
            now = time.perf_counter()
            correct = torch.stack([o.slot_correct.detach().float().cpu() for o in outs]).sum(0)
            count = torch.stack([o.slot_count.detach().float().cpu() for o in outs]).sum(0)
            self.history.append(StepRecord(
                step=self.step, loss=float(sum(o.loss.detach().float().cpu() for o in outs) / len(outs)), lr=lr,
                tokens=int(count.sum()) * self.topology.world_size, seconds=now - step_began[0],
                slot_correct=correct.tolist(), slot_count=count.tolist(), target_busy_s=sum(target_busy),
                drafter_busy_s=sum(rep.busy_s for rep in self.replicas)))
            step_began[0] = now
            self.step += 1
            on_step(self)

        # An exception in the action breaks the barrier: the thread that ran it reports it.
        barrier = threading.Barrier(n_replicas, action=sync)
        threads = [threading.Thread(target=guarded, args=(target_worker, t), name=f"target-{t}", daemon=True)
                   for t in range(n_targets)]
        threads += [threading.Thread(target=guarded, args=(drafter_worker, r), name=f"drafter-{r}", daemon=True)
                    for r in range(n_replicas)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    def average_gradients(self) -> None:
        """Mean of the replicas' gradients (then over processes), written back into every replica."""
        import torch.distributed as dist

        params = [[t for t in rep.drafter.parameters() if t.requires_grad] for rep in self.replicas]
        home = self.replicas[0].device
        for i in range(len(params[0])):
            grads = [group[i].grad for group in params]
            if any(g is None for g in grads):
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total += g.to(home)
            total /= len(grads)
            if self.topology.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
                total /= self.topology.world_size
            for group in params:
                group[i].grad.copy_(total.to(group[i].grad.device))

    def replicas_identical(self) -> bool:
        first = self.replicas[0].drafter.state_dict()
        return all(
            all(torch.equal(first[k].cpu(), v.cpu()) for k, v in rep.drafter.state_dict().items())
            for rep in self.replicas[1:]
        )

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, state_dir: Path, run_key: str) -> None:
        with atomic_directory(state_dir / CHECKPOINT) as tmp:
            self.replicas[0].drafter.save_pretrained(tmp / "drafter")
            torch.save(self.replicas[0].optimizer.state_dict(), tmp / "optimizer.pt")
            write_json_atomic(tmp / "state.json", {
                "run_key": run_key, "step": self.step, "truncated": self.truncated,
                "history": [record.__dict__ for record in self.history]})
            write_file_listing(tmp)

    def resume(self, state_dir: Path, run_key: str) -> bool:
        """Load the last checkpoint if it belongs to this very run (same inputs); else start over."""
        from safetensors.torch import load_file

        path = state_dir / CHECKPOINT
        if not path.exists():
            return False
        # Written whole or not at all (atomic_directory), so damage here came from outside: say so, never
        # resume from wrong numbers and never silently throw away hours of training either.
        verify_file_listing(path, f"delete it to start this run from step 0 (`rm -r {path}`); a checkpoint "
                                  f"is not cached by DVC, so it cannot be restored", TrainCheckpointError)
        state = json.loads((path / "state.json").read_text())
        if state.get("run_key") != run_key:
            print(f"train: ignoring {path}: it belongs to a run with other inputs")
            return False
        weights = load_file(path / "drafter" / "model.safetensors")
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
        for rep in self.replicas:
            rep.drafter.load_state_dict({k: v.to(rep.device) for k, v in weights.items()}, strict=False)
            # A private copy each: load_state_dict keeps same-device tensors as they are, and two
            # optimizers stepping one shared exp_avg would pull the replicas apart.
            rep.optimizer.load_state_dict(copy.deepcopy(optimizer))
        self.step, self.truncated = state["step"], state["truncated"]
        self.history = [StepRecord(**h) for h in state["history"]]
        print(f"train: resumed from {path} at step {self.step}")
        return True


def run_key(inputs: TrainInputs, tokens_dir: Path, target_dir: Path, world_size: int) -> str:
    """What decides the trajectory: every param, the token shards, the target, the process count, the code."""
    code = sorted(Path(__file__).resolve().parents[1].joinpath("model").glob("*.py")) + [Path(__file__).resolve()]
    key = {
        "params": {k: getattr(inputs, k).__class__.__name__ + repr(getattr(inputs, k)) for k in inputs.__dataclass_fields__},
        "tokens": file_sha256(tokens_dir / "summary.json"),
        "target": file_sha256(target_dir / "source.json"),
        "world_size": world_size,
        "code": [file_sha256(f) for f in code],
    }
    return hashlib.sha256(canonical_json(key)).hexdigest()


def train_drafter(inputs: TrainInputs, tokens_dir: Path | str, target_dir: Path | str, compile_dir: Path | str,
                  out_dir: Path | str, state_dir: Path | str, metrics_dir: Path | str) -> dict:
    """The whole train stage. Returns the metrics it wrote."""
    from transformers import AutoTokenizer

    from dflashpipe.compile.artifact import load_artifact_or_go_cold
    from dflashpipe.env import kernel_environment

    tokens_dir, target_dir, compile_dir = Path(tokens_dir), Path(target_dir), Path(compile_dir)
    out_dir, state_dir, metrics_dir = Path(out_dir), Path(state_dir), Path(metrics_dir)
    topology = check_topology(inputs.topology)  # before anything loads
    state_dir.mkdir(parents=True, exist_ok=True)  # a declared output, even when no checkpoint is due
    if topology.world_size > 1:
        import torch.distributed as dist

        backend = "nccl" if topology.drafters[0].type == "cuda" else "gloo"
        dist.init_process_group(backend)
    data = load_tokens(tokens_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    compile_note = "eager: compile.enabled is false"
    if inputs.compile.enabled:
        compile_note = load_artifact_or_go_cold(compile_dir, state_dir / "inductor-cache", kernel_environment())
        if compile_note != "artifact":
            print(f"train: {compile_note}, in the main thread")
    COUNTER.install()

    trainer = Trainer(inputs, data, topology, target_dir, pad_id)
    trainer.build(tokenizer)
    key = run_key(inputs, tokens_dir, target_dir, topology.world_size)
    trainer.resume(state_dir, key)
    warm_s = trainer.warm_up_compiled()
    guard = CompileGuard(strict=inputs.compile.guard == "error")
    if inputs.compile.enabled:
        guard.arm()
    before = dynamo_counters()

    every = inputs.train.checkpoint_every

    def on_step(t: Trainer) -> None:
        if topology.rank == 0 and every and t.step % every == 0 and t.step < inputs.train.max_steps:
            t.save_checkpoint(state_dir, key)
        last = t.history[-1]
        if topology.rank == 0:
            print(f"train: step {last.step + 1}/{inputs.train.max_steps} loss {last.loss:.4f} lr {last.lr:.2e} "
                  f"{last.tokens / max(last.seconds, 1e-9):.0f} tok/s", flush=True)

    trainer.run(guard, on_step)
    if inputs.compile.enabled:
        guard.disarm()
    after = dynamo_counters()
    if not trainer.replicas_identical():
        raise DflashpipeError("drafter replicas diverged: their gradients were not averaged identically (a bug)")
    metrics = train_metrics(trainer, before, after, warm_s, compile_note)
    if topology.rank == 0:
        with atomic_directory(out_dir) as tmp:
            trainer.replicas[0].drafter.save_pretrained(tmp)
            write_file_listing(tmp)  # evaluate checks the drafter against it before use
        write_plots(trainer.history, metrics_dir)
        write_json_atomic(metrics_dir / "metrics.json", metrics)
        if every:
            trainer.save_checkpoint(state_dir, key)
    return metrics


def train_metrics(trainer: Trainer, before: dict, after: dict, warm_s: float, compile_note: str) -> dict:
    history = trainer.history
    steady = history[1:] or history  # the first step includes the threads' start: excluded when possible
    seconds = sum(h.seconds for h in steady)
    correct = torch.tensor([h.slot_correct for h in history]).sum(0)
    count = torch.tensor([h.slot_count for h in history]).sum(0)
    accuracy = (correct / count.clamp_min(1)).tolist()
    return {
        "steps": trainer.step,
        "final_loss": round(history[-1].loss, 6),
        "tokens_per_s": round(sum(h.tokens for h in steady) / seconds, 2) if seconds > 0 else 0.0,
        "supervised_tokens": int(sum(h.tokens for h in history)),
        "slot_accuracy": {str(k + 1): round(a, 6) for k, a in enumerate(accuracy)},
        "replicas": trainer.topology.replicas * trainer.topology.world_size,
        "replicas_identical": True,
        "truncated_sequences": trainer.truncated,
        "compile": {
            "enabled": trainer.inputs.compile.enabled,
            "source": compile_note,
            "warmup_s": round(warm_s, 3),
            "new_graphs_in_workers": after["unique_graphs"] - before["unique_graphs"],
            "compiles_in_worker_threads": after["compiles_outside_main_thread"] - before["compiles_outside_main_thread"],
        },
        "busy_s": {"target": round(history[-1].target_busy_s, 3), "drafter": round(history[-1].drafter_busy_s, 3)},
    }


def write_plots(history: list[StepRecord], metrics_dir: Path) -> None:
    """Per-step curves through DVCLive, written once at the end from the (resumable) history.

    DVCLive writes in place, so it writes into a scratch directory, and the finished curves replace
    `plots/` whole: a killed run never leaves a half-written curve."""
    import tempfile

    from dvclive import Live

    with atomic_directory(metrics_dir / "plots") as plots, \
            tempfile.TemporaryDirectory(prefix=f".plots{PARTIAL}live-", dir=metrics_dir) as scratch:
        with Live(scratch, dvcyaml=False, save_dvc_exp=False, report=None) as live:
            for h in history:
                live.step = h.step
                live.log_metric("loss", h.loss, plot=True)
                live.log_metric("lr", h.lr, plot=True)
                live.log_metric("tokens_per_s", h.tokens / max(h.seconds, 1e-9), plot=True)
                live.log_metric("slot1_accuracy", h.slot_correct[0] / max(h.slot_count[0], 1), plot=True)
                live.log_metric("target_busy_s", h.target_busy_s, plot=True)
                live.log_metric("drafter_busy_s", h.drafter_busy_s, plot=True)
        shutil.move(Path(scratch) / "plots" / "metrics", plots / "metrics")
