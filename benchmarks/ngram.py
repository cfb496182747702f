"""What the anchor token alone predicts: an n-gram table's next-token accuracy, beside the drafter's.

    python benchmarks/ngram.py [--tokens data/tokens] [--train-samples 270 1500]
        [--train-metrics metrics/train/metrics.json]

A DFlash drafter's slot 1 predicts the token after the anchor, and it sees the anchor. So a table of the
most frequent next token after each token (bigram) or pair of tokens (trigram, backing off to the bigram,
then the unigram), counted on training samples, is a floor that a drafter which reads its anchor should
pass. The table is counted on the first N samples of the training shards after the first and scored on
the first shard's supervised tokens (held out from the table); N = the samples a training run reads
(max_steps x rows x seq_len / tokens per sample) says what the same data could teach. The drafter's own
slot-1 training accuracy is printed beside it from train's record (metrics/detail/train.json) when present.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402

from dflashpipe.core.metrics import read_record_at  # noqa: E402
from dflashpipe.tokens.shards import read_shard  # noqa: E402


def samples(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    batch, _ = read_shard(path)
    ids, mask = batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist()
    return [(np.asarray(i), np.asarray(m, dtype=bool)) for i, m in zip(ids, mask, strict=True)]


def pairs(rows, context: int):
    """(the `context` tokens before, the supervised token after) for every supervised token with that many before it."""
    for ids, mask in rows:
        for j in range(context, len(ids)):
            if mask[j]:
                yield tuple(ids[j - context : j].tolist()), int(ids[j])


def table(rows, context: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for before, after in pairs(rows, context):
        counts[before][after] += 1
    return {before: c.most_common(1)[0][0] for before, c in counts.items()}


def accuracy(train, test, n: int) -> float:
    """An n-gram table's accuracy on `test` (n - 1 tokens of context), backing off to shorter contexts."""
    tables = [table(train, c) for c in range(n)]  # tables[c]: c tokens of context; tables[0]: the unigram
    hits = total = 0
    for before, after in pairs(test, n - 1):
        c = next(c for c in range(n - 1, -1, -1) if before[len(before) - c :] in tables[c])
        hits += tables[c][before[len(before) - c :]] == after
        total += 1
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("data/tokens"))
    ap.add_argument("--train-samples", type=int, nargs="+", default=[270, 1500])
    ap.add_argument("--train-metrics", type=Path, default=Path("metrics/train/metrics.json"))
    args = ap.parse_args()
    shards = sorted(args.tokens.glob("train-*.arrow"))
    if len(shards) < 2:
        raise SystemExit(f"{args.tokens}: needs two training shards or more (one held out); run `dvc repro tokenize`")
    test = samples(shards[0])
    pool = [s for shard in shards[1:] for s in samples(shard)]
    out = {"held_out_samples": len(test), "unigram": round(accuracy(pool, test, 1), 4)}
    for n in args.train_samples:
        train = pool[:n]
        out[f"bigram_{len(train)}"] = round(accuracy(train, test, 2), 4)
        out[f"trigram_{len(train)}"] = round(accuracy(train, test, 3), 4)
    record = read_record_at(args.train_metrics)  # slot_accuracy is in its detail file
    if record is not None:
        out["drafter_slot_1_training_accuracy"] = (record.get("slot_accuracy") or {}).get("1")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
