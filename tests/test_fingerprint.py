"""The environment fingerprint: deterministic, and it sees what changes compiled kernels."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import json

from dflashpipe.env import compile_environment, distribution_integrity
from tests.conftest import run


def test_the_stage_writes_the_same_bytes_twice_and_records_compile_env_vars(dvc_project):
    run(["python", "stages/fingerprint.py"], dvc_project)
    first = (dvc_project / "data/env/fingerprint.json").read_bytes()
    run(["python", "stages/fingerprint.py"], dvc_project)
    assert (dvc_project / "data/env/fingerprint.json").read_bytes() == first
    facts = json.loads(first)
    import torch

    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["build"] == ("cpu" if not torch.version.cuda else f"cuda-{torch.version.cuda}")
    assert facts["torch"]["files_ok"] is True and facts["torch"]["files_edited"] == []
    assert facts["transformers"]["version"] == metadata.version("transformers")

    run(["python", "stages/fingerprint.py"], dvc_project, env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert (
        json.loads((dvc_project / "data/env/fingerprint.json").read_text())["env"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"
    )


def test_compile_environment_keeps_only_compile_relevant_variables():
    env = {
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "TORCH_COMPILE_DEBUG": "1",
        "TORCHDYNAMO_VERBOSE": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/root",
        "PATH": "/bin",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "TRITON_CACHE_DIR": "/t",
    }  # where, not what: left out
    assert compile_environment(env) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "TORCHDYNAMO_VERBOSE": "1",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "TORCH_COMPILE_DEBUG": "1",
    }


def _record_line(root, rel: str) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256((root / rel).read_bytes()).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{(root / rel).stat().st_size}"


def test_an_edited_or_missing_installed_file_is_named(tmp_path):
    # A real installed distribution layout (what pip writes), checked by the same code that checks torch.
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "fx.py").write_text("_is_fx_tracing_flag = False\n")
    (pkg / "gone.py").write_text("y = 2\n")
    info = tmp_path / "fakepkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    lines = [_record_line(tmp_path, f"fakepkg/{n}") for n in ("__init__.py", "fx.py", "gone.py")]
    (info / "RECORD").write_text("\n".join(lines + ["fakepkg-1.0.dist-info/RECORD,,"]) + "\n")
    dist = metadata.PathDistribution(info)

    assert distribution_integrity(dist) == {"edited": [], "missing": []}
    (pkg / "fx.py").write_text("_is_fx_tracing_flag = threading.local()\n")
    (pkg / "gone.py").unlink()
    assert distribution_integrity(dist) == {"edited": ["fakepkg/fx.py"], "missing": ["fakepkg/gone.py"]}
