"""The metrics files DVC lists hold what a sweep compares, within a budget; each stage's record reads back whole, at
any revision, from before the split or after it (core/metrics.py)."""

import json
from pathlib import Path

from dflashpipe.core.metrics import (
    COMPARED,
    compared,
    detail_of,
    name_of,
    read_metrics,
    read_record,
    read_record_at,
    write_metrics,
)
from dflashpipe.core.pipeline import Pipeline
from dflashpipe.core.revision import Revisions, flatten
from dflashpipe.evaluate import regression
from tests.conftest import run

ROOT = Path(__file__).resolve().parents[1]

KEY_BUDGET = 60
"""Flattened keys of every file dvc.yaml lists as a metric, all together: the columns `dvc exp show` gives a sweep
(560 before the split)."""

SPREAD = {"low": 90.0, "high": 110.0, "repeats": 5, "machine": {"control_ms": {"before": 8.0, "after": 8.2}}}
TRAIN = {
    "final_loss": 6.5,
    "steps": 120,
    "tokens_per_s": 100.0,
    "tokens_per_s_spread": SPREAD,
    "heldout_acceptance": {"first": {"tau": 1.0}, "last": {"tau": 1.09}},
    "slot_accuracy": {"1": 0.06, "2": 0.05},
}


def commit_all(root: Path, message: str) -> None:
    run(["git", "add", "-A"], root)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", message], root)


def test_a_record_splits_into_the_compared_figures_headline_first_and_its_detail(tmp_path):
    metrics_file = tmp_path / "metrics" / "train" / "metrics.json"
    write_metrics(metrics_file, TRAIN)
    lean = json.loads(metrics_file.read_text())
    assert list(lean) == ["tokens_per_s", "final_loss", "steps", "heldout_tau"]
    assert lean == {"tokens_per_s": 100.0, "final_loss": 6.5, "steps": 120, "heldout_tau": 1.09}
    detail = json.loads((tmp_path / "metrics" / "detail" / "train.json").read_text())
    assert set(detail) == {"tokens_per_s_spread", "heldout_acceptance", "slot_accuracy"}
    assert read_record_at(metrics_file) == {**TRAIN, "heldout_tau": 1.09}
    assert detail_of("metrics/bench.json") == Path("metrics/detail/bench.json") and name_of(metrics_file) == "train"


def test_a_revision_from_before_the_split_is_read_whole_and_one_after_it_with_its_detail(tmp_path):
    bench = Path("metrics/bench.json")
    run(["git", "init", "-q"], tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / bench).write_text(json.dumps({"tokens_per_s": 80.0, "tokens_per_s_spread": SPREAD}))
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"tau": 2.0}))
    commit_all(tmp_path, "before the split: everything in the metrics file")
    write_metrics(tmp_path / bench, {"tokens_per_s": 100.0, "tokens_per_s_spread": SPREAD, "runs": "eager"})
    commit_all(tmp_path, "after it")
    with Revisions(tmp_path) as revisions:
        before, after = revisions.at("HEAD~1"), revisions.at("HEAD")
        assert read_record(before, bench) == {"tokens_per_s": 80.0, "tokens_per_s_spread": SPREAD}
        assert read_record(after, bench) == {"tokens_per_s": 100.0, "tokens_per_s_spread": SPREAD, "runs": "eager"}
        # explain, history and rerun compare the whole record, so a spread judges a move on either side
        assert read_metrics(after, bench.as_posix())["tokens_per_s_spread.low"] == 90.0
        assert read_record(after, "metrics/proof.json") is None
    # the regression check's baseline: the step's figure with its spread, from the detail file
    baseline, _, _ = regression.read_baseline("HEAD", tmp_path)
    assert baseline[regression.BENCH_METRICS]["tokens_per_s_spread"] == SPREAD


def test_every_metrics_file_dvc_lists_keeps_a_sweep_within_the_key_budget():
    """Counted on the project's own records as the stages wrote them: a compared file through COMPARED (with its
    detail, or one from before the split), evaluate's, serve's and the gate's as they are."""
    counted = {}
    for spec in Pipeline.read(ROOT).specs.values():
        for path in spec.metrics:
            name = name_of(path)
            if name in COMPARED:
                record = read_record_at(ROOT / path) or {}
                counted[path] = len(flatten(compared(path, record)))
                assert counted[path] == len(COMPARED[name]), f"{path}: a compared figure is not one number"
            else:
                counted[path] = len(flatten(json.loads((ROOT / path).read_text(encoding="utf-8"))))
    assert sum(counted.values()) <= KEY_BUDGET, counted
