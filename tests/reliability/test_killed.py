"""Killed at any point: SIGKILL each stage (DVC and the stage process together) at points found by
watching the files it writes and the lines it prints. Afterwards DVC must not record the killed run,
no partial file may sit in an output path, and the next `dvc repro` must complete with the bytes of
an uninterrupted run (for train: resume from its checkpoint and end with the same weights)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from dflashpipe.core.artifacts import FILE_LISTING, PARTIAL
from dflashpipe.core.metrics import detail_of, metrics_bytes
from dflashpipe.core.params import load_params
from dflashpipe.core.pipeline import (
    COMPILE,
    DRAFTER,
    FEATURES,
    FINGERPRINT,
    MANIFEST,
    MANIFEST_METRICS,
    METRICS,
    TARGET,
    TOKENS,
    TRAIN_METRICS,
    TRAIN_METRICS_DIR,
    TRAIN_STATE,
    reuse_key,
)
from dflashpipe.data.manifest import build_manifest
from dflashpipe.data.shards import manifest_metrics, verify_manifest
from dflashpipe.target.materialise import materialise_target
from dflashpipe.train.checkpoint import CHECKPOINT, DECAY_START
from tests.conftest import copy_project, run, set_params
from tests.reliability.conftest import project_fingerprint
from tests.reliability.harness import (
    comparable_outputs,
    group_process,
    kill_at,
    lock_outs,
    md5,
    partials,
    status,
    tree_bytes,
)

MANIFEST_SAMPLES, GROWN_SAMPLES, SHARD_SIZE = 3000, 4000, 50
"""Big enough that writing the shards takes a while, so a kill lands among them."""


def outputs(project: Path, *paths: Path | str) -> dict[str, bytes]:
    return {
        f"{p}/{k}" if (project / p).is_dir() else str(p): v
        for p in paths
        if (project / p).exists()
        for k, v in tree_bytes(project / p).items()
    }


def assert_killed_cleanly(
    project: Path, stage: str, out: Path, recorded: dict | None, complete: list[dict[str, bytes]], point: str
) -> None:
    """What a kill at `point` may leave: DVC's old record, and the output absent or a complete one."""
    assert lock_outs(project, stage) == recorded, f"{point}: dvc.lock changed for a killed run"
    assert stage in status(project, stage), f"{point}: dvc status shows {stage} up to date after a kill"
    path = project / out
    if path.exists():
        assert not [p for p in path.rglob("*") if PARTIAL in p.name], f"{point}: a partial file inside {out}"
        now = {f"{out}/{k}": v for k, v in tree_bytes(path).items()}
        assert any(now == {k: v for k, v in c.items() if k.startswith(f"{out}/")} for c in complete), (
            f"{point}: {out} holds something other than a complete output"
        )


EVAL = METRICS / "eval"


def partials_of(project: Path, out: Path) -> list[Path]:
    """What an atomic write of the output `out` leaves while it is under way (or after a kill)."""
    return partials((project / out).parent, out.name)


def repro(project: Path, stage: str) -> None:
    run(["dvc", "repro", "-s", stage], project)
    assert stage not in status(project, stage)
    assert not partials(project / "data", Path(stage).name), "the next run left an earlier run's partial behind"


def manifest_reference(project: Path, tmp: Path) -> dict[str, bytes]:
    """What an uninterrupted run of the manifest stage writes, built in-process from the same params."""
    summary = build_manifest(load_params(project)["data"], tmp, root=project, key=reuse_key("manifest", project))
    return {
        **{f"{MANIFEST}/{k}": v for k, v in tree_bytes(tmp).items()},
        **{str(path): data for path, data in metrics_bytes(MANIFEST_METRICS, manifest_metrics(summary)).items()},
    }


def shards_in_partial(project: Path, at_least: int) -> Callable[[int], bool]:
    return lambda _: any(len(list(d.glob("train-*.parquet"))) >= at_least for d in partials_of(project, MANIFEST))


def manifest_in_place(project: Path, num_samples: int) -> Callable[[int], bool]:
    def reached(_: int) -> bool:
        try:
            return json.loads((project / MANIFEST / "summary.json").read_bytes())["num_samples"] == num_samples
        except (OSError, ValueError):
            return False

    return reached


def printed(log: Path, line: str) -> Callable[[int], bool]:
    """Reached once the stage has printed `line` (DVC passes the stage's output through to its log)."""
    return lambda _: log.is_file() and line in log.read_text(errors="replace")


