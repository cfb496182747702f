"""The features stage: bring data/features to one shard of the target's hidden states per token shard.

The format, its reuse check and the reader train uses are features/shards.py; this module computes
and writes them under the incremental protocol (dflashpipe.core.incremental): a shard is reused only under the key
it was written for (every dep and param dvc.yaml lists for the stage, less data/tokens, plus its own token
shard's sha256) and only if it hashes to what it stored, so growing the data computes only the new shards.
Before computing anything it checks that the disk holds what it is about to write.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.incremental import SUMMARY_FILE, InputShard, ShardedOutput
from dflashpipe.features.packing import collate, pack_rows
from dflashpipe.features.shards import (
    FeatureLayout,
    kept_lengths,
    refuse_distillation,
    shard_name,
    stored_shard,
    write_shard,
)
from dflashpipe.target.hidden_states import target_layer_features

if TYPE_CHECKING:
    from dflashpipe.core.params import ModelParams
    from dflashpipe.core.pipeline import StageKey
    from dflashpipe.tokens.shards import TokenData

ROWS_PER_FORWARD = 4
"""Packed rows per target forward: 4 x 512 tokens keeps the CPU's matmuls large and the activations small."""


@dataclass
class FeaturesRun:
    summary: dict
    computed_shards: list[str]
    reused_shards: list[str]
    computed_tokens: int
    seconds: float
    forward_rates: list[float] = field(default_factory=list)
    """Tokens/s of each target forward: the repeats of the rate."""


def shard_features(
    target, data: TokenData, shard: int, layout: FeatureLayout, bar: tqdm | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Token shard `shard`'s features [tokens, width] in the layout's dtype and per-sequence offsets, with each
    forward's rate."""

    first, end = int(data.starts[shard]), int(data.starts[shard + 1])
    kept = kept_lengths(data.lengths[first:end], layout.seq_len)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(kept)]).astype(np.int64))
    out = torch.zeros(int(offsets[-1]), layout.width, dtype=layout.torch_dtype)
    rows = pack_rows(range(first, end), data.lengths, layout.seq_len)
    rates = []
    device = target.device
    for k in range(0, len(rows), ROWS_PER_FORWARD):
        chunk = rows[k : k + ROWS_PER_FORWARD]
        # pad id 0: padding is its own document (-1) that no real token attends to, and its outputs are dropped
        batch = collate(data, chunk, layout.seq_len, 0)
        began = time.perf_counter()
        with torch.no_grad():
            feats = target_layer_features(
                target.model,
                batch.input_ids.to(device),
                batch.attention_mask.to(device),
                layout.layer_ids,
                batch.document_ids.to(device),
                batch.position_ids.to(device),
            ).to("cpu", layout.torch_dtype)
        real = sum(int(kept[i - first]) for row in chunk for i in row)
        rates.append(real / max(time.perf_counter() - began, 1e-9))
        for r, row in enumerate(chunk):
            at = 0
            for i in row:
                n, start = int(kept[i - first]), int(offsets[i - first])
                out[start : start + n] = feats[r, at : at + n]
                at += n
        if bar is not None:
            bar.update(real)
    return out, offsets, rates


def check_disk(out_dir: Path, needed: int) -> None:
    """Refuse before writing when the disk cannot hold the shards to compute (with 5% and 256 MB to spare)."""
    free = shutil.disk_usage(out_dir).free
    if needed * 1.05 + (256 << 20) > free:
        raise DflashpipeError(
            f"{out_dir}: the features to compute need about {needed / 1e9:.2f} GB and the disk has "
            f"{free / 1e9:.2f} GB free: free space, train on fewer samples, or set features.mode: online "
            f"(train then runs the target each batch and stores nothing)"
        )


