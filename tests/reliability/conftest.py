"""Fixtures of the reliability tests: a project whose fingerprint is already observed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashpipe.core.artifacts import canonical_json, write_bytes_atomic


@pytest.fixture(scope="session")
def fingerprint_bytes(tmp_path_factory) -> bytes:
    """This machine's fingerprint, observed once: what `stages/fingerprint.py` writes in a test project (observed
    for an empty directory: the fingerprint records the serving environment of its project, and a test project has
    none, while this repository may)."""
    from dflashpipe.core.env import observe

    return canonical_json(observe(project=tmp_path_factory.mktemp("no-serving-environment")).facts)


def project_fingerprint(project: Path, fingerprint_bytes: bytes) -> bytes:
    """What the fingerprint stage writes in `project`: the machine's facts, observed once, with the one group that
    is the project's own (its target's files)."""
    import json

    from dflashpipe.core.env import target_source_files

    facts = json.loads(fingerprint_bytes)
    facts["target_source"] = {"files": target_source_files(project)}
    return canonical_json(facts)


@pytest.fixture
def fingerprinted_project(dvc_project: Path, fingerprint_bytes: bytes) -> Path:
    """`dvc_project` with data/env/fingerprint.json in place, so `dvc repro -s STAGE` can run one stage."""
    write_bytes_atomic(dvc_project / "data/env/fingerprint.json", project_fingerprint(dvc_project, fingerprint_bytes))
    return dvc_project