def stage_imported_torch(script: str) -> Callable[[int], bool]:
    def reached(pgid: int) -> bool:
        pid = group_process(pgid, script)
        try:
            return pid is not None and "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    return reached


def written(path: Path) -> Callable[[int], bool]:
    return lambda _: path.exists()


def both(first: Callable[[int], bool], then: Callable[[int], bool]) -> Callable[[int], bool]:
    return lambda pgid: first(pgid) and then(pgid)


def test_manifest_killed_at_six_points_loses_nothing(fingerprinted_project, tmp_path):
    project, cmd = fingerprinted_project, ["dvc", "repro", "-s", "manifest"]
    set_params(project, data__num_samples=MANIFEST_SAMPLES, data__shard_size=SHARD_SIZE)
    first = manifest_reference(project, tmp_path / "ref-first")
    fresh_points = {
        "partial directory created": lambda _: bool(partials_of(project, MANIFEST)),
        "eval split written": lambda _: any((d / "eval.parquet").exists() for d in partials_of(project, MANIFEST)),
        "10 of 60 shards written": shards_in_partial(project, 10),
        "45 of 60 shards written": shards_in_partial(project, 45),
    }
    for point, reached in fresh_points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert_killed_cleanly(project, "manifest", MANIFEST, None, [first], point)
    repro(project, "manifest")
    assert outputs(project, MANIFEST, MANIFEST_METRICS, detail_of(MANIFEST_METRICS)) == first
    recorded = lock_outs(project, "manifest")

    set_params(project, data__num_samples=GROWN_SAMPLES)
    grown = manifest_reference(project, tmp_path / "ref-grown")
    kill_at(
        cmd, project, tmp_path / "log", "70 of 80 shards, the old manifest recorded", shards_in_partial(project, 70)
    )
    assert_killed_cleanly(project, "manifest", MANIFEST, recorded, [first, grown], "grown, mid-way")
    kill_at(
        cmd,
        project,
        tmp_path / "log",
        "renamed into place, not yet recorded",
        manifest_in_place(project, GROWN_SAMPLES),
    )
    if lock_outs(project, "manifest") == recorded:  # DVC had not yet written its record: it must not trust it
        assert_killed_cleanly(project, "manifest", MANIFEST, recorded, [grown], "renamed, unrecorded")
    repro(project, "manifest")
    assert outputs(project, MANIFEST, MANIFEST_METRICS, detail_of(MANIFEST_METRICS)) == grown
    verify_manifest(project / MANIFEST)


def test_target_killed_at_three_points_loses_nothing(fingerprinted_project, tmp_path):
    project, cmd = fingerprinted_project, ["dvc", "repro", "-s", "target"]
    # converted to another dtype, so the stage writes the weights (a float32 target is read in place: no weights)
    set_params(project, target__dtype="bfloat16")
    materialise_target(load_params(project)["target"], tmp_path / "ref", root=project)
    reference = {f"{TARGET}/{k}": v for k, v in tree_bytes(tmp_path / "ref").items()}
    points = {
        "partial directory created": lambda _: bool(partials_of(project, TARGET)),
        "model.safetensors written": lambda _: any(
            (d / "model.safetensors").exists() for d in partials_of(project, TARGET)
        ),
    }
    for point, reached in points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert_killed_cleanly(project, "target", TARGET, None, [reference], point)
    kill_at(
        cmd,
        project,
        tmp_path / "log",
        "renamed into place, not yet recorded",
        lambda _: (project / TARGET / "source.json").exists(),
    )
    if lock_outs(project, "target") is None:
        assert_killed_cleanly(project, "target", TARGET, None, [reference], "renamed, unrecorded")
    repro(project, "target")
    assert outputs(project, TARGET) == reference


def test_fingerprint_killed_at_three_points_loses_nothing(dvc_project, fingerprint_bytes, tmp_path):
    project, cmd = dvc_project, ["dvc", "repro", "fingerprint"]
    fingerprint_bytes = project_fingerprint(project, fingerprint_bytes)
    out = project / FINGERPRINT

    points = {
        "stage process started": lambda pgid: group_process(pgid, "stages/fingerprint.py") is not None,
        "torch imported, hashing its installed files": stage_imported_torch("stages/fingerprint.py"),
    }
    for point, reached in points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert lock_outs(project, "fingerprint") is None, point
        assert not out.exists() or out.read_bytes() == fingerprint_bytes, point
    run(cmd, project)
    assert out.read_bytes() == fingerprint_bytes
    inode = out.stat().st_ino
    kill_at(
        cmd,
        project,
        tmp_path / "log",
        "written, not yet recorded",
        lambda pgid: out.exists() and out.stat().st_ino != inode,
    )
    # Same machine, same bytes: whatever DVC recorded or left is the one complete fingerprint.
    assert lock_outs(project, "fingerprint") == {str(FINGERPRINT): md5(fingerprint_bytes)}
    assert not out.exists() or out.read_bytes() == fingerprint_bytes
    assert not partials(out.parent, out.name)
    run(cmd, project)
    assert out.read_bytes() == fingerprint_bytes


