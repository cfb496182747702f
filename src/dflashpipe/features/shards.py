"""The features shard format: its writer, when an existing shard may be reused, and the reader training uses.

What is stored, for each sequence of a token shard, is exactly what the online trainer hands the
drafter for it: the chosen layers' hidden states (`dflashpipe.target.hidden_states.target_layer_features`) of its
first `model.seq_len` tokens (train cuts a longer sequence there), the document attending only
within itself, computed and stored in the target's compute dtype (compute.target_dtype), the numerics decoding
hands the drafter too (bfloat16 on a GPU: 2 bytes x layers x hidden a token, 40 KB on Qwen3-8B with 5 layers, which
is why the 8-GPU profile stays online; float32 on a CPU). Sequences are packed into rows of `seq_len` to compute
them, as train packs them (dflashpipe.features.packing); each document sees only itself, so how they were packed
does not decide what is stored for it.

A shard is a safetensors file: `features` [tokens, layers x hidden] in the layout's dtype and `offsets`
[sequences + 1] int64, with the key, the input token shard, the layout and the sha256 of both
tensors in its metadata. It follows the incremental protocol (dflashpipe.core.incremental): a shard is
reused only under the key it was written for and only if it hashes to what it stored, so growing
the data computes only the new shards and any edit to what dvc.yaml lists for the stage recomputes
them all. Train maps the shards (safetensors reads slices of the mapped file) after checking every
file against files.json and each shard's layout and input against the drafter and the token shards.
Training depends on this file alone of the stage (dvc.yaml), as it does on tokens/shards.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflashpipe.core.artifacts import verify_file_listing, write_shard_atomic
from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.tokens.shards import SUMMARY_FILE

if TYPE_CHECKING:
    from dflashpipe.core.params import ModelParams
    from dflashpipe.tokens.shards import TokenData

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
METADATA_KEY = "dflashpipe.features"
FIX = "run `dvc repro features`"


@dataclass(frozen=True)
class FeatureLayout:
    """What one token's stored features are: which target layers, how wide each, cut at which length."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    seq_len: int
    dtype: str = "bfloat16"
    """The target's compute dtype, stored as computed."""

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {**asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_json(cls, raw: dict) -> FeatureLayout:
        return cls(tuple(int(i) for i in raw["layer_ids"]), int(raw["hidden_size"]), int(raw["seq_len"]), raw["dtype"])

    @classmethod
    def of(cls, target_config: Any, model: ModelParams, dtype: torch.dtype) -> FeatureLayout:
        """The layout the drafter that `model` describes reads from this target computing in `dtype`."""
        from dflashpipe.model.config import target_layer_ids_for, text_config

        ids = target_layer_ids_for(target_config, model)
        return cls(tuple(ids), text_config(target_config).hidden_size, model.seq_len, str(dtype).removeprefix("torch."))


def refuse_distillation(model: ModelParams) -> None:
    """Offline features are the drafter's layers only; a distilling drafter also reads the target's final
    states at every slot, which only the online forward gives."""
    if model.distill != "none":
        raise ParamsError(
            f"params.yaml: features.mode = offline stores the drafter's layers only, but model.distill = "
            f"{model.distill!r} also needs the target's final states at every slot: use features.mode: online"
        )


def shard_name(input_file: str) -> str:
    """The shard made from the input shard `input_file`: its name, so a source's shards keep theirs."""
    return f"{Path(input_file).stem}.safetensors"


def kept_lengths(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Tokens stored per sequence: train cuts a sequence at seq_len, so nothing past it is ever read."""
    return np.minimum(lengths, seq_len).astype(np.int64)


def _tensors_sha256(features: torch.Tensor, offsets: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(offsets.numpy()))
    h.update(np.ascontiguousarray(features.view({2: torch.int16, 4: torch.int32}[features.element_size()]).numpy()))
    return h.hexdigest()


def write_shard(path: Path, features: torch.Tensor, offsets: torch.Tensor, meta: dict) -> None:
    from safetensors.torch import save

    meta = {**meta, "content_sha256": _tensors_sha256(features, offsets)}
    write_shard_atomic(path, save({"features": features, "offsets": offsets}, {METADATA_KEY: json.dumps(meta)}))


@dataclass(frozen=True)
class StoredFeatures:
    """A shard read back for the reuse check (a `dflashpipe.core.incremental.StoredShard` by shape)."""

    path: Path
    meta: dict

    @property
    def key(self) -> str | None:
        return self.meta.get("key")

    @property
    def record(self) -> dict:
        return self.meta["record"]

    def intact(self) -> bool:
        from safetensors import safe_open

        with safe_open(str(self.path), "pt") as f:
            return _tensors_sha256(f.get_tensor("features"), f.get_tensor("offsets")) == self.meta["content_sha256"]


def read_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {})[METADATA_KEY])


def stored_shard(path: Path) -> StoredFeatures:
    return StoredFeatures(path, read_meta(path))


# --- the reader train uses ---------------------------------------------------------------------


@dataclass
class FeatureStore:
    """data/features mapped for training: the stored features of any packed row, laid out as collate lays out
    its tokens. Built only by `load`, which checks everything against the drafter and the token shards."""

    layout: FeatureLayout
    handles: list[Any]
    """One open safetensors file per token shard, in order."""
    offsets: list[np.ndarray]
    starts: np.ndarray
    """TokenData.starts: the global index of each shard's first sequence."""

    @classmethod
    def load(cls, features_dir: Path | str, tokens_dir: Path | str, data: TokenData, layout: FeatureLayout):
        from safetensors import safe_open

        features_dir, tokens_dir = Path(features_dir), Path(tokens_dir)
        verify_file_listing(features_dir, FIX, SourceError)
        summary = json.loads((features_dir / SUMMARY_FILE).read_text())
        if summary.get("mode") != "offline":
            raise SourceError(f"{features_dir}: built with features.mode {summary.get('mode')!r}, not offline: {FIX}")
        token_entries = json.loads((tokens_dir / SUMMARY_FILE).read_text())["shards"]
        entries = summary["shards"]
        if len(entries) != len(token_entries):
            raise SourceError(
                f"{features_dir}: {len(entries)} features shards for {len(token_entries)} token shards: {FIX}"
            )
        handles, offsets = [], []
        for k, (entry, tokens) in enumerate(zip(entries, token_entries, strict=True)):
            path = features_dir / entry["file"]
            if Path(entry["file"]).name != entry["file"]:
                raise SourceError(f"{features_dir / SUMMARY_FILE}: lists {entry['file']!r}, not a file name: {FIX}")
            handle = safe_open(str(path), "pt")
            meta = json.loads((handle.metadata() or {})[METADATA_KEY])
            found = FeatureLayout.from_json(meta["record"]["layout"])
            shape = handle.get_slice("features").get_shape()
            kept = kept_lengths(data.lengths[int(data.starts[k]) : int(data.starts[k + 1])], layout.seq_len)
            want = [int(kept.sum()), layout.width]
            stored = handle.get_slice("features").get_dtype()
            if found != layout or list(shape) != want or stored != SAFETENSORS_DTYPES[layout.dtype]:
                raise SourceError(
                    f"{path}: features of shape {list(shape)} ({stored}) for target layers {list(found.layer_ids)} cut "
                    f"at {found.seq_len} tokens, but the drafter reads {want} ({SAFETENSORS_DTYPES[layout.dtype]}) for "
                    f"layers {list(layout.layer_ids)} cut at {layout.seq_len}: {FIX}"
                )
            if meta["input"]["sha256"] != tokens["sha256"]:
                raise SourceError(f"{path}: computed from another {tokens['file']} than data/tokens holds: {FIX}")
            shard_offsets = handle.get_tensor("offsets").numpy()
            if not np.array_equal(np.diff(shard_offsets), kept):
                raise SourceError(f"{path}: its sequences' lengths differ from {tokens['file']}'s: {FIX}")
            handles.append(handle)
            offsets.append(shard_offsets)
        return cls(layout, handles, offsets, data.starts)

    def rows(self, rows: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        """[B, seq_len, width] in `dtype`: each row's sequences' features one after another, zeros after."""
        out = torch.zeros(len(rows), self.layout.seq_len, self.layout.width, dtype=dtype)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                k = int(np.searchsorted(self.starts, i, side="right")) - 1
                j = i - int(self.starts[k])
                start, end = int(self.offsets[k][j]), int(self.offsets[k][j + 1])
                out[r, at : at + end - start] = self.handles[k].get_slice("features")[start:end]
                at += end - start
        return out
