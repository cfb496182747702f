"""The shipped GPU profiles other than gpu8 (which tests/test_rehearse.py rehearses through the usage docs' screen),
each rehearsed for real on the CPU: a file of its own, so that pytest-xdist runs it beside that one."""

from __future__ import annotations

import pytest

from dflashpipe.commands.rehearse import rehearse
from tests.test_rehearse import GPU_PROFILES, ROOT, check_rehearsal

OTHER_GPU_PROFILES = [p for p in GPU_PROFILES if p.stem != "gpu8"]


@pytest.mark.slow
@pytest.mark.parametrize("profile", OTHER_GPU_PROFILES, ids=lambda p: p.stem)
def test_each_gpu_profile_runs_its_whole_dag_on_the_cpu(profile, tmp_path, vllm_python):
    done = rehearse(profile, ROOT, target_config="qwen3-8b", keep=tmp_path / "scratch", progress=lambda line: None)
    check_rehearsal(done.project, profile, set(done.stage_seconds))