# -- the stages downstream of the data: each one killed while rerunning in a copy of a finished run --


def assert_rerun_killed_cleanly(
    project: Path, stage: str, recorded: dict, compared: tuple[Path, ...], reference: dict[str, bytes], point: str
) -> None:
    """What a kill of a stage that DVC had recorded may leave: that record, and in its output paths only
    complete files, each one as the uninterrupted run wrote it (measured times aside), but for train's live
    curves, which grow a row a step while it runs (`dvc plots show` mid-run): those hold the finished run's first
    rows. A `.partial-` sibling may remain until the next run removes it."""
    assert lock_outs(project, stage) == recorded, f"{point}: dvc.lock changed for a killed run"
    assert not [f for f in outputs(project, *compared) if PARTIAL in f], f"{point}: a partial file inside an output"
    now, finished = comparable_outputs(outputs(project, *compared)), comparable_outputs(reference)
    for key, value in now.items():
        live = f"{TRAIN_METRICS_DIR}/plots/metrics/" in str(key) and str(key).endswith(".tsv") and value is not None
        same = key in finished and (finished[key].startswith(value) if live else value == finished[key])
        assert same, f"{point}: {key} is not what the finished run wrote"
    if now != finished:
        assert stage in status(project, stage), f"{point}: dvc status shows {stage} up to date"


@pytest.fixture
def finished(pipeline_run, tmp_path) -> Path:
    return copy_project(pipeline_run, tmp_path / "project")


def kill_then_repro(
    project: Path,
    stage: str,
    points: dict[str, Callable[[int], bool]],
    log: Path,
    compared: tuple[Path, ...],
    prepare: Callable[[], None] = lambda: None,
) -> str:
    """Kill `dvc repro -s -f STAGE` at each point and check what is left; then run it to the end.

    `prepare` runs once, before the first kill. Returns the last run's output, having checked that it
    wrote what the finished run had written and that no killed run's partial is left anywhere."""
    recorded = lock_outs(project, stage)
    reference = outputs(project, *compared)
    prepare()
    for point, reached in points.items():
        kill_at(["dvc", "repro", "-s", "-f", stage], project, log, point, reached)
        assert_rerun_killed_cleanly(project, stage, recorded, compared, reference, point)
    completed = run(["dvc", "repro", "-s", stage], project).stdout
    assert stage not in status(project, stage)
    assert not [f for f in outputs(project, *recorded) if PARTIAL in f], "the completed run left a partial file"
    if f"Running stage '{stage}'" in completed:  # not restored from DVC's run cache: the stage cleaned up
        for out in recorded:
            assert not partials((project / out).parent, Path(out).name), f"the completed run left a killed one's {out}"
    assert comparable_outputs(outputs(project, *compared)) == comparable_outputs(reference)
    return completed


def test_tokenize_killed_at_four_points_reuses_the_shards_it_completed(finished, tmp_path):
    project, log = finished, tmp_path / "log"
    tokens = project / TOKENS
    shards = len(list(tokens.glob("*.arrow")))

    def shards_written(n: int) -> Callable[[int], bool]:
        return lambda _: len(list(tokens.glob("*.arrow"))) >= n

    completed = kill_then_repro(
        project,
        "tokenize",
        {
            "tokenizer loading": lambda pgid: group_process(pgid, "stages/tokens.py") is not None,
            "3 shards written": shards_written(3),
            f"{shards - 3} of {shards} shards written": shards_written(shards - 3),
            # files.json is the stage's last write (after summary.json): past it, only DVC's record is missing
            "listing written, not yet recorded": written(tokens / FILE_LISTING),
        },
        log,
        (TOKENS,),  # metrics/tokenize.json reports what this very run encoded and reused
        # from nothing: DVC keeps a persist output, so -f alone would reuse every shard
        prepare=lambda: shutil.rmtree(tokens),
    )
    # what the killed runs completed was checked (key and content sha256) and reused, not encoded again
    assert f"encoded 0 shard(s), reused {shards}" in completed, completed


