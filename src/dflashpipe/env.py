"""The environment fingerprint: the facts that decide whether compiled kernels and
trained weights are still valid.

The fingerprint is a JSON file grouped one level deep (`torch.version`,
`gpu.names`, `env.TORCHINDUCTOR_MAX_AUTOTUNE`), so that a downstream stage names
exactly the keys it depends on as DVC params of this file and `dvc params diff`
shows a change as `torch.version 2.11.0+cu128 -> 2.11.0+cu130`. It holds no
timestamps: the same machine gives the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

COMPILE_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_")
COMPILE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST")
VERSIONED_PACKAGES = ("transformers", "tokenizers", "jinja2", "datasets", "pyarrow", "dvc", "safetensors")
NONE = "none"


CACHE_LOCATION_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
"""Where compiled code is stored, not what it is: left out (dflashpipe and torch set them themselves)."""


def compile_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that change what torch.compile produces."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k.startswith(COMPILE_ENV_PREFIXES) or k in COMPILE_ENV_NAMES) and k not in CACHE_LOCATION_VARS
    }


def distribution_integrity(dist: metadata.Distribution) -> dict[str, list[str]]:
    """Compare an installed distribution's files with the hashes its wheel's RECORD lists.

    Returns the relative paths of files that were edited and of files that are gone;
    both empty means the installed files are exactly what the wheel shipped.
    """
    entries = [f for f in (dist.files or []) if f.hash is not None]

    def check(entry) -> tuple[str, str | None]:
        path = Path(entry.locate())
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return str(entry), "missing"
        digest = hashlib.new(entry.hash.mode, data).digest()
        encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        return str(entry), None if encoded == entry.hash.value else "edited"

    edited, missing = [], []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, problem in pool.map(check, entries):
            if problem == "edited":
                edited.append(name)
            elif problem == "missing":
                missing.append(name)
    return {"edited": sorted(edited), "missing": sorted(missing)}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return NONE


def _torch_facts() -> dict[str, Any]:
    import torch

    if torch.version.cuda:
        build = f"cuda-{torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"rocm-{torch.version.hip}"
    else:
        build = "cpu"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # nccl absent from this build
            nccl = None
    integrity = distribution_integrity(metadata.distribution("torch"))
    return {
        "version": torch.__version__,
        "git_version": torch.version.git_version,
        "build": build,
        "cuda": torch.version.cuda or NONE,
        "cudnn": str(cudnn) if cudnn else NONE,
        "nccl": nccl or NONE,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "files_ok": not integrity["edited"] and not integrity["missing"],
        "files_edited": integrity["edited"],
        "files_missing": integrity["missing"],
    }


def _gpu_facts() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"count": 0, "names": [], "capabilities": [], "driver": NONE}
    count = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    caps = [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(count)]
    driver = "unknown"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:  # pynvml missing or no NVML on this machine: say so, do not guess
        driver = "unknown"
    return {"count": count, "names": names, "capabilities": caps, "driver": driver}


def fingerprint() -> dict[str, Any]:
    """Observe this machine. Same machine, same packages, same variables: same dict."""
    facts: dict[str, Any] = {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
        },
        "platform": {"system": platform.system(), "machine": platform.machine()},
        "torch": _torch_facts(),
        "triton": {"version": _version("triton")},
        "gpu": _gpu_facts(),
        "env": compile_environment(),
    }
    for package in VERSIONED_PACKAGES:
        facts[package] = {"version": _version(package)}
    return facts
