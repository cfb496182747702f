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
import csv
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashpipe.core.artifacts import canonical_json, write_json_atomic
from dflashpipe.core.serving_env import serving_environment
from dflashpipe.core.threads import CORES_ENV, CPU_MAX

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


RUNTIME_VARIABLES: dict[str, tuple[str, ...]] = {
    "libgomp": ("OMP_", "GOMP_"),  # GNU OpenMP: OMP_NUM_THREADS, OMP_WAIT_POLICY, GOMP_SPINCOUNT, GOMP_CPU_AFFINITY
    "libiomp5": ("OMP_", "KMP_"),  # Intel OpenMP: OMP_*, KMP_BLOCKTIME, KMP_AFFINITY
    "libomp": ("OMP_", "KMP_"),  # LLVM OpenMP, which also reads Intel's KMP_* names
    "mkl": ("MKL_",),  # MKL_NUM_THREADS, MKL_ENABLE_INSTRUCTIONS, MKL_CBWR
    "openblas": ("OPENBLAS_", "GOTO_"),  # OPENBLAS_NUM_THREADS, OPENBLAS_CORETYPE, GOTO_NUM_THREADS
    "blis": ("BLIS_",),
    "onednn": ("ONEDNN_", "DNNL_"),  # ONEDNN_MAX_CPU_ISA, DNNL_DEFAULT_FPMATH_MODE
}
"""The CPU runtimes a process of this project may load, and the variable families each reads (its own
documentation's names). Which of them torch computes through is read off the machine (`_runtimes`); the table
only says what each one reads."""

THREAD_ENV_PREFIXES = tuple(sorted({prefix for prefixes in RUNTIME_VARIABLES.values() for prefix in prefixes}))
"""Every variable of these families is recorded, read or not: `threads.env` holds those the runtimes torch
computes through read (and ours, `DFLASHPIPE_CORES`, which caps the cores dflashpipe.core.threads divides among a
stage's workers), `threads.other_env` the rest (an `OPENBLAS_*` beside an MKL torch: numpy's OpenBLAS reads it,
and no stage's output goes through numpy's linear algebra)."""


CONTROL_INPUTS = (
    "threads.torch_intra_op",
    "threads.env",
    "threads.affinity",
    "threads.cpu_quota",
    "torch.version",
    "torch.build",
    "torch.cpu_capability",
    "gpu.names",
    "gpu.capabilities",
)
"""The fingerprint keys that can move the control (`spread.control_ms`: a float32 `torch.mm` on the stage's
device at its intra-op count): the threads it runs at, what their runtimes read and the cores they get; the
matmul's kernels (torch's build and CPU kernel set); the device. A rate whose stage ran with another value of
one of these is compared without the control; any other fact (`threads.other_env`, the compile variables,
transformers' version, an edited torch Python file, which `torch.mm`, a C++ builtin, does not run) leaves the
control a neutral reference."""


def thread_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Every variable of the runtimes' families, and DFLASHPIPE_CORES: what the fingerprint sees, read or not."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(THREAD_ENV_PREFIXES) or k == CORES_ENV}


def read_by(runtimes: list[str] | None) -> tuple[str, ...]:
    """The variable families `runtimes` read; every family when they are unknown (a record made before they
    were observed): a variable that may be read is never dropped from what a stage depends on."""
    if runtimes is None:
        return THREAD_ENV_PREFIXES
    return tuple(sorted({prefix for name in runtimes for prefix in RUNTIME_VARIABLES.get(name, ())}))


