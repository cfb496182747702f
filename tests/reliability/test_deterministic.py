"""Determinism: two full runs of the pipeline from clean clones of one commit write the same outputs.

Every declared output of every stage is classified here, and a new one must be: BYTES means
byte-identical, file for file; the others are identical except for what `comparable` sets aside
(values that measure time, and the bytes of compiled kernels, whose cache keys must still match)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dflashpipe.core.metrics import detail_of
from dflashpipe.core.pipeline import (
    COMPILE,
    DRAFTER,
    EVAL_DETAIL,
    EVAL_PROMPTS,
    FEATURES,
    FEATURES_METRICS,
    FINGERPRINT,
    GATE_METRICS,
    MANIFEST,
    MANIFEST_METRICS,
    METRICS,
    REGENERATE_METRICS,
    REGENERATED,
    SERVE_DETAIL,
    SERVE_METRICS,
    TARGET,
    TOKENIZE_METRICS,
    TOKENS,
    TRAIN_METRICS,
    TRAIN_METRICS_DIR,
    TRAIN_STATE,
)
from tests.conftest import run
from tests.reliability.harness import comparable_outputs, lock_outs, tree_bytes

BYTES, TIMED, KERNELS = "byte-identical", "identical but for measured times", "same kernels, other bytes"
PLACE = "the same weight files (names, sizes), at this clone's place and times"
FACTS = "the same machine facts, and target files of the same names and sizes (each clone's own times)"


def without_times(fingerprint: dict) -> dict:
    files = fingerprint["target_source"]["files"]
    return {**fingerprint, "target_source": {"files": {name: stat[0] for name, stat in files.items()}}}


TARGET_WEIGHTS = Path("data/target-weights.json")
EVAL = METRICS / "eval"
OUTPUTS = {
    "fingerprint": {FINGERPRINT: FACTS},  # on one machine: it observes the machine, and each clone's target files
    "target": {TARGET: BYTES, TARGET_WEIGHTS: PLACE},  # the tiny target is read in place: each clone's own files
    "manifest": {MANIFEST: BYTES, MANIFEST_METRICS: BYTES, detail_of(MANIFEST_METRICS): BYTES},
    "regenerate": {REGENERATED: BYTES, REGENERATE_METRICS: TIMED, detail_of(REGENERATE_METRICS): TIMED},
    "tokenize": {TOKENS: BYTES, TOKENIZE_METRICS: TIMED, detail_of(TOKENIZE_METRICS): TIMED},
    "features": {FEATURES: BYTES, FEATURES_METRICS: TIMED, detail_of(FEATURES_METRICS): TIMED},
    "warmup": {COMPILE: KERNELS},  # report.json: graphs, shapes, counters, environment; not seconds
    "train": {
        DRAFTER: BYTES,
        TRAIN_STATE: KERNELS,
        TRAIN_METRICS: TIMED,
        detail_of(TRAIN_METRICS): TIMED,
        TRAIN_METRICS_DIR / "plots" / "metrics": TIMED,
        TRAIN_METRICS_DIR / "plots" / "images": TIMED,
    },  # loss, lr and accuracy plots (tables and images) are byte-identical
    "bench": {METRICS / "bench.json": TIMED, detail_of(METRICS / "bench.json"): TIMED},
    # its tau is exact; its seconds are timings
    "proof": {METRICS / "proof.json": TIMED, detail_of(METRICS / "proof.json"): TIMED},
    "evaluate": {
        METRICS / "eval.json": TIMED,
        EVAL_DETAIL: TIMED,
        EVAL_PROMPTS: BYTES,  # the exact token ids decoded: a second turn's holds the target's greedy reply
        METRICS / "eval_regression.json": TIMED,
        detail_of(METRICS / "eval_regression.json"): TIMED,
        EVAL / "tau_per_source.json": BYTES,
        EVAL / "tau_per_benchmark.json": BYTES,
        EVAL / "tau_per_benchmark.png": BYTES,
        EVAL / "slot_acceptance.json": BYTES,
        EVAL / "tau_per_source.png": BYTES,
        EVAL / "slot_acceptance.png": BYTES,
        EVAL / "speedup_per_prompt.json": TIMED,
    },
    # not run in a clone without a serving environment; served, vLLM's times
    "serve": {SERVE_METRICS: TIMED, SERVE_DETAIL: TIMED},
    "gate": {GATE_METRICS: BYTES},  # verdicts on tau and acceptance, which are exact
}


def declared_outputs(project, stage: str) -> list[str]:
    entry = yaml.safe_load((project / "dvc.yaml").read_text())["stages"][stage]
    return sorted(
        next(iter(o)) if isinstance(o, dict) else o
        for kind in ("outs", "metrics", "plots")
        for o in entry.get(kind, [])
    )


def test_two_clean_clones_write_the_same_outputs(pipeline_run, tmp_path):
    a, b = pipeline_run, tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    run(["git", "reset", "-q", "--hard", "HEAD~1"], b)  # the commit `a` ran from: no dvc.lock, no outputs
    run(["dvc", "repro"], b)

    assert set(OUTPUTS) == set(yaml.safe_load((a / "dvc.yaml").read_text())["stages"])
    for stage, outputs in OUTPUTS.items():
        assert declared_outputs(a, stage) == sorted(map(str, outputs)), f"classify every output of {stage} in OUTPUTS"
        for path, kind in outputs.items():
            prefix = f"{path}/" if (a / path).is_dir() else ""
            files_a, files_b = ({prefix + k: v for k, v in tree_bytes(clone / path).items()} for clone in (a, b))
            assert files_a, f"{path} is empty"
            if kind == BYTES:
                assert files_a == files_b, f"{path} differs between two clean runs"
            elif kind == FACTS:
                facts_a, facts_b = (without_times(json.loads((clone / path).read_text())) for clone in (a, b))
                assert facts_a == facts_b, f"{path} differs between two clean runs beyond the target files' times"
            elif kind == PLACE:
                sizes_a, sizes_b = (
                    {name: f["size"] for name, f in json.loads((clone / path).read_text())["files"].items()}
                    for clone in (a, b)
                )
                assert sizes_a == sizes_b and sizes_a, f"{path}: other weight files in two clean runs"
            else:
                assert comparable_outputs(files_a) == comparable_outputs(files_b), (
                    f"{path} differs between two clean runs beyond measured times and kernel bytes"
                )
        if all(kind == BYTES for kind in outputs.values()):
            assert lock_outs(a, stage) == lock_outs(b, stage)
