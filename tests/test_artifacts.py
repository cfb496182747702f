"""Atomic writes, killed at their worst point: the temporary file is complete and not yet renamed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dflashpipe.core.artifacts import PARTIAL
from dflashpipe.core.incremental import InputShard, ShardedOutput

KILLED_BEFORE_RENAME = """
import os, signal, sys
from dflashpipe.core import artifacts
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
getattr(artifacts, sys.argv[1])(sys.argv[2], b"x" * 4096)
"""


def killed_writing(writer: str, path) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_BEFORE_RENAME), writer, str(path)])
    assert done.returncode == -9


@pytest.mark.parametrize("writer", ["write_bytes_atomic", "write_shard_atomic"])
def test_a_write_killed_before_its_rename_leaves_only_a_partial_sibling(writer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_bytes(b"old")
    killed_writing(writer, out / "shard-0")
    assert not (out / "shard-0").exists()
    if writer == "write_shard_atomic":  # a shard's directory is an output: nothing half-written inside it
        assert sorted(p.name for p in out.iterdir()) == ["kept"]
        assert [p.name for p in tmp_path.iterdir() if PARTIAL in p.name] != []
    else:  # a file output: its partial sibling sits beside it, where the next write removes it
        assert [p.name for p in out.iterdir() if p.name.startswith(f".shard-0{PARTIAL}")] != []


def test_opening_a_sharded_output_removes_a_killed_shard_write(tmp_path):
    out = tmp_path / "features"
    out.mkdir()
    killed_writing("write_shard_atomic", out / "train-00000")
    assert [p for p in tmp_path.iterdir() if PARTIAL in p.name]

    def unreadable(path):
        raise ValueError(path)

    ShardedOutput.open(out, {"train-00000": InputShard("t.arrow", "0" * 64)}, None, unreadable)
    assert not [p for p in tmp_path.rglob("*") if PARTIAL in p.name]
