"""The pristine environment, built from the real lock out of the real uv cache: in seconds, its packages its own, and
an edit by replacement in one environment reaching neither the cache nor the next build. A cache holding an edited
copy is shown on a cache of this test's own (an in-place edit of a hardlinked file edits the cache itself)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflashpipe.commands.rerun.pristine import LOCKS, build
from dflashpipe.core.env import distribution_integrity
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.revision import git
from tests.tiny import ROOT

EDITED = "torch/utils/show_pickle.py"
"""A torch file `import torch` does not read: the shared environment's other tests import torch from it."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build(ROOT, None, tmp_path_factory.mktemp("pristine") / "env", ROOT)


def site_packages(python: Path) -> Path:
    return next(python.parent.parent.glob("lib/python*/site-packages"))


def replace(path: Path, data: bytes) -> None:
    """Edit a file as one inside a hardlinked environment must be: a new file renamed over it."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.replace(new, path)


def commit(repo: Path, files: dict[str, str]) -> None:
    if not (repo / ".git").exists():
        repo.mkdir(exist_ok=True)
        git(repo, "init", "-q")
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text, encoding="utf-8")
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "locks")


def test_the_real_lock_builds_in_seconds(pristine):
    print(f"pristine environment built in {pristine.seconds:.1f} s")
    assert pristine.seconds < 60  # hardlinks: ~1 s here; a copy of torch would take minutes
    assert pristine.locks == list(LOCKS) and pristine.python.is_file()


def test_its_packages_are_its_own_and_dflashpipe_is_the_arms_tree(pristine):
    code = "import dflashpipe, torch, dvc; print(dflashpipe.__file__); print(torch.__file__)"
    out = subprocess.run([pristine.python, "-c", code], env=pristine.environ(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ours, theirs = map(Path, out.stdout.split())
    assert ours == ROOT / "src" / "dflashpipe" / "__init__.py"  # through the .pth: environ() drops PYTHONPATH
    assert theirs.is_relative_to(pristine.python.parent.parent)
    assert not theirs.samefile(metadata.distribution("torch").locate_file("torch/__init__.py"))  # not .venv's


def test_an_edit_by_replacement_reaches_neither_the_cache_nor_the_next_build(pristine, tmp_path):
    """The first environment stands in for an edited .venv: the next build has the file as its wheel has it, and
    its check against RECORD passes."""
    edited = site_packages(pristine.python) / EDITED
    original = edited.read_bytes()
    replace(edited, original + b"\n# edited\n")
    torch_there = next(metadata.distributions(name="torch", path=[str(edited.parents[2])]))
    assert list(distribution_integrity(torch_there, only={EDITED}).edited) == [EDITED]

    again = build(ROOT, None, tmp_path / "again", ROOT, check={"torch": [EDITED]})
    assert (site_packages(again.python) / EDITED).read_bytes() == original


def test_a_package_missing_from_the_cache_or_a_lock_missing_at_the_revision_is_one_line(tmp_path):
    repo = tmp_path / "repo"
    cpu = (ROOT / LOCKS[0]).read_text(encoding="utf-8")
    assert "\naccelerate==1.16.0 " in cpu
    commit(repo, {LOCKS[0]: cpu})
    commit(repo, {LOCKS[0]: cpu.replace("\naccelerate==1.16.0 ", "\naccelerate==9.9.9 "), LOCKS[1]: ""})
    dest = tmp_path / "env"
    for rev, expected in [
        ("HEAD~1", f"{LOCKS[1]}@HEAD~1: no such file"),
        ("HEAD", f"{LOCKS[0]}@HEAD: accelerate==9.9.9"),
    ]:
        with pytest.raises(DflashpipeError) as raised:
            build(repo, rev, dest, ROOT)
        assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)
        assert not dest.exists()


def test_no_uv_beside_the_interpreter_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(DflashpipeError, match="^no uv beside"):
        build(ROOT, None, tmp_path / "env", ROOT)
    assert not (tmp_path / "env").exists()


def tiny_wheel(where: Path) -> str:
    """A one-file wheel `tiny 0.1` in `where`; its lock line with its sha256."""
    files = {
        "tiny/__init__.py": b"ANSWER = 42\n",
        "tiny-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 0.1\n",
        "tiny-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    digest = {k: base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b"=").decode() for k, v in files.items()}
    record = "".join(f"{k},sha256={digest[k]},{len(v)}\n" for k, v in files.items()) + "tiny-0.1.dist-info/RECORD,,\n"
    wheel = where / "tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in [*files.items(), ("tiny-0.1.dist-info/RECORD", record.encode())]:
            zf.writestr(name, data)
    return f"tiny==0.1 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n"


def test_a_cache_holding_an_edited_copy_is_refused(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UV_FIND_LINKS", str(tmp_path / "wheels"))
    repo = tmp_path / "repo"
    commit(repo, {LOCKS[0]: tiny_wheel(tmp_path / "wheels"), LOCKS[1]: ""})
    first = build(repo, None, tmp_path / "first", ROOT, check={"tiny": ["tiny/__init__.py"]})
    # written in place, as no one may: the file is the cache's own
    (site_packages(first.python) / "tiny" / "__init__.py").write_text("ANSWER = 41\n", encoding="utf-8")
    with pytest.raises(
        DflashpipeError, match=r"holds tiny with tiny/__init__.py unlike its RECORD: .*cache clean tiny"
    ):
        build(repo, None, tmp_path / "second", ROOT, check={"tiny": ["tiny/__init__.py"]})
    assert not (tmp_path / "second").exists()
