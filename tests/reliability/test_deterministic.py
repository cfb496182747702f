"""Determinism: two full runs from clean clones of the embedded tiny profile write the same bytes.
The list below is every output of the stages that exist; a new output must be classified here."""

from __future__ import annotations

import yaml

from tests.conftest import run
from tests.reliability.harness import lock_outs, start, tree_bytes

DETERMINISTIC = {
    "fingerprint": ["data/env/fingerprint.json"],  # on one machine: it observes the machine
    "target": ["data/target"],
    "manifest": ["data/manifest", "metrics/manifest.json"],
}
"""Byte-identical across runs. No output of these stages is exempt."""


def declared_outputs(project, stage: str) -> list[str]:
    entry = yaml.safe_load((project / "dvc.yaml").read_text())["stages"][stage]
    return sorted(next(iter(o)) if isinstance(o, dict) else o for kind in ("outs", "metrics", "plots")
                  for o in entry.get(kind, []))


def test_two_clean_clones_write_byte_identical_outputs(dvc_project, tmp_path):
    clones = [tmp_path / "a", tmp_path / "b"]
    for clone in clones:
        run(["git", "clone", "-q", str(dvc_project), str(clone)], tmp_path)
    runs = [start(["dvc", "repro", *DETERMINISTIC], clone, tmp_path / f"{clone.name}.log") for clone in clones]
    for proc, clone in zip(runs, clones):
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{clone.name}.log").read_text()

    a, b = clones
    for stage, paths in DETERMINISTIC.items():
        assert declared_outputs(a, stage) == sorted(paths), f"classify every output of {stage} in DETERMINISTIC"
        for path in paths:
            files = tree_bytes(a / path)
            assert files, f"{path} is empty"
            assert files == tree_bytes(b / path), f"{path} differs between two clean runs"
        assert lock_outs(a, stage) == lock_outs(b, stage)