def test_features_killed_at_four_points_reuses_the_shards_it_completed(finished, tmp_path):
    project, log = finished, tmp_path / "log"
    features = project / FEATURES
    if json.loads((features / "summary.json").read_text())["mode"] != "offline":
        set_params(project, features__mode="offline")
        run(["dvc", "repro", "-s", "features"], project)
    shards = len(list(features.glob("*.safetensors")))
    assert shards >= 6, "too few shards for a kill to land among them"

    def shards_written(n: int) -> Callable[[int], bool]:
        return lambda _: len(list(features.glob("*.safetensors"))) >= n

    completed = kill_then_repro(
        project,
        "features",
        {
            "target loading": stage_imported_torch("stages/features.py"),
            "2 shards written": shards_written(2),
            f"{shards - 2} of {shards} shards written": shards_written(shards - 2),
            "listing written, not yet recorded": written(features / FILE_LISTING),
        },
        log,
        (FEATURES,),  # metrics/features.json reports what this very run computed and reused
        prepare=lambda: shutil.rmtree(features),  # from nothing: -f alone would reuse every shard
    )
    assert f"computed 0 shard(s), reused {shards}" in completed, completed


def test_warmup_killed_while_compiling_leaves_no_artifact_and_no_cache_behind(finished, tmp_path):
    project, log = finished, tmp_path / "log"
    kill_then_repro(
        project,
        "warmup",
        {
            "target and drafter loading": stage_imported_torch("stages/warmup.py"),
            "inductor running the C++ compiler": lambda pgid: group_process(pgid, "g++") is not None,
        },
        log,
        (COMPILE,),
    )


def test_train_killed_at_two_points_resumes_to_the_same_weights(finished, tmp_path):
    project, log = finished, tmp_path / "log"
    checkpoint = project / TRAIN_STATE / CHECKPOINT

    def checkpointed(step: int) -> Callable[[int], bool]:
        def reached(_: int) -> bool:
            try:
                return json.loads((checkpoint / "state.json").read_text())["step"] >= step
            except (OSError, ValueError):  # the checkpoint directory is replaced whole
                return False

        return reached

    completed = kill_then_repro(
        project,
        "train",
        {
            "checkpoint of step 4 written": checkpointed(4),
            # DVC removes the finished run's outputs before the stage starts: a file seen after that is new
            "drafter in place, not yet recorded": both(
                printed(log, "train: step 6/6"), written(project / DRAFTER / "files.json")
            ),
        },
        log,
        (DRAFTER, TRAIN_METRICS, detail_of(TRAIN_METRICS), TRAIN_METRICS_DIR / "plots"),
        # the finished run's own checkpoints would let the rerun skip steps
        prepare=lambda: [shutil.rmtree(project / TRAIN_STATE / name) for name in (CHECKPOINT, DECAY_START)],
    )
    # from the furthest checkpoint the killed runs left: checkpoint/, or decay-start/ when the kill came between it
    # and the last step's checkpoint
    resumed = [f"train: resumed from {TRAIN_STATE / name} at step" for name in (CHECKPOINT, DECAY_START)]
    assert any(line in completed for line in resumed), completed


def test_evaluate_killed_at_three_points_loses_nothing(finished, tmp_path):
    project, log = finished, tmp_path / "log"
    # The regression report compares with HEAD, which the finished run did not have yet: the reference is
    # an uninterrupted rerun here.
    run(["dvc", "repro", "-s", "-f", "evaluate"], project)
    running = stage_imported_torch("stages/evaluate.py")  # by then DVC has removed the finished run's metrics
    kill_then_repro(
        project,
        "evaluate",
        {
            "target and drafter loading": running,
            "plot tables written, eval.json not yet": both(running, written(project / EVAL / "tau_per_source.json")),
            "eval.json written, not yet recorded": both(running, written(project / METRICS / "eval.json")),
        },
        log,
        (
            METRICS / "eval.json",
            METRICS / "detail" / "eval.json",  # written before eval.json: the lean file last
            METRICS / "eval_regression.json",
            detail_of(METRICS / "eval_regression.json"),
            *(EVAL / f"{table}.json" for table in ("tau_per_source", "slot_acceptance", "speedup_per_prompt")),
        ),
    )
