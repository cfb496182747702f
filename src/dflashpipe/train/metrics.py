"""What a run reports: one record per step, the stage's metrics.json, its DVCLive plots and PNG images.

The history of records travels in the resumable checkpoint, so a resumed run reports the whole
run, not only the steps it trained itself.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflashpipe import plots as plotting
from dflashpipe.artifacts import PARTIAL, atomic_directory
from dflashpipe.model import DraftLoss
from dflashpipe.spread import Spread

if TYPE_CHECKING:
    from dflashpipe.train.loop import Trainer


@dataclass
class StepRecord:
    step: int
    loss: float
    """Mean over this process's replicas."""
    lr: float
    tokens: int
    """Supervised tokens of the step, over every process."""
    seconds: float
    slot_correct: list[float]
    slot_count: list[float]
    target_busy_s: float
    """Cumulative, over the target workers of this run."""
    drafter_busy_s: float
    """Cumulative, over the drafter replicas of this run."""
    padding_fraction: float = 0.0
    """Pad tokens / all tokens of this process's packed rows this step (every step's rows are the same size)."""
    accepted: float = 0.0
    """Leading right slots summed over this process's blocks (DraftLoss.accepted): simulated verification."""
    blocks: float = 0.0
    """Blocks whose slot 1 is supervised, over this process's replicas (DraftLoss.blocks)."""

    @property
    def acceptance_length(self) -> float:
        """Simulated tau on this step's training blocks (before its update): accepted per block + 1."""
        return 1 + self.accepted / max(self.blocks, 1)

    @classmethod
    def of(
        cls,
        step: int,
        lr: float,
        losses: Sequence[DraftLoss],
        world_size: int,
        seconds: float,
        target_busy_s: float,
        drafter_busy_s: float,
        padding_fraction: float = 0.0,
    ) -> StepRecord:
        """One step's record from every replica's loss terms."""
        correct = torch.stack([o.slot_correct.detach().float().cpu() for o in losses]).sum(0)
        count = torch.stack([o.slot_count.detach().float().cpu() for o in losses]).sum(0)
        loss = float(sum(o.loss.detach().float().cpu() for o in losses) / len(losses))
        accepted, blocks = (
            float(sum(getattr(o, name).detach().float().cpu() for o in losses)) for name in ("accepted", "blocks")
        )
        return cls(
            step=step,
            loss=loss,
            lr=lr,
            tokens=int(count.sum()) * world_size,
            seconds=seconds,
            slot_correct=correct.tolist(),
            slot_count=count.tolist(),
            target_busy_s=target_busy_s,
            drafter_busy_s=drafter_busy_s,
            padding_fraction=padding_fraction,
            accepted=accepted,
            blocks=blocks,
        )


def train_metrics(
    trainer: Trainer, before: dict, after: dict, warm_s: float, compile_note: str, replicas_identical: bool
) -> dict:
    """metrics/train/metrics.json. `before`/`after`: dynamo_counters() around the run."""
    history = trainer.history
    steady = history[1:] or history  # the first step includes the threads' start: excluded when possible
    accuracy = slot_accuracy(history)
    in_workers = after["compiles_outside_main_thread"] - before["compiles_outside_main_thread"]
    return {
        "steps": trainer.step,
        "final_loss": round(history[-1].loss, 6),
        # the median of the steady steps' own rates, with their spread (tokens_per_s_spread: dflashpipe.spread)
        **Spread.of([h.tokens / h.seconds for h in steady if h.seconds > 0] or [0.0]).record("tokens_per_s"),
        "supervised_tokens": int(sum(h.tokens for h in history)),
        "slot_accuracy": {str(k + 1): round(a, 6) for k, a in enumerate(accuracy)},
        "acceptance_length": acceptance_window(history),
        "replicas": trainer.topology.replicas * trainer.topology.world_size,
        "replicas_identical": replicas_identical,
        "truncated_sequences": trainer.truncated,
        # Every step's rows hold as many tokens, so the mean of the steps' fractions is the run's.
        "padding_fraction": round(sum(h.padding_fraction for h in history) / len(history), 6),
        "compile": {
            "enabled": trainer.inputs.compile.enabled,
            "source": compile_note,
            "warmup_s": round(warm_s, 3),
            "new_graphs_in_workers": after["unique_graphs"] - before["unique_graphs"],
            "compiles_in_worker_threads": in_workers,
        },
        "busy_s": {"target": round(history[-1].target_busy_s, 3), "drafter": round(history[-1].drafter_busy_s, 3)},
        "throughput": throughput(trainer, steady),
    }