def thread_facts(runtimes: list[str] | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """What decides how fast the CPU runs this process's kernels and is not code: the variables the runtimes
    torch computes through read (`runtimes`, from `_runtimes`; `env`) and the other ones seen (`other_env`), the
    CPUs this process may run on (`os.sched_getaffinity`) and the cgroup's CPU quota (`cpu.max`: `<quota>
    <period>` in microseconds, or `max <period>`). Read without torch; torch's own thread counts and which
    runtimes it loads are loaded facts."""
    seen, read = thread_environment(environ), read_by(runtimes)
    env = {k: v for k, v in seen.items() if k == CORES_ENV or k.startswith(read)}
    try:
        affinity = _cpu_ranges(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        affinity = f"{os.cpu_count()} cpus (affinity unknown)"
    try:
        quota = CPU_MAX.read_text(encoding="utf-8").strip()
    except OSError:  # no cgroup v2 file here: no quota this process can see
        quota = NONE
    return {
        "env": env,
        "other_env": {k: v for k, v in seen.items() if k not in env},
        "affinity": affinity,
        "cpu_quota": quota,
    }


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", as the kernel writes CPU lists."""
    parts: list[str] = []
    for cpu in cpus:
        if parts and int(parts[-1].split("-")[-1]) == cpu - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def _torch_threads() -> dict[str, int]:
    """torch's intra-op and inter-op thread counts as a fresh process under this environment starts with them.

    A torch imported before (a test, `explain --verify`) may have had its counts set since: ask a fresh one."""
    if "torch" not in sys.modules:
        import torch

        return {"torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads()}
    code = "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    intra, inter = out.split()
    return {"torch_intra_op": int(intra), "torch_inter_op": int(inter)}


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
    content: str = ""
    """sha256 over every listed file's hash now (or its absence): what the files are, for keying facts on them."""

    @property
    def full(self) -> bool:
        return self.rehashed == self.checked


def _record_entries(dist: metadata.Distribution) -> list[tuple[str, str, str, str]]:
    """(path as RECORD names it, hash mode, hash value, path on disk) of every hashed file of `dist`.

    RECORD read directly: `dist.files` builds a PackagePath and a FileHash per line, 0.3 s of torch's 12K."""
    text = dist.read_text("RECORD") or ""
    base = str(dist.locate_file(""))
    entries = []
    for row in csv.reader(text.splitlines()):
        if len(row) >= 2 and "=" in row[1]:
            mode, value = row[1].split("=", 1)
            entries.append((row[0], mode, value, os.path.join(base, row[0])))
    return entries


def distribution_integrity(
    dist: metadata.Distribution, hash_state: Path | None = None, only: Collection[str] | None = None
) -> Integrity:
    """Compare an installed distribution's files with the hashes its wheel's RECORD lists (`only`: just those of
    these paths, as RECORD names them).

    With `hash_state`, a file whose (size, mtime_ns) match the state's record reuses its digest; the
    state is rewritten atomically afterwards. The result does not depend on the state, only the time.
    """
    entries = [entry for entry in _record_entries(dist) if only is None or entry[0] in only]
    known = _read_hash_state(hash_state)
    missing, stale, updated = [], [], {}
    # stat everything first (cheap, in order); only files whose size or mtime moved are read, in threads
    for rel, mode, _, path in entries:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            missing.append(rel)
            continue
        record = known.get(path)
        if record and record[:2] == [st.st_size, st.st_mtime_ns] and record[2].startswith(mode + "="):
            updated[path] = record
        else:
            stale.append((mode, path, st))

    def digest(item) -> str:
        mode, path, _ = item
        with open(path, "rb") as fh:
            raw = hashlib.file_digest(fh, mode).digest()
        return f"{mode}={base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for (_, path, st), found in zip(stale, pool.map(digest, stale), strict=True):
            updated[path] = [st.st_size, st.st_mtime_ns, found]
    edited: dict[str, tuple[str, str]] = {}
    content = hashlib.sha256()
    for rel, mode, value, path in entries:
        record = updated.get(path)
        content.update(f"{rel}\t{record[2] if record else 'missing'}\n".encode())
        if record is not None and record[2] != f"{mode}={value}":
            edited[rel] = (f"{mode}={value}", record[2])
    if hash_state is not None and stale:
        known.update(updated)
        write_json_atomic(hash_state, known)
    return Integrity(dict(sorted(edited.items())), sorted(missing), len(stale), len(entries), content.hexdigest())


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


LOADED_STATE = Path(".dvc/tmp/dflashpipe-loaded-torch.json")
"""The facts only an imported torch tells (its build, cuDNN, NCCL, CPU capability, the GPUs), with the key they
were observed under (git-ignored, beside the hash state). Importing torch takes ~3 s, most of explain's time;
those facts are a function of `loaded_key`'s inputs, so a reader whose key matches may reuse them. The
fingerprint stage never does: it always imports torch, and rewrites this record."""

LOADED_GROUPS = frozenset({"torch", "gpu", "threads", "target_dtype"})
"""The fingerprint's groups that need torch imported (`_loaded_facts`)."""

LOADED_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "ATEN_", "HIP_", "ROCR_", "ROCM_", "LD_")
"""Variables that choose devices (CUDA_VISIBLE_DEVICES), a CPU kernel set (ATEN_CPU_CAPABILITY) or the shared
libraries torch loads (LD_LIBRARY_PATH, LD_PRELOAD): part of the loaded facts' key."""


@dataclass
class Observation:
    """The fingerprint, the torch files check behind it, and whether torch was imported to observe it."""

    facts: dict[str, Any]
    integrity: Integrity
    probed: bool
    """False when the loaded facts came from LOADED_STATE, recorded under the same key."""


def _loaded_facts() -> dict[str, Any]:
    """What needs torch imported: the build, its libraries, the CPU kernel set, the GPUs, its thread counts."""
    threads = _torch_threads()  # first: it knows whether this process imported torch before
    import torch

    from dflashpipe.core.kernels import native_dtype  # imports torch: here, where torch is imported anyway

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
    torch_facts = {
        "version": str(torch.__version__),
        "git_version": torch.version.git_version,
        "build": build,
        "cuda": torch.version.cuda or NONE,
        "cudnn": str(cudnn) if cudnn else NONE,
        "nccl": nccl or NONE,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    dtypes = {device: native_dtype(device) for device in devices}
    threads = {**threads, "runtimes": _runtimes(torch)}
    return {"torch": torch_facts, "gpu": _gpu_facts(), "threads": threads, "target_dtype": dtypes}


def _runtimes(torch) -> dict[str, list[str]]:
    """The CPU runtimes (RUNTIME_VARIABLES' names) that torch computes through here, and numpy's BLAS: torch's
    BLAS as its build says (`BLAS_INFO`), its OpenMP runtime as the library loaded into this process, oneDNN when
    its build has it; numpy's BLAS as numpy's build says. What they read is what a stage's output can follow."""
    found = []
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    if blas:
        found.append({"open": "openblas"}.get(blas.group(1), blas.group(1)))
    if torch.backends.openmp.is_available():
        openmp = _loaded_openmp()
        found += [openmp] if openmp else ["libgomp", "libiomp5", "libomp"]  # not found: any may be the one
    if torch.backends.mkldnn.is_available():
        found.append("onednn")
    numpy_blas = []
    try:
        import numpy as np

        name = str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"])
        numpy_blas.append(next((known for known in RUNTIME_VARIABLES if known in name), name))
    except Exception:  # no numpy, or a build that does not say: nothing to record
        pass
    return {"torch": sorted(found), "numpy": numpy_blas}


def _loaded_openmp() -> str | None:
    """The OpenMP runtime loaded into this process (`/proc/self/maps`), as RUNTIME_VARIABLES names it."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if "/" in line}
    for name in ("libgomp", "libiomp5", "libomp"):
        if any(n.startswith(name + ".") or n.startswith(name + "-") for n in names):
            return name
    return None


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


def loaded_key(integrity: Integrity, environ: dict[str, str] | None = None) -> str:
    """What the loaded facts depend on: torch's files as they are now (integrity.content), the versions of the
    distributions torch requires, this interpreter, the CPU's model and flags, the GPUs and driver the kernel
    lists, the variables that choose devices or libraries, and the thread facts (the thread variables, the CPU
    affinity and quota decide torch's default thread counts). Any change means importing torch again."""
    environ = os.environ if environ is None else environ
    requires = sorted({re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in metadata.requires("torch") or []})
    parts = {
        "torch_files": integrity.content,
        "requires": {name: _version(name) for name in requires},
        "python": [sys.executable, sys.version],
        "cpu": _cpu_identity(),
        "gpus": _gpu_identity(),
        "env": {k: v for k, v in sorted(environ.items()) if k.startswith(LOADED_ENV_PREFIXES)},
        # every thread variable seen (read_by(None)): torch's default counts and what it loads may follow any
        "threads": thread_facts(None, environ),
    }
    return hashlib.sha256(canonical_json(parts)).hexdigest()


def _cpu_identity() -> list[str]:
    """The first CPU's vendor, model and flags from /proc/cpuinfo (not its clock, which moves); elsewhere what
    `platform` says."""
    try:
        block = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[0]
    except OSError:
        return [platform.machine(), platform.processor()]
    return [line for line in block.splitlines() if line.startswith(("vendor_id", "model name", "flags"))]


def _gpu_identity() -> dict[str, str]:
    """The NVIDIA driver's version and per-GPU information files, and which GPU device nodes exist."""
    found: dict[str, str] = {}
    proc = Path("/proc/driver/nvidia")
    for path in [proc / "version", *sorted(proc.glob("gpus/*/information"))]:
        try:
            found[str(path)] = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    try:
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith(("nvidia", "kfd")))
    except OSError:
        nodes = []
    found["/dev"] = " ".join(nodes)
    return found


def _read_loaded(path: Path, key: str) -> dict[str, Any] | None:
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    facts = record.get("facts") if isinstance(record, dict) and record.get("key") == key else None
    # a record written by code that observed fewer facts (no target_dtype, no runtimes) is observed again, not
    # read with holes
    if not isinstance(facts, dict) or not facts.keys() >= LOADED_GROUPS:
        return None
    return facts if isinstance(facts["threads"], dict) and "runtimes" in facts["threads"] else None


ABSENT = object()
"""What `fact_at` gives for a key a fingerprint does not hold (never None: a fact may be null)."""


def fact_at(facts: dict[str, Any], key: str) -> Any:
    """The value of dotted `key` (`threads.env`, `torch.files_edited`) in a fingerprint, or ABSENT."""
    node: Any = facts
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def fact_change(was: Any, now: Any, width: int = 60, gone: str = "absent") -> str:
    """`was -> now` in words a line holds: of two dicts only the keys that differ (`OMP_NUM_THREADS unset -> 1`),
    an absent earlier side as `absent` and an absent later one as `gone` (`removed`, for a fact this machine no
    longer has), each value cut to `width` characters. Printed facts are shortened here; the record keeps them
    whole."""

    def short(value: Any, missing: str) -> str:
        if value is ABSENT:
            return missing
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        return text if len(text) <= width else text[: width - 3] + "..."

    if isinstance(was, dict) and isinstance(now, dict):  # a key missing from one side: unset there
        keys = sorted(k for k in set(was) | set(now) if was.get(k, ABSENT) != now.get(k, ABSENT))
        return "; ".join(
            f"{k} {short(was.get(k, ABSENT), 'unset')} -> {short(now.get(k, ABSENT), 'unset')}" for k in keys
        )
    return f"{short(was, 'absent')} -> {short(now, gone)}"


def target_source_files(project: Path | str) -> dict[str, list[int]]:
    """Each file of params.yaml's local `target.source` (a model directory's top level, or the .gguf), as
    [size, mtime_ns]: a stat each, so the target stage, which hashes them, reruns when one is written, wherever
    the user keeps them. Empty for a source shipped in a package, or none yet (the target stage says why)."""
    import yaml

    try:
        source = yaml.safe_load((Path(project) / "params.yaml").read_text(encoding="utf-8"))["target"]["source"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}
    if not isinstance(source, str) or source.startswith("pypi:"):
        return {}
    path = Path(project).resolve() / source
    files = sorted(f for f in path.iterdir() if not f.name.startswith(".")) if path.is_dir() else [path]
    return {f.name: [st.st_size, st.st_mtime_ns] for f in files if f.is_file() and (st := f.stat())}


def observe(
    hash_state: Path | None = None,
    loaded_state: Path | None = None,
    reuse_loaded: bool = False,
    *,
    project: Path | str,
) -> Observation:
    """The fingerprint of `project` on this machine and the torch files check behind it (edited files' hashes, how
    many were re-hashed). The project matters only for its serving environment (`.venv-serve` lies in it), and is
    named by every caller: the working directory is not always the project the facts are compared with.

    With `reuse_loaded`, the facts that need torch imported come from `loaded_state` when it was recorded
    under this `loaded_key`; otherwise torch is imported, and the facts recorded there (when given)."""
    integrity = distribution_integrity(metadata.distribution("torch"), hash_state)
    key = loaded_key(integrity)
    loaded = _read_loaded(loaded_state, key) if reuse_loaded and loaded_state is not None else None
    probed = loaded is None
    if loaded is None:
        loaded = _loaded_facts()
        if loaded_state is not None:
            write_json_atomic(loaded_state, {"key": key, "facts": loaded})
    threads = loaded.get("threads", {})
    torch_facts = {
        **loaded["torch"],
        "files_ok": not integrity.edited and not integrity.missing,
        "files_edited": list(integrity.edited),
        "files_missing": integrity.missing,
    }
    facts: dict[str, Any] = {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
        },
        "platform": {"system": platform.system(), "machine": platform.machine()},
        "torch": torch_facts,
        "triton": {"version": _version("triton")},
        "gpu": loaded["gpu"],
        "env": compile_environment(),
        "threads": {**threads, **thread_facts(threads.get("runtimes", {}).get("torch"))},
        # what compute.target_dtype: auto computes the target in, per device type (every kind of work)
        "target_dtype": loaded["target_dtype"],
    }
    for package in VERSIONED_PACKAGES:
        facts[package] = {"version": _version(package)}
    # the project's serving environment (bin/setup --serve): its engine's versions, or all null, so that setting it
    # up reruns the served check that recorded "not run"
    facts["serving"] = serving_environment(project)
    facts["target_source"] = {"files": target_source_files(project)}
    return Observation(facts, integrity, probed)
