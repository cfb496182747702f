"""What a run reports from its `TrainState`: the stage's metrics.json, its DVCLive plots and PNG images.

The per-step records themselves are train/state.py's; the FLOP and MFU accounting, train/flops.py. Which side
bound the run (`balance`) is measured here, in the terms `dflashpipe plan` predicts it in, so a run on real
devices checks its plan.

The history of records travels in the resumable checkpoint, so a resumed run reports the whole
run, not only the steps it trained itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from dflashpipe.core import plots as plotting
from dflashpipe.core.artifacts import atomic_directory
from dflashpipe.core.spread import Busy, Spread
from dflashpipe.train.flops import throughput
from dflashpipe.train.state import StepRecord, TrainInputs, TrainState, acceptance_length
from dflashpipe.train.topology import Topology


def train_metrics(
    state: TrainState,
    inputs: TrainInputs,
    topology: Topology,
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    before: dict,
    after: dict,
    warm_s: float,
    compile_note: str,
    replicas_identical: bool,
    busy: Busy | None = None,
) -> dict:
    """metrics/train/metrics.json. `drafter`, `target`: one replica and one target copy, for the FLOP count
    (train/flops.py); `before`/`after`: dynamo_counters() around the run; `busy`: what the machine gave the run
    (recorded in tokens_per_s_spread)."""
    history = state.history
    steady = history[1:] or history  # the first step includes the threads' start: excluded when possible
    accuracy = slot_accuracy(history)
    in_workers = after["compiles_outside_main_thread"] - before["compiles_outside_main_thread"]
    balance = side_balance(history, inputs, topology)
    # Said where it is measured, once per process at the end of its run: the stage's log then carries it.
    print(f"train: {balance_line(balance)}", flush=True)
    return {
        "steps": state.step,
        "final_loss": round(history[-1].loss, 6),
        # the median of the steady steps' own rates, with their spread (tokens_per_s_spread: dflashpipe.core.spread)
        **Spread.of([h.tokens / h.seconds for h in steady if h.seconds > 0] or [0.0]).record("tokens_per_s", busy=busy),
        "supervised_tokens": int(sum(h.tokens for h in history)),
        "slot_accuracy": {str(k + 1): round(a, 6) for k, a in enumerate(accuracy)},
        "acceptance_length": acceptance_window(history),
        "heldout_acceptance": heldout_curve(history, inputs.train.heldout_sequences),
        "features": inputs.features.mode,
        "replicas": topology.replicas * topology.world_size,
        "replicas_identical": replicas_identical,
        "truncated_sequences": state.truncated,
        # Every step's rows hold as many tokens, so the mean of the steps' fractions is the run's.
        "padding_fraction": round(sum(h.padding_fraction for h in history) / len(history), 6),
        "compile": {
            "enabled": inputs.compile.enabled,
            "source": compile_note,
            "warmup_s": round(warm_s, 3),
            "new_graphs_in_workers": after["unique_graphs"] - before["unique_graphs"],
            "compiles_in_worker_threads": in_workers,
        },
        "busy_s": {"target": round(history[-1].target_busy_s, 3), "drafter": round(history[-1].drafter_busy_s, 3)},
        "balance": balance,
        "throughput": {**throughput(inputs, topology, drafter, target, steady), "bound_by": balance["bound_by"]},
    }


def this_process(history: Sequence[StepRecord]) -> Sequence[StepRecord]:
    """The records of the steps this process trained: busy times restart at 0 with each process, so a resumed
    run's first record is where they fall (a resume after a single step of ~equal busy time goes unseen)."""
    start = max(
        (i for i in range(1, len(history)) if history[i].drafter_busy_s < history[i - 1].drafter_busy_s), default=0
    )
    return history[start:]


def side_balance(history: Sequence[StepRecord], inputs: TrainInputs, topology: Topology) -> dict:
    """Each side's busy time, the tokens/s it ran at while busy (the positions of every row it handled over its
    busy seconds per worker) and the share of the run it spent waiting; the side that bound the steps (the busier
    per worker) and which waited for which. This process's steps and workers: what `dflashpipe plan` predicts."""
    run = this_process(history)
    wall = sum(h.seconds for h in run)
    tokens = len(run) * topology.replicas * inputs.compile.micro_batch * inputs.model.seq_len
    busy = {"target": history[-1].target_busy_s, "drafter": history[-1].drafter_busy_s}
    workers = {"target": len(topology.targets), "drafter": len(topology.drafters)}
    per_worker = {side: busy[side] / workers[side] for side in busy}
    bound = max(per_worker, key=per_worker.get)  # dict order breaks a tie: the target
    other = "drafter" if bound == "target" else "target"
    return {
        "steps": len(run),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        **{
            side: {
                "workers": workers[side],
                "busy_s": round(busy[side], 3),
                "tokens_per_s": round(tokens / per_worker[side], 1) if per_worker[side] > 0 else None,
                "waiting_fraction": round(max(0.0, 1 - per_worker[side] / wall), 4) if wall > 0 else None,
            }
            for side in busy
        },
        "bound_by": bound,
        "waited": f"the {other} side waited for the {bound} side",
    }