# -- throughput: model FLOPs, achieved FLOP/s, MFU (the convention: docs/throughput.md) -------------

PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("RTX 4090", 165e12),
)
"""Dense bf16 tensor-core peaks per device (datasheets, no sparsity), matched in order as substrings of
torch.cuda.get_device_name: "H100" after its PCIe and NVL variants, which name themselves."""


def peak_bf16_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s; None for a CPU or a GPU not in PEAK_BF16_FLOPS."""
    return peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def linear_params(module: torch.nn.Module) -> int:
    """Weights that multiply activations: every nn.Linear's (2 FLOPs per weight per token)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def target_forward_flops(target: torch.nn.Module, target_layer_ids: Sequence[int], seq_len: int) -> int:
    """One sequence through decoder layers 0..max(ids): 2 x matmul weights x S, plus causal attention
    2 x S^2 x width per layer (QK^T and AV, 2 x 2 x S^2 x width, halved by the causal mask)."""
    layers = target.model.layers[: max(target_layer_ids) + 1]
    return sum(
        2 * linear_params(layer) * seq_len + 2 * seq_len**2 * layer.self_attn.q_proj.out_features for layer in layers
    )


def drafter_forward_flops(drafter: torch.nn.Module, seq_len: int, num_anchors: int) -> int:
    """One sequence's training forward: fc over S context tokens; per layer its matmuls over the A x bs
    block tokens, K and V of the S context tokens, and attention of A x bs queries over S + A x bs keys
    (dense, as sdpa computes it); the LM head over the A x (bs - 1) drafted slots."""
    bs = drafter.config.block_size
    queries = num_anchors * bs
    fc = 2 * drafter.fc.weight.numel() * seq_len
    layers = sum(
        2 * linear_params(layer) * queries
        + 2 * (layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()) * seq_len
        + 4 * queries * (seq_len + queries) * layer.self_attn.q_proj.out_features
        for layer in drafter.layers
    )
    head = 2 * drafter.target.lm_head.weight.numel() * num_anchors * (bs - 1)
    return fc + layers + head


def throughput(trainer: Trainer, steady: Sequence[StepRecord]) -> dict:
    """Model FLOPs per step (every process), achieved FLOP/s over the steady steps, MFU where every device's
    peak is known, and which side bounds the step (the busier worker on average)."""
    p, topology = trainer.inputs, trainer.topology
    drafter = trainer.replicas[0].drafter
    sequences = p.compile.micro_batch * topology.replicas * topology.world_size
    # Distilling runs the target through its last layer, and its LM head (forward only) on the drafted slots.
    distilling = p.model.distill != "none"
    through = (drafter.config.num_target_layers - 1,) if distilling else drafter.config.target_layer_ids
    per_sequence = target_forward_flops(trainer.targets[0], through, p.model.seq_len) + 3 * drafter_forward_flops(
        drafter, p.model.seq_len, p.model.num_anchors
    )
    if distilling:
        per_sequence += 2 * drafter.target.lm_head.weight.numel() * p.model.num_anchors * (p.model.block_size - 1)
    per_step = sequences * per_sequence
    seconds = sum(h.seconds for h in steady)
    achieved = per_step * len(steady) / seconds if seconds > 0 else 0.0
    peaks = [device_peak_flops(d) for d in {*topology.targets, *topology.drafters}]
    peak = sum(peaks) * topology.world_size if peaks and None not in peaks else None
    last = trainer.history[-1]
    target_s, drafter_s = last.target_busy_s / len(topology.targets), last.drafter_busy_s / len(topology.drafters)
    return {
        "flops_per_step": per_step,
        "flops_per_s": float(f"{achieved:.4g}"),
        "peak_flops_per_s": peak,
        "mfu": round(achieved / peak, 4) if peak else None,
        "bound_by": "target" if target_s >= drafter_s else "drafter",
    }


def slot_accuracy(history: Sequence[StepRecord]) -> list[float]:
    """Per block slot (1 .. bs-1): the share of the run's supervised tokens at that slot predicted right."""
    correct = torch.tensor([h.slot_correct for h in history]).sum(0)
    count = torch.tensor([h.slot_count for h in history]).sum(0)
    return (correct / count.clamp_min(1)).tolist()


