"""The environment fingerprint: deterministic, and it sees what changes compiled kernels."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import json
import os
from pathlib import Path

from dflashpipe.core.artifacts import canonical_json
from dflashpipe.core.env import HASH_STATE, compile_environment, distribution_integrity, edited_functions, observe
from tests.conftest import run


def test_the_stage_writes_the_same_bytes_twice_and_records_compile_env_vars(dvc_project):
    # the first run hashes every torch file; the second reuses the hash state: same bytes either way
    assert "(full check)" in run(["python", "stages/fingerprint.py"], dvc_project).stderr
    first = (dvc_project / "data/env/fingerprint.json").read_bytes()
    assert (dvc_project / HASH_STATE).is_file()
    assert "re-hashed 0 of " in run(["python", "stages/fingerprint.py"], dvc_project).stderr
    assert (dvc_project / "data/env/fingerprint.json").read_bytes() == first
    assert canonical_json(observe(project=dvc_project).facts) == first  # no hash state at all
    assert "dflashpipe-installed-files" not in run(["git", "status", "--porcelain"], dvc_project).stdout
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


def _b64(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


FX = """_is_fx_tracing_flag = False


def is_fx_tracing():
    return _is_fx_tracing_flag


class Tracer:
    def trace(self):
        return 1
"""


def fake_distribution(site: Path) -> metadata.Distribution:
    """A real installed layout (what pip writes: the package, its dist-info, a RECORD of sha256s), found by
    importlib.metadata on a temporary site dir, the way the fingerprint finds torch."""
    pkg = site / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "fx.py").write_text(FX)
    (pkg / "gone.py").write_text("y = 2\n")
    info = site / "fakepkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    lines = [_record_line(site, f"fakepkg/{n}") for n in ("__init__.py", "fx.py", "gone.py")]
    (info / "RECORD").write_text("\n".join(lines + ["fakepkg-1.0.dist-info/RECORD,,"]) + "\n")
    (dist,) = metadata.distributions(name="fakepkg", path=[str(site)])
    return dist


def test_an_edited_or_missing_installed_file_is_named_with_its_hashes(tmp_path):
    dist = fake_distribution(tmp_path / "site")
    clean = distribution_integrity(dist)
    assert (clean.edited, clean.missing, clean.rehashed, clean.checked) == ({}, [], 3, 3)
    fx = tmp_path / "site/fakepkg/fx.py"
    recorded = _b64(fx.read_bytes())
    fx.write_text(FX.replace("return 1", "return 2"))
    (tmp_path / "site/fakepkg/gone.py").unlink()
    found = distribution_integrity(dist)
    assert found.edited == {"fakepkg/fx.py": (recorded, _b64(fx.read_bytes()))}
    assert found.missing == ["fakepkg/gone.py"]


def test_the_hash_state_rehashes_only_files_whose_size_or_mtime_moved(tmp_path):
    dist, state = fake_distribution(tmp_path / "site"), tmp_path / "state/hashes.json"
    first = distribution_integrity(dist, state)
    assert (first.rehashed, first.full) == (3, True) and state.is_file()
    again = distribution_integrity(dist, state)
    assert (again.rehashed, again.full, again.edited) == (0, False, {})
    fx = tmp_path / "site/fakepkg/fx.py"
    before = fx.stat().st_mtime_ns
    fx.write_text(FX.replace("False", "True "))  # same size: only the mtime tells
    os.utime(fx, ns=(before + 10**9, before + 10**9))  # a clock tick apart, whatever the filesystem's granularity
    edited = distribution_integrity(dist, state)
    assert edited.rehashed == 1 and list(edited.edited) == ["fakepkg/fx.py"]
    # the state only saves time: a fresh check without it finds exactly the same
    assert distribution_integrity(dist).edited == edited.edited
    state.write_text("{not json")  # torn: a full check, not an error
    assert distribution_integrity(dist, state).full


def test_the_edited_function_is_named_by_diffing_against_the_wheel(tmp_path):
    import zipfile

    dist = fake_distribution(tmp_path / "site")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert edited_functions(dist, "fakepkg/fx.py", wheels) is None  # no wheel: say so, do not guess
    with zipfile.ZipFile(wheels / "fakepkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fakepkg/fx.py", FX)
    fx = tmp_path / "site/fakepkg/fx.py"
    fx.write_text(FX.replace("return 1", "return 2"))
    assert edited_functions(dist, "fakepkg/fx.py", wheels) == ["Tracer.trace"]
    fx.write_text(FX.replace("= False", "= threading.local()").replace("return _is", "return  _is"))
    assert edited_functions(dist, "fakepkg/fx.py", wheels) == ["<module>"]  # whitespace is no change
    fx.write_text(FX + "# a comment\n")
    assert edited_functions(dist, "fakepkg/fx.py", wheels) == []


def test_the_fingerprint_records_the_thread_facts_that_decide_cpu_speed(dvc_project):
    from dflashpipe.core.env import _cpu_ranges
    from dflashpipe.core.threads import CPU_MAX

    out = dvc_project / "data/env/fingerprint.json"
    run(["python", "stages/fingerprint.py"], dvc_project)
    threads = json.loads(out.read_text())["threads"]
    assert threads["affinity"] == _cpu_ranges(sorted(os.sched_getaffinity(0)))
    quota = CPU_MAX.read_text().strip() if CPU_MAX.is_file() else "none"
    assert threads["cpu_quota"] == quota
    assert threads["torch_intra_op"] >= 1 and threads["torch_inter_op"] >= 1
    # one thread, a passive wait, one CPU: each is in the record, and torch's count follows the variable
    pinned = ["taskset", "-c", str(min(os.sched_getaffinity(0))), "python", "stages/fingerprint.py"]
    run(pinned, dvc_project, env={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})
    one = json.loads(out.read_text())["threads"]
    assert one["torch_intra_op"] == 1 and one["affinity"] == str(min(os.sched_getaffinity(0)))
    assert {k: one["env"][k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")} == {
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def test_thread_facts_split_what_the_runtimes_read_from_what_they_do_not_and_key_the_loaded_facts():
    from dflashpipe.core.env import _cpu_ranges, loaded_key, thread_facts

    environ = {
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "KMP_BLOCKTIME": "0",
        "OPENBLAS_CORETYPE": "Haswell",
        "PATH": "/bin",
        "HOME": "/x",
    }
    # torch on GNU OpenMP and MKL reads OMP_* and MKL_*; KMP_* is Intel OpenMP's, OPENBLAS_* numpy's BLAS's:
    # recorded as facts, read by nothing a stage computes through
    facts = thread_facts(["libgomp", "mkl", "onednn"], environ)
    assert facts["env"] == {"MKL_NUM_THREADS": "4", "OMP_NUM_THREADS": "4"}
    assert facts["other_env"] == {"KMP_BLOCKTIME": "0", "OPENBLAS_CORETYPE": "Haswell"}
    # on an OpenBLAS torch with Intel OpenMP the same variables split the other way
    facts = thread_facts(["libiomp5", "openblas"], environ)
    assert set(facts["env"]) == {"KMP_BLOCKTIME", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE"}
    # runtimes not observed (an older record): every variable may be read, none is dropped
    assert thread_facts(None, environ)["env"] == {k: v for k, v in environ.items() if k not in ("PATH", "HOME")}
    # our own cap on the cores a stage divides among its workers decides its speed as much
    assert thread_facts([], {**environ, "DFLASHPIPE_CORES": "1"})["env"] == {"DFLASHPIPE_CORES": "1"}
    assert _cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and _cpu_ranges([3]) == "3"
    # torch's default thread counts follow these variables: facts recorded under others are not reused
    integrity = distribution_integrity(metadata.distribution("torch"), Path(HASH_STATE))
    assert loaded_key(integrity, {"OMP_NUM_THREADS": "1"}) != loaded_key(integrity, {"OMP_NUM_THREADS": "2"})
    assert loaded_key(integrity, {"OPENBLAS_CORETYPE": "x"}) != loaded_key(integrity, {})


def test_the_runtimes_are_read_off_torch_and_numpy_here():
    """Which runtimes torch computes through is this machine's fact: its build's BLAS, the OpenMP library loaded
    into the process, oneDNN; numpy's BLAS beside it. Compared here with what torch and numpy say themselves."""
    import re

    import numpy as np
    import torch

    from dflashpipe.core.env import RUNTIME_VARIABLES, _runtimes

    found = _runtimes(torch)
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show()).group(1)
    assert {"open": "openblas"}.get(blas, blas) in found["torch"]
    assert ("onednn" in found["torch"]) == torch.backends.mkldnn.is_available()
    openmp = [name for name in found["torch"] if name in ("libgomp", "libiomp5", "libomp")]
    assert (openmp != []) == torch.backends.openmp.is_available()
    numpy_blas = str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"])
    assert len(found["numpy"]) == 1 and found["numpy"][0] in numpy_blas
    assert all(name in RUNTIME_VARIABLES for name in found["torch"])
