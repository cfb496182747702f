"""The story this project exists for, proven by intervention on its own stages (the tiny run profile): the data
grown, the compile cache deleted, an installed torch file edited so that every backward pass really costs more, and
a thread variable set. `explain --verify` on training's rate measures each cause with the bench probe, in a scratch
tree per arm, and must name the edited torch file as what made it slow.

The edited torch lives in an environment of the test's own (built from the lock like a pristine one, one file
replaced, never written in place: its files are links into uv's cache), whose interpreter runs `dflashpipe`: the
machine the user stands on. The torch arm runs in a pristine environment built from A's lock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflashpipe.commands.rerun import pristine
from dflashpipe.commands.rerun.verify import FIXED, MEASURED, OUTSIDE
from tests.conftest import ROOT, copy_project, run, set_params

EDITED = "torch/autograd/__init__.py"
SLOWER = """

_unedited_backward = backward


def backward(*args, **kwargs):  # edited: every backward pass spins 60 ms first, on the CPU, as a slow kernel would
    import time

    started = time.perf_counter()
    while time.perf_counter() - started < 0.06:
        pass
    return _unedited_backward(*args, **kwargs)
"""


def edit_by_replacing(site: Path, rel: str, extra: str) -> None:
    """Append `extra` to an installed file as a new file renamed over it: the old one is a link into uv's cache,
    which an edit in place would change for every environment built from it."""
    path = site / rel
    scratch = path.with_name(path.name + ".edited")
    scratch.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")
    os.replace(scratch, path)


@pytest.mark.slow
def test_verify_names_the_edited_torch_file_as_what_made_training_slow(pipeline_run, tmp_path):
    project = copy_project(pipeline_run, tmp_path / "project")
    (project / "requirements").mkdir()
    for lock in pristine.LOCKS:  # the project's own lock, as a user's repository holds it
        shutil.copy2(ROOT / lock, project / lock)
    run(["git", "add", "requirements"], project)
    run(["git", "commit", "-qm", "the lock"], project)
    edited = pristine.build(ROOT, None, tmp_path / "edited-env", ROOT)
    (edited.python.parent / "uv").symlink_to(Path(sys.executable).parent / "uv")  # bin/setup's, as in .venv
    site = next((tmp_path / "edited-env" / "lib").glob("python3*/site-packages"))
    edit_by_replacing(site, EDITED, SLOWER)
    threads = json.loads((project / "data/env/fingerprint.json").read_text())["threads"]["torch_intra_op"]

    set_params(project, data__num_samples=420)  # the data grown
    subprocess.run(["rm", "-rf", str(project / "data/compile")], check=True)  # the compile cache lost
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # a thread variable set (to what torch used anyway)
    env["PATH"] = f"{edited.python.parent}{os.pathsep}{env['PATH']}"
    script = (
        "import sys; from dflashpipe.commands.rerun.verify import verify, verification_json, verification_lines\n"
        "v = verify(sys.argv[1], 'HEAD', runs=2)\n"
        "print(verification_json(v)); print('=' * 8); print('\\n'.join(verification_lines(v)))"
    )
    done = subprocess.run(
        [edited.python, "-c", script, "metrics/train/metrics.json:tokens_per_s"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    as_json, text = done.stdout.split("=" * 8 + "\n")
    found, lines = json.loads(as_json), text.splitlines()
    print(text, f"edited environment built in {edited.seconds:.1f} s", done.stderr[-3000:], sep="\n")
    assert (found["stage"], found["probe"]["stage"]) == ("train", "bench")

    assert lines[1].startswith("answer: machine torch.files_edited") and "measured" in lines[1], lines
    arms = {i["cause"]["what"]: i for i in found["interventions"]}
    assert set(arms) == {"params.yaml:data.num_samples", "data/compile", "torch.files_edited", "threads.env"}
    assert arms["params.yaml:data.num_samples"]["status"] == OUTSIDE  # bench reads no data
    edit = arms["torch.files_edited"]
    assert (edit["status"], edit["call"], edit["pristine"]) == (MEASURED, "change", True), lines
    assert edit["change"] > 0.5 and "pristine environment built in " in edit["note"]
    for other in ("data/compile", "threads.env"):  # not what made it slow
        assert (arms[other]["status"], arms[other]["moved"]) == (MEASURED, False), lines
    assert arms["threads.env"]["variables"] == {"OMP_NUM_THREADS": None}
    assert all(i["seconds"] > 0 for i in arms.values() if i["status"] == MEASURED)  # what each arm cost
    assert FIXED not in {i["status"] for i in arms.values()}
