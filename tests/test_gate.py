"""The quality gate (dflashpipe.gate, stage `gate`): each check's verdict from the headline keys of metrics/eval.json
and metrics/serve.json alone, a served check that did not run is no pass, and gate.fail fails the stage only after
metrics/gate.json is written. The stage runs for real on metric files written here: no DVC, no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.core.params import GateParams
from dflashpipe.gate import FAILED, NOT_RUN, PASSED, GateFailedError, enforce, quality_gate
from tests.conftest import copy_from_root, run, set_params

BARS = (0.30, 0.05, 0.001)  # speculators' nightly gate
ABOVE = {"tau": 1.2, "floor_tau": 1.1444}
BELOW = {"tau": 1.1323, "floor_tau": 1.1444}  # the embedded default's own figures: it misses its floor


def served(state: str = PASSED, *acceptance: float) -> dict:
    return {"served": state, "acceptance_per_position": {str(k): a for k, a in enumerate(acceptance, 1)}}


def gate(floor: bool = True, bars: tuple[float, ...] = (), fail: bool = False) -> GateParams:
    return GateParams(floor=floor, served_acceptance=bars, fail=fail)


def test_the_floor_check_passes_only_above_the_floor():
    assert quality_gate(gate(), ABOVE, None)[0] == {
        "gate": PASSED,
        "floor": {"verdict": PASSED, "figure": 1.2, "bar": 1.1444},
    }
    assert quality_gate(gate(), BELOW, None)[0]["gate"] == FAILED
    assert quality_gate(gate(), {"tau": 1.1444, "floor_tau": 1.1444}, None)[0]["gate"] == FAILED  # above, not equal


def test_the_served_check_holds_every_position_to_its_bar():
    metrics, _ = quality_gate(gate(False, BARS), ABOVE, served(PASSED, 0.31, 0.06, 0.001, 0.0))
    assert metrics == {
        "gate": PASSED,
        "served_acceptance": {"verdict": PASSED, "figure": [0.31, 0.06, 0.001], "bar": list(BARS)},
    }
    metrics, checks = quality_gate(gate(False, BARS), ABOVE, served(PASSED, 0.31, 0.04, 0.5))
    assert metrics["gate"] == FAILED and "below the bar at position 2" in checks[0].line()
    # a served check that failed (the engine drafted otherwise than we do) fails this one, whatever its figures
    assert quality_gate(gate(False, BARS), ABOVE, served(FAILED, 0.9, 0.9, 0.9))[0]["gate"] == FAILED


def test_a_served_check_that_did_not_run_is_no_pass():
    metrics, checks = quality_gate(gate(True, BARS), ABOVE, {"served": NOT_RUN})
    assert metrics["floor"]["verdict"] == PASSED
    assert metrics["served_acceptance"] == {"verdict": NOT_RUN, "figure": None, "bar": list(BARS)}
    assert metrics["gate"] == FAILED
    assert "not_run is no pass" in checks[1].line()


def test_unreadable_figures_name_the_file_key_and_fix():
    with pytest.raises(SourceError, match=r"metrics/eval.json: `floor_tau` is None.*dvc repro evaluate"):
        quality_gate(gate(), {"tau": 1.2}, None)
    with pytest.raises(SourceError, match=r"no acceptance at position 3 .* give at most 2 bars"):
        quality_gate(gate(False, BARS), ABOVE, served(PASSED, 0.4, 0.1))
    with pytest.raises(SourceError, match=r"`served` is 'maybe'"):
        quality_gate(gate(False, BARS), ABOVE, {"served": "maybe"})


def test_params_refuse_a_gate_that_checks_nothing_and_a_bar_out_of_range():
    with pytest.raises(ParamsError, match=r"gate.floor is false and gate.served_acceptance is \[\]"):
        gate(False, ())
    with pytest.raises(ParamsError, match=r"gate.served_acceptance\[1\] = 5.0: the bar at position 2"):
        gate(False, (0.3, 5.0))


def test_gate_fail_raises_only_when_asked():
    metrics, checks = quality_gate(gate(), BELOW, None)
    enforce(metrics, checks, fail=False)
    with pytest.raises(GateFailedError, match=r"gate: floor failed: held-out tau 1.1323 <= 1.1444"):
        enforce(metrics, checks, fail=True)


@pytest.fixture
def project(tmp_path) -> Path:
    return copy_from_root(tmp_path / "project", ["dvc.yaml", "params.yaml", "stages/gate.py", "src/dflashpipe"])


def run_gate(project: Path, evaluation: dict, serve: dict, **params):
    set_params(project, **{f"gate__{key}": value for key, value in params.items()})
    (project / "metrics").mkdir(exist_ok=True)
    (project / "metrics/eval.json").write_text(json.dumps(evaluation))
    (project / "metrics/serve.json").write_text(json.dumps(serve))
    (project / "metrics/gate.json").unlink(missing_ok=True)
    done = run([sys.executable, "stages/gate.py"], project, check=False)
    return done, json.loads((project / "metrics/gate.json").read_text())


def test_the_stage_records_pass_fail_and_not_run(project):
    bars = list(BARS)
    done, metrics = run_gate(project, ABOVE, served(PASSED, 0.4, 0.1, 0.01), served_acceptance=bars)
    assert done.returncode == 0 and metrics["gate"] == PASSED and next(iter(metrics)) == "gate", done.stderr
    assert done.stdout.splitlines() == [
        "gate: floor passed: held-out tau 1.2000 > 1.1444, the bigram floor's",
        "gate: served_acceptance passed: per position (served/bar) 0.4000/0.3, 0.1000/0.05, 0.0100/0.001",
        "gate: passed",
    ]

    done, metrics = run_gate(project, BELOW, served(NOT_RUN), served_acceptance=bars)
    assert done.returncode == 0 and metrics["gate"] == FAILED  # gate.fail false: recorded, the pipeline goes on
    assert metrics["floor"]["verdict"] == FAILED and metrics["served_acceptance"]["verdict"] == NOT_RUN

    done, metrics = run_gate(project, ABOVE, served(NOT_RUN), served_acceptance=bars, fail=True)
    assert done.returncode == 2 and metrics["gate"] == FAILED, done.stdout  # written before the stage fails
    assert "dflashpipe gate: error: the quality gate failed" in done.stderr and "not_run is no pass" in done.stderr


def test_every_profile_states_a_valid_gate():
    root = Path(__file__).resolve().parents[1]
    for path in [root / "params.yaml", *sorted((root / "profiles").glob("*.yaml"))]:
        section = yaml.safe_load(path.read_text()).get("gate")
        if section is not None:
            GateParams(**{**yaml.safe_load((root / "params.yaml").read_text())["gate"], **section})
