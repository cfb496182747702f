"""What a plan is computed from: the run's params (params.yaml, a profile laid over it, `-S` values), the target's
config.json (or a shipped one, so that a model need not be downloaded to be planned for), the devices (a published
row, the user's own file, or this CPU, measured) and the data's size.

Every failure is one PlanError naming the file, the key and the fix.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.core.devices import GB, PUBLISHED, Device
from dflashpipe.core.errors import DflashpipeError, ParamsError
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params import PARAMS_FILE, SECTIONS, build
from dflashpipe.core.params.loading import _read_yaml
from dflashpipe.core.params.profile import profile_overrides
from dflashpipe.core.pipeline import TARGET, TOKENIZE_METRICS, TRAIN_METRICS
from dflashpipe.core.threads import thread_budget


class PlanError(DflashpipeError):
    """The plan cannot be made (bad input) or the run it plans cannot fit."""


@dataclass(frozen=True)
class Run:
    """The params a plan is for: every section typed and range-checked, as a stage would read them."""

    label: str
    """Where they come from: `params.yaml`, or `profiles/x.yaml over params.yaml`, with any -S values."""
    params: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)
    """What the profile and -S values change, as `section.key -> value`: what `dvc exp run -S` is given."""

    def __getattr__(self, section: str) -> Any:
        try:
            return self.params[section]
        except KeyError:
            raise AttributeError(section) from None


def resolve_run(profile: str | None, sets: list[str], root: Path) -> Run:
    """params.yaml under `root`, with `profile` laid over it and then `sets` (`section.key=value`, as `-S`)."""
    raw = _read_yaml(root / PARAMS_FILE)
    overrides = profile_overrides(profile, root) if profile else {}
    for item in sets:
        key, value = parse_set(item)
        overrides[key] = value
    label = " over ".join(filter(None, (profile, PARAMS_FILE))) + "".join(f" -S {s}" for s in sets)
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        raw[section] = {**(raw.get(section) or {}), name: value}
    try:
        params = {name: build(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    except ParamsError as exc:
        raise PlanError(f"{label}: {str(exc).removeprefix(PARAMS_FILE + ': ')}") from None
    return Run(label, params, overrides)


def parse_set(item: str) -> tuple[str, Any]:
    """`section.key=value` in the grammar `dvc exp run -S` parses (Hydra's override grammar: 1e-3 is a number)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_overrides([item])[0]
        key, value = override.key_or_group, override.value()
    except HydraException as exc:
        first = str(exc).splitlines()[0]
        raise PlanError(f"-S {item}: not a section.key=value in the grammar of `dvc exp run -S` ({first})") from None
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name or "." in name:
        raise PlanError(f"-S {item}: expected section.key=value with a section of {sorted(SECTIONS)}")
    return key, value


# -- the target's config --------------------------------------------------------------------------


TARGET_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3-8b": (
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
        },
        "Qwen/Qwen3-8B config.json, https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
    ),
}
"""Shipped target configs by name (`dflashpipe plan --target-config qwen3-8b`): the architecture keys of the
published config.json, which is all a plan reads of a target."""


@dataclass(frozen=True)
class TargetConfig:
    config: Any
    """A transformers PretrainedConfig."""
    source: str
    """The file it was read from, or the publication of a shipped one."""


def target_config(run: Run, root: Path, option: str | None) -> TargetConfig:
    """The target's config: `option` (a config.json, a model directory, or a shipped name), else what
    `target.source` names: a local model directory's config.json, the target stage's copy of it when it was
    materialised from this very source, or the GGUF's own metadata (slow: the file is parsed)."""
    from transformers import AutoConfig

    if option and option.lower() in TARGET_CONFIGS:
        values, source = TARGET_CONFIGS[option.lower()]
        return TargetConfig(AutoConfig.for_model(**values), f"{option} (published: {source})")
    if option:
        path = Path(option)
        return _read_config(path / "config.json" if path.is_dir() else path, "--target-config", option)
    source = run.target.source
    stored = root / TARGET / "source.json"
    if stored.is_file() and json.loads(stored.read_text()).get("source") == source:
        return _read_config(root / TARGET / "config.json", "target.source", source)
    if source.startswith("pypi:") or source.endswith(".gguf"):
        from dflashpipe.target.materialise import resolve_source

        try:
            src = resolve_source(source, root)
            config = AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file)
        except (DflashpipeError, OSError, ValueError) as exc:
            raise PlanError(f"{run.label}: target.source = {source!r}: cannot read its config ({exc})") from None
        return TargetConfig(config, f"{source} (the GGUF's metadata)")
    return _read_config(root / source / "config.json", "target.source", source)


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""What a plan reads of a target's config (with the optional head_dim, num_key_value_heads, tie_word_embeddings)."""


