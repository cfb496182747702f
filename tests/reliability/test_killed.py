"""Killed at any point: SIGKILL each stage (DVC and the stage process together) at points found by
watching the files it writes. Afterwards DVC must not record the killed run, no partial file may sit
in an output path, and the next `dvc repro` must complete with the bytes of an uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from dflashpipe.artifacts import PARTIAL, canonical_json
from dflashpipe.data.manifest import build_manifest, manifest_metrics, verify_manifest
from dflashpipe.params import load_params
from dflashpipe.target import materialise_target
from tests.conftest import run, set_params
from tests.reliability.harness import group_process, kill_at, lock_outs, md5, partials, status, tree_bytes

MANIFEST_SAMPLES, GROWN_SAMPLES, SHARD_SIZE = 3000, 4000, 50
"""Big enough that writing the shards takes a while, so a kill lands among them."""


def outputs(project: Path, *paths: str) -> dict[str, bytes]:
    return {f"{p}/{k}" if (project / p).is_dir() else p: v
            for p in paths if (project / p).exists() for k, v in tree_bytes(project / p).items()}


def assert_killed_cleanly(project: Path, stage: str, out: str, recorded: dict | None,
                          complete: list[dict[str, bytes]], point: str) -> None:
    """What a kill at `point` may leave: DVC's old record, and the output absent or a complete one."""
    assert lock_outs(project, stage) == recorded, f"{point}: dvc.lock changed for a killed run"
    assert stage in status(project, stage), f"{point}: dvc status shows {stage} up to date after a kill"
    path = project / out
    if path.exists():
        assert not [p for p in path.rglob("*") if PARTIAL in p.name], f"{point}: a partial file inside {out}"
        now = {f"{out}/{k}": v for k, v in tree_bytes(path).items()}
        assert any(now == {k: v for k, v in c.items() if k.startswith(f"{out}/")} for c in complete), (
            f"{point}: {out} holds something other than a complete output")


def repro(project: Path, stage: str) -> None:
    run(["dvc", "repro", "-s", stage], project)
    assert stage not in status(project, stage)
    assert not partials(project / "data", Path(stage).name), "the next run left an earlier run's partial behind"


def manifest_reference(project: Path, tmp: Path) -> dict[str, bytes]:
    """What an uninterrupted run of the manifest stage writes, built in-process from the same params."""
    summary = build_manifest(load_params(project)["data"], tmp, root=project)
    return {**{f"data/manifest/{k}": v for k, v in tree_bytes(tmp).items()},
            "metrics/manifest.json": canonical_json(manifest_metrics(summary))}


def shards_in_partial(project: Path, at_least: int) -> Callable[[int], bool]:
    return lambda _: any(len(list(d.glob("train-*.parquet"))) >= at_least for d in partials(project / "data", "manifest"))


def manifest_in_place(project: Path, num_samples: int) -> Callable[[int], bool]:
    def reached(_: int) -> bool:
        try:
            return json.loads((project / "data/manifest/summary.json").read_bytes())["num_samples"] == num_samples
        except (OSError, ValueError):
            return False
    return reached


def test_manifest_killed_at_six_points_loses_nothing(fingerprinted_project, tmp_path):
    project, cmd = fingerprinted_project, ["dvc", "repro", "-s", "manifest"]
    set_params(project, data__num_samples=MANIFEST_SAMPLES, data__shard_size=SHARD_SIZE)
    first = manifest_reference(project, tmp_path / "ref-first")
    fresh_points = {
        "partial directory created": lambda _: bool(partials(project / "data", "manifest")),
        "eval split written": lambda _: any((d / "eval.parquet").exists() for d in partials(project / "data", "manifest")),
        "10 of 60 shards written": shards_in_partial(project, 10),
        "45 of 60 shards written": shards_in_partial(project, 45),
    }
    for point, reached in fresh_points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert_killed_cleanly(project, "manifest", "data/manifest", None, [first], point)
    repro(project, "manifest")
    assert outputs(project, "data/manifest", "metrics/manifest.json") == first
    recorded = lock_outs(project, "manifest")

    set_params(project, data__num_samples=GROWN_SAMPLES)
    grown = manifest_reference(project, tmp_path / "ref-grown")
    kill_at(cmd, project, tmp_path / "log", "70 of 80 shards, the old manifest recorded", shards_in_partial(project, 70))
    assert_killed_cleanly(project, "manifest", "data/manifest", recorded, [first, grown], "grown, mid-way")
    kill_at(cmd, project, tmp_path / "log", "renamed into place, not yet recorded", manifest_in_place(project, GROWN_SAMPLES))
    if lock_outs(project, "manifest") == recorded:  # DVC had not yet written its record: it must not trust it
        assert_killed_cleanly(project, "manifest", "data/manifest", recorded, [grown], "renamed, unrecorded")
    repro(project, "manifest")
    assert outputs(project, "data/manifest", "metrics/manifest.json") == grown
    verify_manifest(project / "data/manifest")


def test_target_killed_at_three_points_loses_nothing(fingerprinted_project, tmp_path):
    project, cmd = fingerprinted_project, ["dvc", "repro", "-s", "target"]
    materialise_target(load_params(project)["target"], tmp_path / "ref", root=project)
    reference = {f"data/target/{k}": v for k, v in tree_bytes(tmp_path / "ref").items()}
    points = {
        "partial directory created": lambda _: bool(partials(project / "data", "target")),
        "model.safetensors written": lambda _: any((d / "model.safetensors").exists()
                                                   for d in partials(project / "data", "target")),
    }
    for point, reached in points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert_killed_cleanly(project, "target", "data/target", None, [reference], point)
    kill_at(cmd, project, tmp_path / "log", "renamed into place, not yet recorded",
            lambda _: (project / "data/target/source.json").exists())
    if lock_outs(project, "target") is None:
        assert_killed_cleanly(project, "target", "data/target", None, [reference], "renamed, unrecorded")
    repro(project, "target")
    assert outputs(project, "data/target") == reference


def test_fingerprint_killed_at_three_points_loses_nothing(dvc_project, fingerprint_bytes, tmp_path):
    project, cmd = dvc_project, ["dvc", "repro", "fingerprint"]
    out = project / "data/env/fingerprint.json"

    def torch_loaded(pgid: int) -> bool:
        pid = group_process(pgid, "stages/fingerprint.py")
        try:
            return pid is not None and "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    points = {"stage process started": lambda pgid: group_process(pgid, "stages/fingerprint.py") is not None,
              "torch imported, hashing its installed files": torch_loaded}
    for point, reached in points.items():
        kill_at(cmd, project, tmp_path / "log", point, reached)
        assert lock_outs(project, "fingerprint") is None, point
        assert not out.exists() or out.read_bytes() == fingerprint_bytes, point
    run(cmd, project)
    assert out.read_bytes() == fingerprint_bytes
    inode = out.stat().st_ino
    kill_at(cmd, project, tmp_path / "log", "written, not yet recorded",
            lambda pgid: out.exists() and out.stat().st_ino != inode)
    # Same machine, same bytes: whatever DVC recorded or left is the one complete fingerprint.
    assert lock_outs(project, "fingerprint") == {"data/env/fingerprint.json": md5(fingerprint_bytes)}
    assert not out.exists() or out.read_bytes() == fingerprint_bytes
    assert not partials(out.parent, out.name)
    run(cmd, project)
    assert out.read_bytes() == fingerprint_bytes