def acceptance_window(history: Sequence[StepRecord]) -> dict:
    """Simulated tau on the training blocks over the run's first and last tenth of steps (at least one each):
    learning shows as `last` above `first`; on data it memorised, decode-time tau should equal `last`."""
    n = max(1, len(history) // 10)

    def over(records: Sequence[StepRecord]) -> float:
        return round(1 + sum(h.accepted for h in records) / max(sum(h.blocks for h in records), 1), 4)

    return {"first": over(history[:n]), "last": over(history[-n:]), "steps_each": n}


def seen_tokens(history: Sequence[StepRecord]) -> list[int]:
    """Supervised tokens trained on up to and including each step: the x of the learning curve."""
    total, seen = 0, []
    for h in history:
        total += h.tokens
        seen.append(total)
    return seen


IMAGES = ("loss", "slot_accuracy", "tokens_per_s", "acceptance_length")
"""metrics/train/plots/images/<name>.png: static images of the key curves (dvc.yaml declares the folder)."""


def plot_images(history: Sequence[StepRecord]) -> dict[str, bytes]:
    """PNG images of the loss, the per-slot accuracy (as in metrics.json) and tokens/s: same history, same bytes."""
    accuracy = [round(a, 6) for a in slot_accuracy(history)]
    specs = {
        "loss": plotting.line_spec([{"step": h.step, "loss": h.loss} for h in history], "step", "loss", "train loss"),
        "slot_accuracy": plotting.bar_spec(
            [{"slot": k + 1, "accuracy": a} for k, a in enumerate(accuracy)],
            "slot",
            "accuracy",
            "per-slot accuracy over the run (metrics.json slot_accuracy)",
            category_title="block slot",
        ),
        "tokens_per_s": plotting.line_spec(
            [{"step": h.step, "tokens_per_s": h.tokens / max(h.seconds, 1e-9)} for h in history],
            "step",
            "tokens_per_s",
            "training throughput",
            y_title="supervised tokens/s",
        ),
        "acceptance_length": plotting.line_spec(
            [
                {"supervised_tokens": seen, "acceptance_length": round(h.acceptance_length, 4)}
                for h, seen in zip(history, seen_tokens(history), strict=True)
            ],
            "supervised_tokens",
            "acceptance_length",
            "simulated tau on the training blocks",
            y_title="accepted + 1 per block",
        ),
    }
    return {name: plotting.png(specs[name]) for name in IMAGES}


def write_plots(history: list[StepRecord], metrics_dir: Path) -> None:
    """Per-step curves through DVCLive and PNG images of the key ones, written once at the end from the
    (resumable) history.

    DVCLive writes in place, so it writes into a scratch directory, and the finished curves and images
    replace `plots/` whole: a killed run never leaves a half-written curve or image."""
    images = plot_images(history)  # before anything is written: a rendering error leaves the old plots
    from dvclive import Live

    with (
        atomic_directory(metrics_dir / "plots") as plots,
        tempfile.TemporaryDirectory(prefix=f".plots{PARTIAL}live-", dir=metrics_dir) as scratch,
    ):
        with Live(scratch, dvcyaml=False, save_dvc_exp=False, report=None) as live:
            for h, seen in zip(history, seen_tokens(history), strict=True):
                live.step = h.step
                live.log_metric("loss", h.loss, plot=True)
                live.log_metric("lr", h.lr, plot=True)
                live.log_metric("tokens_per_s", h.tokens / max(h.seconds, 1e-9), plot=True)
                live.log_metric("slot1_accuracy", h.slot_correct[0] / max(h.slot_count[0], 1), plot=True)
                live.log_metric("acceptance_length", h.acceptance_length, plot=True)
                live.log_metric("supervised_tokens_seen", seen, plot=True)
                live.log_metric("target_busy_s", h.target_busy_s, plot=True)
                live.log_metric("drafter_busy_s", h.drafter_busy_s, plot=True)
        shutil.move(Path(scratch) / "plots" / "metrics", plots / "metrics")
        (plots / "images").mkdir()
        for name, data in images.items():
            (plots / "images" / f"{name}.png").write_bytes(data)  # atomic_directory fsyncs and renames
