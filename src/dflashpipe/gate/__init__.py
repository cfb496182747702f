"""The quality gate: does the drafter reach the bars params.yaml's `gate` sets, on the figures evaluate and serve
recorded?

Invariant: the gate reads only the headline keys of metrics/eval.json (`tau`, `floor_tau`) and metrics/serve.json
(`served`, `acceptance_per_position`), and each check ends as exactly one of PASSED, FAILED, NOT_RUN. The gate
passes only when every check that params turn on passed: NOT_RUN is no pass, so a gate whose served check could not
run (no serving environment) fails, saying so."""

from __future__ import annotations

from dataclasses import dataclass

from dflashpipe.core.errors import DflashpipeError, SourceError
from dflashpipe.core.params import GateParams

PASSED, FAILED, NOT_RUN = "passed", "failed", "not_run"


class GateFailedError(DflashpipeError):
    """gate.fail is true and a check did not pass (metrics/gate.json is written first)."""


@dataclass(frozen=True)
class Check:
    """One check's figure against its bar, and the verdict."""

    name: str
    figure: float | list[float] | None
    bar: float | list[float]
    verdict: str
    why: str

    def line(self) -> str:
        return f"gate: {self.name} {self.verdict}: {self.why}"

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "figure": self.figure, "bar": self.bar}


def _number(metrics: dict, key: str, file: str, fix: str) -> float:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{file}: `{key}` is {value!r}, not a number: {fix}")
    return float(value)


def floor_check(evaluation: dict, file: str = "metrics/eval.json") -> Check:
    """Held-out tau above the bigram floor's on the same prompts: a drafter below it learned less than a table of
    the training tokens' pairs, whatever its absolute figure."""
    fix = "rerun `dvc repro evaluate` (it records `tau` and `floor_tau`)"
    tau, floor = _number(evaluation, "tau", file, fix), _number(evaluation, "floor_tau", file, fix)
    above = tau > floor
    why = f"held-out tau {tau:.4f} {'>' if above else '<='} {floor:.4f}, the bigram floor's"
    return Check("floor", tau, floor, PASSED if above else FAILED, why)


def served_check(serve: dict, bars: tuple[float, ...], file: str = "metrics/serve.json") -> Check:
    """The engine's acceptance at positions 1..len(bars) at least each bar. Not run when the served check was not."""
    served = serve.get("served")
    if served not in (PASSED, FAILED, NOT_RUN):
        raise SourceError(f"{file}: `served` is {served!r}, not passed, failed or not_run: rerun `dvc repro serve`")
    if served == NOT_RUN:
        why = "the served check did not run (no serving environment: `bin/setup --serve`); not_run is no pass"
        return Check("served_acceptance", None, list(bars), NOT_RUN, why)
    per_position = serve.get("acceptance_per_position")
    if not isinstance(per_position, dict):
        raise SourceError(f"{file}: no `acceptance_per_position`: rerun `dvc repro serve`")
    missing = [str(k) for k in range(1, len(bars) + 1) if str(k) not in per_position]
    if missing:
        raise SourceError(
            f"{file}: no acceptance at position {missing[0]} (the engine proposed {len(per_position)} tokens a step) "
            f"but gate.served_acceptance sets {len(bars)} bars: give at most {len(per_position)} bars, or raise "
            f"evaluate.draft_tokens"
        )
    figures = [_number(per_position, str(k), file, "rerun `dvc repro serve`") for k in range(1, len(bars) + 1)]
    short = [k for k, (got, bar) in enumerate(zip(figures, bars, strict=True), 1) if got < bar]
    shown = ", ".join(f"{got:.4f}/{bar:g}" for got, bar in zip(figures, bars, strict=True))
    if served == FAILED:  # the engine drafted otherwise than we do: its acceptance is not this drafter's
        return Check("served_acceptance", figures, list(bars), FAILED, f"the served check failed; per position {shown}")
    why = f"per position (served/bar) {shown}" + (f"; below the bar at position {short[0]}" if short else "")
    return Check("served_acceptance", figures, list(bars), FAILED if short else PASSED, why)


def quality_gate(params: GateParams, evaluation: dict, serve: dict | None) -> tuple[dict, list[Check]]:
    """metrics/gate.json (`gate` first, then each check that params turn on) and the checks. `serve` is read only
    when the served check is on."""
    checks = []
    if params.floor:
        checks.append(floor_check(evaluation))
    if params.served_acceptance:
        if serve is None:
            raise SourceError("metrics/serve.json: not found, and gate.served_acceptance is on: run `dvc repro serve`")
        checks.append(served_check(serve, params.served_acceptance))
    verdict = PASSED if all(c.verdict == PASSED for c in checks) else FAILED
    return {"gate": verdict, **{c.name: c.to_json() for c in checks}}, checks


def enforce(metrics: dict, checks: list[Check], fail: bool) -> None:
    """With gate.fail: a gate that did not pass fails the stage, naming the checks that did not pass."""
    if fail and metrics["gate"] != PASSED:
        short = "; ".join(c.line() for c in checks if c.verdict != PASSED)
        raise GateFailedError(f"the quality gate failed (gate.fail is true; metrics/gate.json is written): {short}")
