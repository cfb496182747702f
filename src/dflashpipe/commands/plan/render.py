"""A plan as text (what `dflashpipe plan` prints) and as JSON (what `--json` prints and `--out` records)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from dflashpipe.commands.plan.cost import RESERVE

if TYPE_CHECKING:
    from dflashpipe.commands.plan import Plan


def _si(n: float, unit: str = "") -> str:
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.3g}{prefix}{unit}"
    return f"{n:.3g}{unit}"


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _duration(seconds: float) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def plan_lines(p: Plan) -> list[str]:
    """The plan as `dflashpipe plan` prints it, in the order it is made: inputs, cost, the check."""
    return [
        f"plan: {p.run.label}",
        f"  target config: {p.target_config.source}",
        *_device_lines(p),
        *_calibration_lines(p),
        *_memory_lines(p),
        *_throughput_lines(p),
        *_feature_lines(p),
        *_wall_lines(p),
        *_check_lines(p),
    ]


def _device_lines(p: Plan) -> list[str]:
    lines = ["devices"]
    for role in ("target", "drafter"):
        d = getattr(p.devices, role)
        link = f", link {_si(d.link_bytes_per_s, 'B/s')} one way" if d.link_bytes_per_s else ""
        lines.append(
            f"  {role:8} {d.name}: bf16 {_si(d.bf16_flops, 'FLOP/s')}, fp32 {_si(d.fp32_flops, 'FLOP/s')}, "
            f"{gib(d.memory_bytes)}{link}  [{d.source}]"
        )
    return lines


def _calibration_lines(p: Plan) -> list[str]:
    cal = p.calibration
    lines = [
        "calibration",
        f"  target MFU {cal.target.value:.3g}  [{cal.target.source}]",
        f"  drafter MFU {cal.drafter.value:.3g}  [{cal.drafter.source}]",
    ]
    if p.run.features.mode == "offline":
        lines.append(f"  stored features read at {_si(cal.read.value, 'B/s')}  [{cal.read.source}]")
    return lines + [f"  note: {n}" for n in cal.notes]


def _memory_lines(p: Plan) -> list[str]:
    lines = [f"memory per device (estimates; {RESERVE:.0%} of each device kept in reserve)"]
    alike: dict[tuple, list[str]] = {}  # devices holding the same workers and terms: one line
    for d in p.memory:
        alike.setdefault((d.roles, d.terms, d.usable), []).append(d.device)
    for (roles, terms, usable), names in alike.items():
        total = sum(t.bytes for t in terms)
        listed = ", ".join(f"{t.name} {gib(t.bytes)}" for t in sorted(terms, key=lambda t: -t.bytes) if t.bytes)
        lines.append(f"  {', '.join(names)} ({'+'.join(roles)}): {gib(total)} of {gib(usable)} each: {listed}")
    lines.append(
        f"  largest that fits: model.seq_len {p.fit.seq_len} at compile.micro_batch {p.run.compile.micro_batch}; "
        f"compile.micro_batch {p.fit.micro_batch} at model.seq_len {p.run.model.seq_len}"
    )
    return lines


def _throughput_lines(p: Plan) -> list[str]:
    run, sh, s = p.run, p.shapes, p.run.model.seq_len
    lines = [f"throughput (rows of {s} tokens; {_si(sh.target_flops)} FLOP target, {_si(sh.drafter_flops)} drafter)"]
    for side in (p.target, p.drafter):
        lines.append(
            f"  {side.name:8} side {side.rows_per_s:,.3g} rows/s = {_si(side.rows_per_s * s)} tokens/s ({side.how})"
        )
    other = p.drafter if p.bound_by == "target" else p.target
    lines.append(
        f"  bound by the {p.bound_by} side: {p.rows_per_s:,.3g} rows/s, {_si(p.tokens_per_s)} tokens/s; the "
        f"{other.name} side waits {1 - p.rows_per_s / other.rows_per_s:.0%} of the time"
    )
    if p.splits:
        configured = len(run.topology.target_devices)
        table = ", ".join(
            f"{x.targets}+{x.drafters} {x.rows_per_s:,.3g}" + (" (configured)" if x.targets == configured else "")
            for x in p.splits
        )
        best = p.balanced
        lines.append(f"  rows/s by split (target + drafter devices): {table}")
        lines.append(
            f"  balanced: {best.targets}+{best.drafters}, {_si(best.rows_per_s * s)} tokens/s "
            f"({best.rows_per_s / p.rows_per_s:.2g}x the configured {configured}+{len(run.topology.drafter_devices)})"
        )
    return lines


def _feature_lines(p: Plan) -> list[str]:
    t, lines = p.transfer, []
    if p.run.features.mode == "online" and t.link_bytes_per_s:
        lines.append(
            f"features between devices: {_si(t.bytes_per_token, 'B')} a token x {_si(p.tokens_per_s)} tokens/s = "
            f"{_si(t.bytes_per_s, 'B/s')}; the busiest device {_si(t.per_device_bytes_per_s, 'B/s')} of its "
            f"{_si(t.link_bytes_per_s, 'B/s')} link ({t.per_device_bytes_per_s / t.link_bytes_per_s:.1%})"
        )
    elif p.run.features.mode == "online":
        lines.append(f"features between workers: {_si(t.bytes_per_token, 'B')} a token, in one memory (no link)")
    lines.append(
        f"offline features would take {_si(t.offline_bytes, 'B')} on disk ({p.data.samples:,} samples x "
        f"{min(p.data.tokens_per_sample, p.run.model.seq_len):,.0f} tokens x {_si(t.bytes_per_token, 'B')}; mean "
        f"length [{p.data.source}]), read at {_si(t.bytes_per_s, 'B/s')}"
    )
    return lines


def _wall_lines(p: Plan) -> list[str]:
    w, train = p.wall, p.run.train
    epoch = f"one epoch {w.epoch_rows:,.0f} rows, {_duration(w.epoch_rows / p.rows_per_s)}"
    if train.epochs:
        return [
            f"wall: train.epochs {train.epochs} = ~{w.steps:,} steps of {w.rows // w.steps} rows in "
            f"{_duration(w.seconds)} ({epoch}; train derives the steps from the tokenized data)"
        ]
    return [
        f"wall: train.max_steps {w.steps} = {w.rows:,} rows in {_duration(w.seconds)} ({w.epochs:.3g} epochs; {epoch})"
    ]


def _check_lines(p: Plan) -> list[str]:
    if not p.check:
        return []
    c = p.check
    lines = [f"against the measured train ({c['run']})"]
    for key in ("tokens_per_s", "flops_per_s"):
        x = c[key]
        verdict = "within" if x["within"] else "OUTSIDE"
        lines.append(
            f"  {key}: predicted {_si(x['predicted'])}, measured {_si(x['measured'])} "
            f"(steps {_si(x['low'])}..{_si(x['high'])}): {verdict} its spread"
        )
    lines.append(
        f"  flops_per_step: predicted {c['flops_per_step']['predicted']:,}, measured "
        f"{c['flops_per_step']['measured']:,}; bound by: predicted {c['bound_by']['predicted']}, "
        f"measured {c['bound_by']['measured']}"
    )
    return lines


def plan_json(p: Plan) -> str:
    run = p.run
    data = {
        "run": run.label,
        "overrides": run.overrides,
        "target_config": p.target_config.source,
        "devices": {role: dataclasses.asdict(getattr(p.devices, role)) for role in ("target", "drafter")},
        "calibration": dataclasses.asdict(p.calibration),
        "shapes": dataclasses.asdict(p.shapes),
        "data": dataclasses.asdict(p.data),
        "memory": {
            "reserve": f"{RESERVE:.0%}",
            "devices": [
                {
                    "device": d.device,
                    "kind": d.kind.name,
                    "roles": list(d.roles),
                    "bytes": d.total,
                    "usable": d.usable,
                    "terms": {t.name: t.bytes for t in d.terms},
                }
                for d in p.memory
            ],
            "largest_fit": dataclasses.asdict(p.fit),
        },
        "throughput": {
            "seq_len": run.model.seq_len,
            "target": dataclasses.asdict(p.target),
            "drafter": dataclasses.asdict(p.drafter),
            "bound_by": p.bound_by,
            "rows_per_s": p.rows_per_s,
            "tokens_per_s": p.tokens_per_s,
            "flops_per_step": p.flops_per_step,
            "splits": [dataclasses.asdict(x) for x in p.splits],
            "balanced": dataclasses.asdict(p.balanced) if p.balanced else None,
        },
        "transfer": dataclasses.asdict(p.transfer),
        "wall": {**dataclasses.asdict(p.wall), "epochs": p.wall.epochs},
        "check": p.check,
    }
    return json.dumps(data, indent=2, default=str)