def compute_features(
    mode: str,
    model: ModelParams,
    device: str,
    tokens_dir: Path | str,
    target_dir: Path | str,
    out_dir: Path | str,
    key: StageKey | None = None,
    target_dtype: str = "auto",
) -> FeaturesRun:
    """Bring `out_dir` to one features shard per token shard (none when `mode` is online), then summary.json,
    then files.json. `key`: the stage's reuse key (pipeline.reuse_key("features")); None reuses nothing.
    `target_dtype`: compute.target_dtype, what the target computes the features in and they are stored in."""
    from dflashpipe.tokens.shards import load_tokens

    began = time.perf_counter()
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    if mode == "online":  # nothing to store: train runs the target itself
        output: ShardedOutput[dict] = ShardedOutput.open(out_dir, {}, key, stored_shard)
        summary = {"mode": mode, "shards": []}
        output.finish(summary)
        return FeaturesRun(summary, [], [], 0, time.perf_counter() - began)
    refuse_distillation(model)
    data = load_tokens(tokens_dir)
    token_entries = json.loads((tokens_dir / SUMMARY_FILE).read_text())["shards"]
    names = [shard_name(e["file"]) for e in token_entries]
    output = ShardedOutput.open(
        out_dir,
        {n: InputShard(e["file"], e["sha256"]) for n, e in zip(names, token_entries, strict=True)},
        key,
        stored_shard,
    )
    from transformers import AutoConfig

    from dflashpipe.target.dtype import compute_dtype

    layout = FeatureLayout.of(AutoConfig.from_pretrained(target_dir), model, compute_dtype(device, target_dtype))
    todo = [i for i, n in enumerate(names) if n in set(output.todo)]

    def kept(i: int) -> int:
        return int(kept_lengths(data.lengths[int(data.starts[i]) : int(data.starts[i + 1])], layout.seq_len).sum())

    todo_tokens = sum(kept(i) for i in todo)
    check_disk(out_dir, todo_tokens * layout.bytes_per_token)
    rates: list[float] = []
    if todo:
        from dflashpipe.core.threads import thread_budget
        from dflashpipe.target.adapter import Target

        thread_budget({"target": 1}).apply("target", device)  # one computing thread: every core it may use
        target = Target.load(target_dir, device, target_dtype)
        with tqdm(total=todo_tokens, desc="features", unit="tok", unit_scale=True, mininterval=1.0) as bar:
            for i in todo:
                features, offsets, shard_rates = shard_features(target, data, i, layout, bar)
                rates += shard_rates
                record = {"sequences": len(offsets) - 1, "tokens": len(features), "layout": layout.to_json()}
                meta = {"key": output.keys[names[i]], "input": output.inputs[names[i]].to_json(), "record": record}
                write_shard(out_dir / names[i], features, offsets, meta)
                output.wrote(names[i], record)
    tokens = sum(output.records[n]["tokens"] for n in names)
    summary = {
        "mode": mode,
        "layout": layout.to_json(),
        "tokens": tokens,
        "bytes": tokens * layout.bytes_per_token,
        "shards": output.entries(lambda record: record["sequences"]),
    }
    output.finish(summary)
    run = FeaturesRun(summary, sorted(output.run.written), output.run.reused, todo_tokens, 0.0, rates)
    run.seconds = time.perf_counter() - began
    print(f"features: computed {len(run.computed_shards)} shard(s), reused {len(run.reused_shards)}; {tokens} tokens")
    return run


def features_metrics(run: FeaturesRun) -> dict:
    from dflashpipe.core.spread import Spread

    s = run.summary
    return {
        "mode": s["mode"],
        "shards": len(s["shards"]),
        "computed_shards": len(run.computed_shards),
        "reused_shards": len(run.reused_shards),
        "tokens": s.get("tokens", 0),
        "bytes": s.get("bytes", 0),
        "bytes_per_token": FeatureLayout.from_json(s["layout"]).bytes_per_token if "layout" in s else 0,
        "computed_tokens": run.computed_tokens,
        "seconds": round(run.seconds, 3),
        **(
            Spread.of(run.forward_rates).record("tokens_per_s", digits=1)
            if run.forward_rates
            else {"tokens_per_s": 0.0}
        ),
    }