def balance_line(balance: dict) -> str:
    """One line: which side bound the run, each side's rate while busy, and how long the other one waited."""
    rates = ", ".join(
        f"{side} side {balance[side]['tokens_per_s'] or 0:,.0f} tokens/s while busy ({balance[side]['workers']} "
        f"worker{'s' if balance[side]['workers'] > 1 else ''})"
        for side in ("target", "drafter")
    )
    other = "drafter" if balance["bound_by"] == "target" else "target"
    return (
        f"bound by the {balance['bound_by']} side: {rates}; {balance['waited']} "
        f"{balance[other]['waiting_fraction'] or 0:.0%} of the {balance['wall_s']:.1f} s its steps took"
    )


def slot_accuracy(history: Sequence[StepRecord]) -> list[float]:
    """Per block slot (1 .. bs-1): the share of the run's supervised tokens at that slot predicted right."""
    correct = torch.tensor([h.slot_correct for h in history]).sum(0)
    count = torch.tensor([h.slot_count for h in history]).sum(0)
    return (correct / count.clamp_min(1)).tolist()


def acceptance_window(history: Sequence[StepRecord]) -> dict:
    """Simulated tau on the training blocks over the run's first and last tenth of steps (at least one each):
    learning shows as `last` above `first`; on data it memorised, decode-time tau should equal `last`."""
    n = max(1, len(history) // 10)
    first, last = (round(acceptance_length(part), 4) for part in (history[:n], history[-n:]))
    return {"first": first, "last": last, "steps_each": n}


def heldout_curve(history: Sequence[StepRecord], sequences: int) -> dict | None:
    """Simulated tau on the held-out sequences where it was measured (train.heldout_every): the first and the
    last measurement, each with the steps and supervised tokens behind it; None when nothing is held out."""
    points = [
        {"step": h.step + 1, "supervised_tokens": seen, "tau": round(h.heldout_acceptance, 4)}
        for h, seen in zip(history, seen_tokens(history), strict=True)
        if h.heldout_acceptance is not None
    ]
    if not points:
        return None
    return {"sequences": sequences, "measured": len(points), "first": points[0], "last": points[-1]}


def seen_tokens(history: Sequence[StepRecord]) -> list[int]:
    """Supervised tokens trained on up to and including each step: the x of the learning curve."""
    return list(itertools.accumulate(h.tokens for h in history))


IMAGES = ("loss", "slot_accuracy", "tokens_per_s", "acceptance_length", "heldout_acceptance")
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
        "heldout_acceptance": plotting.line_spec(
            [
                {"supervised_tokens": seen, "heldout_acceptance": round(h.heldout_acceptance, 4)}
                for h, seen in zip(history, seen_tokens(history), strict=True)
                if h.heldout_acceptance is not None
            ],
            "supervised_tokens",
            "heldout_acceptance",
            "simulated tau on held-out sequences (train.heldout_sequences)",
            y_title="accepted + 1 per block",
        ),
    }
    return {name: plotting.png(specs[name]) for name in IMAGES}


def curve_rows(history: Sequence[StepRecord], seen: int = 0) -> Iterator[tuple[StepRecord, dict[str, float]]]:
    """Each step's value of every curve in plots/metrics (dvc.yaml's plots, x: step); `seen`: the supervised tokens
    trained before `history`'s first step."""
    for h in history:
        seen += h.tokens
        values = {
            "loss": h.loss,
            "lr": h.lr,
            "tokens_per_s": h.tokens / max(h.seconds, 1e-9),
            "slot1_accuracy": h.slot_correct[0] / max(h.slot_count[0], 1),
            "acceptance_length": h.acceptance_length,
        }
        if h.heldout_acceptance is not None:
            values["heldout_acceptance"] = h.heldout_acceptance
        values |= {"supervised_tokens_seen": seen, "target_busy_s": h.target_busy_s, "drafter_busy_s": h.drafter_busy_s}
        yield h, values


def append_curves(folder: Path, history: Sequence[StepRecord], seen: int = 0) -> None:
    """`history`'s rows appended to the curves' TSVs in `folder`, by DVCLive's writer (its format, no timestamps)."""
    from dvclive.plots import Metric

    for h, values in curve_rows(history, seen):
        for name, value in values.items():
            metric = Metric(name, "")
            metric.output_folder, metric.step = folder, h.step
            metric.dump(value)


class LiveCurves:
    """metrics/train/plots/metrics while the run goes: its (restored) history written whole at the start, then each
    step's row appended, so `dvc plots show` draws the run so far. `write_plots` replaces them at the end with the
    same rows: the finished curves are as deterministic as ever. The old run's curves are in git (cache: false)."""

    def __init__(self, metrics_dir: Path, history: Sequence[StepRecord]) -> None:
        self.folder = metrics_dir / "plots" / "metrics"
        with atomic_directory(self.folder) as tmp:
            append_curves(tmp, history)
        self.seen = sum(h.tokens for h in history)

    def step(self, record: StepRecord) -> None:
        append_curves(self.folder, [record], self.seen)
        self.seen += record.tokens


def write_plots(history: list[StepRecord], metrics_dir: Path) -> None:
    """Per-step curves in DVCLive's format and PNG images of the key ones, written at the end from the (resumable)
    history: they replace `plots/` whole, so a run killed here never leaves a half-written curve or image."""
    images = plot_images(history)  # before anything is written: a rendering error leaves the old plots
    with atomic_directory(metrics_dir / "plots") as plots:
        append_curves(plots / "metrics", history)
        (plots / "images").mkdir()
        for name, data in images.items():
            (plots / "images" / f"{name}.png").write_bytes(data)  # atomic_directory fsyncs and renames
