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
import json
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashpipe.artifacts import write_json_atomic

COMPILE_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_")
COMPILE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST")
VERSIONED_PACKAGES = ("transformers", "tokenizers", "jinja2", "datasets", "pyarrow", "dvc", "safetensors")
NONE = "none"


WHEELS = Path("/opt/wheels")
"""Where this project's machines keep the wheels they installed (torch's among them): the originals of
installed files, for naming the function an edit changed."""

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


HASH_STATE = Path(".dvc/tmp/dflashpipe-installed-files.json")
"""path -> [size, mtime_ns, digest] of installed files already hashed (git-ignored, like DVC's own state
database): a file whose size and mtime did not move keeps its digest, so a check re-hashes only what moved."""


@dataclass
class Integrity:
    """An installed distribution against its wheel's RECORD."""

    edited: dict[str, tuple[str, str]]
    """relative path -> (RECORD's hash, the file's hash now), both as `sha256=<urlsafe b64>`."""
    missing: list[str]
    rehashed: int
    """How many files were read and hashed (the rest came from the hash state)."""
    checked: int

    @property
    def full(self) -> bool:
        return self.rehashed == self.checked


def distribution_integrity(dist: metadata.Distribution, hash_state: Path | None = None) -> Integrity:
    """Compare an installed distribution's files with the hashes its wheel's RECORD lists.

    With `hash_state`, a file whose (size, mtime_ns) match the state's record reuses its digest; the
    state is rewritten atomically afterwards. The result does not depend on the state, only the time.
    """
    entries = [(f, str(f.locate())) for f in (dist.files or []) if f.hash is not None]
    known = _read_hash_state(hash_state)
    edited: dict[str, tuple[str, str]] = {}
    missing, stale, updated = [], [], {}
    # stat everything first (cheap, in order); only files whose size or mtime moved are read, in threads
    for entry, path in entries:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            missing.append(str(entry))
            continue
        record = known.get(path)
        if record and record[:2] == [st.st_size, st.st_mtime_ns] and record[2].startswith(entry.hash.mode + "="):
            updated[path] = record
        else:
            stale.append((entry, path, st))

    def digest(item) -> str:
        entry, path, _ = item
        with open(path, "rb") as fh:
            raw = hashlib.file_digest(fh, entry.hash.mode).digest()
        return f"{entry.hash.mode}={base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for (_, path, st), found in zip(stale, pool.map(digest, stale), strict=True):
            updated[path] = [st.st_size, st.st_mtime_ns, found]
    for entry, path in entries:
        record = updated.get(path)
        recorded = f"{entry.hash.mode}={entry.hash.value}"
        if record is not None and record[2] != recorded:
            edited[str(entry)] = (recorded, record[2])
    if hash_state is not None and stale:
        known.update(updated)
        write_json_atomic(hash_state, known)
    return Integrity(dict(sorted(edited.items())), sorted(missing), len(stale), len(entries))


def _read_hash_state(path: Path | None) -> dict[str, list]:
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or torn: a full check rebuilds it
        return {}
    return data if isinstance(data, dict) else {}


def edited_functions(dist: metadata.Distribution, rel: str, wheels: Path = WHEELS) -> list[str] | None:
    """The functions and classes of installed file `rel` whose code differs from the wheel's copy.

    There is no original beside an installed package; a wheel of the same name and version under `wheels`
    (where this project keeps its pinned builds) is one. None when no such wheel holds the file or
    either side does not parse."""
    import zipfile

    prefix = dist.metadata["Name"].replace("-", "_").lower() + "-" + dist.version
    for wheel in sorted(Path(wheels).glob("*.whl")) if Path(wheels).is_dir() else []:
        if not wheel.name.lower().startswith(prefix.lower()):
            continue
        try:
            with zipfile.ZipFile(wheel) as zf:
                original = zf.read(rel).decode("utf-8")
            now = Path(dist.locate_file(rel)).read_text(encoding="utf-8")
            before, after = _definitions(original), _definitions(now)
        except (KeyError, OSError, SyntaxError, UnicodeDecodeError, zipfile.BadZipFile):
            continue
        changed = {n for n in set(before) | set(after) if before.get(n) != after.get(n)}
        # an edited method changes its class too: name only the innermost definitions that changed
        return sorted(n for n in changed if not any(m.startswith(n + ".") for m in changed))
    return None


def _definitions(source: str) -> dict[str, str]:
    """Qualified name -> AST dump of every function and class, and `<module>` for the top-level statements."""
    import ast

    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    module = ast.parse(source)
    found = {
        "<module>": ast.dump(ast.Module(body=[n for n in module.body if not isinstance(n, kinds)], type_ignores=[]))
    }

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, kinds):
                found[prefix + child.name] = ast.dump(child)
                visit(child, prefix + child.name + ".")

    visit(module, "")
    return found


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return NONE


def _torch_facts(integrity: Integrity) -> dict[str, Any]:
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
    return {
        "version": torch.__version__,
        "git_version": torch.version.git_version,
        "build": build,
        "cuda": torch.version.cuda or NONE,
        "cudnn": str(cudnn) if cudnn else NONE,
        "nccl": nccl or NONE,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "files_ok": not integrity.edited and not integrity.missing,
        "files_edited": list(integrity.edited),
        "files_missing": integrity.missing,
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


def fingerprint(hash_state: Path | None = None) -> dict[str, Any]:
    """Observe this machine. Same machine, same packages, same variables: same dict (with or without
    `hash_state`, which only saves re-hashing torch's unchanged files)."""
    return observe(hash_state)[0]


def observe(hash_state: Path | None = None) -> tuple[dict[str, Any], Integrity]:
    """The fingerprint and the torch files check behind it (edited files' hashes, how many were re-hashed)."""
    integrity = distribution_integrity(metadata.distribution("torch"), hash_state)
    facts: dict[str, Any] = {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
        },
        "platform": {"system": platform.system(), "machine": platform.machine()},
        "torch": _torch_facts(integrity),
        "triton": {"version": _version("triton")},
        "gpu": _gpu_facts(),
        "env": compile_environment(),
    }
    for package in VERSIONED_PACKAGES:
        facts[package] = {"version": _version(package)}
    return facts, integrity