def _read_config(path: Path, key: str, value: str) -> TargetConfig:
    from transformers import AutoConfig

    shipped = ", ".join(TARGET_CONFIGS)
    if not path.is_file():
        raise PlanError(
            f"{path}: not found ({key} = {value!r}): put the model's config.json there, or pass "
            f"--target-config FILE (or a shipped one: {shipped})"
        )
    try:
        text = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not valid JSON ({exc}); {key} = {value!r}") from None
    shapes = text.get("text_config", text) if isinstance(text, dict) else {}
    for needed in ("model_type", *SHAPE_KEYS):
        if needed not in (text if needed == "model_type" else shapes):
            raise PlanError(f"{path}: key {needed!r} is missing ({key} = {value!r}): a plan needs the model's shapes")
    try:
        config = AutoConfig.for_model(**text)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{path}: key 'model_type' = {text['model_type']!r}: {exc} ({key} = {value!r})") from None
    return TargetConfig(config, str(path))


# -- devices ---------------------------------------------------------------------------------------


def this_cpu(root: Path) -> Device:
    """This CPU as a device, from measurements of this machine: its fp32 rate is the fixed matmul that train timed
    beside its own run (dflashpipe.core.spread's control, in metrics/train/metrics.json), per thread, times the cores
    this process may use; without it, and for bf16, a matmul timed now. Its memory: physical (or the cgroup's
    limit, if lower). A rate against a measured matmul, not a datasheet peak: an MFU here can pass 1 where a
    kernel beats that matmul."""
    cores = thread_budget({"plan": 1}).cores
    fp32, fp32_source = recorded_control(root)
    if fp32 is None:
        fp32, fp32_source = matmul_rate_now("float32"), "timed now, 1 thread"
    when = time.strftime("%Y-%m-%d %H:%M")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        memory = min(memory, int(limit)) if limit.isdigit() else memory
    except OSError:
        pass
    return Device(
        "cpu",
        "cpu",
        matmul_rate_now("bfloat16") * cores,
        fp32 * cores,
        memory,
        None,
        f"measured here: fp32 {fp32_source}, bf16 timed now ({when}, 1 thread), x {cores} cores; physical memory",
    )


def recorded_control(root: Path) -> tuple[float | None, str]:
    """FLOP/s per thread of the control matmul that train timed before and after its steps, or None."""
    from dflashpipe.core.spread import CONTROL_SHAPE

    try:
        metrics = read_record_at(root / TRAIN_METRICS)  # the spread and threads are in its detail file
        control = metrics["tokens_per_s_spread"]["machine"]["control_ms"]
        threads = metrics["threads"]["threads"]["drafter"]
    except (DflashpipeError, KeyError, TypeError):
        return None, ""
    m, k, n = CONTROL_SHAPE
    seconds = (control["before"] + control["after"]) / 2 / 1000
    return 2 * m * k * n / seconds / threads, f"{TRAIN_METRICS}'s control matmul ({threads} thread(s))"


def matmul_rate_now(dtype: str) -> float:
    """One thread's matmul FLOP/s now: the fastest of a few blocks (the least disturbed by other work)."""
    import torch
    from torch.utils.benchmark import Timer

    size = 512 if dtype == "float32" else 128  # a bf16 matmul without native kernels is ~100x slower
    a, b = (torch.randn(size, size, dtype=getattr(torch, dtype)) for _ in range(2))
    measured = Timer("a @ b", globals={"a": a, "b": b}, num_threads=1).blocked_autorange(min_run_time=0.1)
    return 2 * size**3 / min(measured.times)


@dataclass(frozen=True)
class DeviceChoice:
    """Which device each role's workers run on."""

    target: Device
    drafter: Device
    cores: int
    """This process's cores (the CPU's workers share them)."""


