"""Determinism: two full runs of the pipeline from clean clones of one commit write the same outputs.

Every declared output of every stage is classified here, and a new one must be: BYTES means
byte-identical, file for file; the others are identical except for what `comparable` sets aside
(values that measure time, and the bytes of compiled kernels, whose cache keys must still match)."""

from __future__ import annotations

import yaml

from tests.conftest import run
from tests.reliability.harness import comparable_outputs, lock_outs, tree_bytes

BYTES, TIMED, KERNELS = "byte-identical", "identical but for measured times", "same kernels, other bytes"
OUTPUTS = {
    "fingerprint": {"data/env/fingerprint.json": BYTES},  # on one machine: it observes the machine
    "target": {"data/target": BYTES},
    "manifest": {"data/manifest": BYTES, "metrics/manifest.json": BYTES},
    "tokenize": {"data/tokens": BYTES, "metrics/tokenize.json": TIMED},
    "warmup": {"data/compile": KERNELS},  # report.json: graphs, shapes, counters, environment; not seconds
    "train": {"data/drafter": BYTES, "data/train-state": KERNELS, "metrics/train/metrics.json": TIMED,
              "metrics/train/plots/metrics": TIMED},  # loss, lr and accuracy plots are byte-identical
    "evaluate": {"metrics/eval.json": TIMED, "metrics/eval_regression.json": TIMED, "metrics/eval/tau_per_source.json": BYTES,
                 "metrics/eval/slot_acceptance.json": BYTES, "metrics/eval/speedup_per_prompt.json": TIMED},
}


def declared_outputs(project, stage: str) -> list[str]:
    entry = yaml.safe_load((project / "dvc.yaml").read_text())["stages"][stage]
    return sorted(next(iter(o)) if isinstance(o, dict) else o for kind in ("outs", "metrics", "plots")
                  for o in entry.get(kind, []))


def test_two_clean_clones_write_the_same_outputs(pipeline_run, tmp_path):
    a, b = pipeline_run, tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    run(["git", "reset", "-q", "--hard", "HEAD~1"], b)  # the commit `a` ran from: no dvc.lock, no outputs
    run(["dvc", "repro"], b)

    assert set(OUTPUTS) == set(yaml.safe_load((a / "dvc.yaml").read_text())["stages"])
    for stage, outputs in OUTPUTS.items():
        assert declared_outputs(a, stage) == sorted(outputs), f"classify every output of {stage} in OUTPUTS"
        for path, kind in outputs.items():
            prefix = f"{path}/" if (a / path).is_dir() else ""
            files_a, files_b = ({prefix + k: v for k, v in tree_bytes(clone / path).items()} for clone in (a, b))
            assert files_a, f"{path} is empty"
            if kind == BYTES:
                assert files_a == files_b, f"{path} differs between two clean runs"
            else:
                assert comparable_outputs(files_a) == comparable_outputs(files_b), (
                    f"{path} differs between two clean runs beyond measured times and kernel bytes")
        if all(kind == BYTES for kind in outputs.values()):
            assert lock_outs(a, stage) == lock_outs(b, stage)