def known_devices(devices_file: Path | None) -> dict[str, Device]:
    """The published rows, with the user's own file's rows over them (by name)."""
    rows = {d.name.lower(): d for d in PUBLISHED}
    if devices_file is not None:
        rows.update({d.name.lower(): d for d in read_devices_file(devices_file)})
    return rows


DEVICE_KEYS = ("bf16_tflops", "fp32_tflops", "memory_gb", "link_gb_s", "source")


def read_devices_file(path: Path) -> list[Device]:
    """A YAML mapping `NAME: {bf16_tflops, fp32_tflops, memory_gb, link_gb_s, source}` (link one way; the source a
    datasheet or how it was measured)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"{path}: cannot read it as YAML ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise PlanError(f"{path}: expected a mapping of device names to {{{', '.join(DEVICE_KEYS)}}}")
    devices = []
    for name, row in raw.items():
        if not isinstance(row, dict) or set(row) != set(DEVICE_KEYS):
            got = sorted(row) if isinstance(row, dict) else row
            raise PlanError(f"{path}: {name}: expected exactly the keys {list(DEVICE_KEYS)}, got {got}")
        for key in DEVICE_KEYS[:-1]:
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise PlanError(f"{path}: {name}.{key} = {value!r}: expected a positive number")
        if not isinstance(row["source"], str) or not row["source"].strip():
            raise PlanError(f"{path}: {name}.source is empty: name the datasheet, or how the rate was measured")
        devices.append(
            Device(
                str(name),
                str(name),
                row["bf16_tflops"] * 1e12,
                row["fp32_tflops"] * 1e12,
                row["memory_gb"] * GB,
                row["link_gb_s"] * GB,
                f"{row['source']} ({path})",
            )
        )
    return devices


def choose_devices(run: Run, name: str | None, devices_file: Path | None, root: Path) -> DeviceChoice:
    """`cpu` entries of the topology are this CPU (measured); `cuda:N` entries are the device `name`."""
    topology = run.topology
    cuda = any(d.startswith("cuda") for d in (*topology.target_devices, *topology.drafter_devices))
    rows = known_devices(devices_file)
    gpu = None
    if cuda:
        if name is None:
            raise PlanError(f"{run.label}: topology names CUDA devices: say which GPU with --device ({_known(rows)})")
        gpu = rows.get(name.lower())
        if gpu is None:
            raise PlanError(
                f"--device {name}: not in the device table ({_known(rows)}); add it with --devices FILE, a YAML "
                f"mapping {name}: {{{', '.join(DEVICE_KEYS)}}} from its datasheet or a measurement"
            )
    on_cpu = any(not d.startswith("cuda") for d in (*topology.target_devices, *topology.drafter_devices))
    cpu = this_cpu(root) if on_cpu else None

    def device(names: tuple[str, ...]) -> Device:
        return gpu if names[0].startswith("cuda") else cpu

    return DeviceChoice(device(topology.target_devices), device(topology.drafter_devices), _cores())


def _cores() -> int:
    return thread_budget({"plan": 1}).cores


def _known(rows: dict[str, Device]) -> str:
    return "known: " + ", ".join(d.name for d in rows.values())


# -- the data's size -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSize:
    samples: int
    tokens_per_sample: float
    source: str


def data_size(run: Run, root: Path) -> DataSize:
    """data.num_samples, at the mean sample length that tokenize measured (metrics/tokenize.json), else assumed
    to fill a training row. Measured only for params.yaml's sources: a profile's own data is assumed."""
    path = root / TOKENIZE_METRICS
    try:
        if "data.sources" in run.overrides:
            raise ValueError("not the data tokenize measured")
        measured = read_record_at(path)  # tokens: in its detail file
        mean = measured["tokens"] / measured["samples_out"]
        source = f"measured here: {TOKENIZE_METRICS} (tokens / samples_out, for params.yaml's data)"
    except (DflashpipeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        mean = min(run.model.seq_len, run.tokenize.max_length)
        source = "assumed: every sample fills a training row (no metrics/tokenize.json here for this data)"
    return DataSize(run.data.num_samples, float(mean), source)
