"""A stage's metrics as two files: the few figures a sweep compares, and the rest of its record.

DVC lists every key of a metrics file as a column of `dvc exp show` and a row of `dvc metrics diff`, so the file
dvc.yaml declares as a metric holds only what a sweep compares (`COMPARED`, headline first); the stage's whole
record less those keys goes to `detail_of(file)`, metrics/detail/<name>.json, an `outs:` with `cache: false`
(in git, never a DVC metric). `read_record` puts the two back together; a revision from before the split has no
detail file, and its metrics file, which then held everything, is the record.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflashpipe.core import revision
from dflashpipe.core.artifacts import canonical_json, write_bytes_atomic
from dflashpipe.core.pipeline import METRICS
from dflashpipe.core.revision import Workspace, read_json

DETAIL = METRICS / "detail"

COMPARED: dict[str, dict[str, str]] = {
    "manifest": {"train_samples": "train_samples", "eval_samples": "eval_samples"},
    "regenerate": {"tokens_per_s": "tokens_per_s", "replied": "accounting.replied"},
    "tokenize": {"supervised_tokens": "supervised_tokens", "samples_out": "samples_out"},
    "features": {"tokens_per_s": "tokens_per_s"},
    "train": {
        "tokens_per_s": "tokens_per_s",
        "final_loss": "final_loss",
        "steps": "steps",
        "heldout_tau": "heldout_acceptance.last.tau",
    },
    "bench": {"tokens_per_s": "tokens_per_s"},
    "proof": {"tau": "tau", "passed": "passed"},
    "eval_regression": {"verdict": "verdict", "worst": "worst", "worst_change": "worst_change"},
}
"""Per metrics file a stage writes through `write_metrics` (by `name_of`): its keys, in order, and the dotted key
of the stage's record each one copies."""


def name_of(metrics_file: Path | str) -> str:
    """A metrics file's name: its own (metrics/bench.json: bench), or its folder's (metrics/train/metrics.json)."""
    path = Path(metrics_file)
    return path.parent.name if path.stem == "metrics" else path.stem


def detail_of(metrics_file: Path | str) -> Path:
    """metrics/detail/<name>.json beside the metrics file (under the same metrics folder, wherever that lies)."""
    path = Path(metrics_file)
    folder = path.parent.parent if path.stem == "metrics" else path.parent
    return folder / DETAIL.name / f"{name_of(path)}.json"


def lookup(record: Any, dotted: str) -> Any:
    """The value at a dotted key of a nested record, None where any part is missing."""
    for part in dotted.split("."):
        record = record.get(part) if isinstance(record, Mapping) else None
    return record


def compared(metrics_file: Path | str, record: Mapping, name: str | None = None) -> dict:
    """What the metrics file keeps of `record`: the keys COMPARED names for it (by `name`, else `name_of` the file),
    in that order."""
    return {key: lookup(record, dotted) for key, dotted in COMPARED[name or name_of(metrics_file)].items()}


def metrics_bytes(metrics_file: Path | str, record: Mapping, name: str | None = None) -> dict[Path, bytes]:
    """What `write_metrics` writes, in its order: {detail file: the rest of the record, metrics file: the compared
    figures}."""
    lean = compared(metrics_file, record, name)
    # key order kept in the metrics file: the headline leads it, as DVC's tables show it
    text = json.dumps(lean, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    return {
        detail_of(metrics_file): canonical_json({k: v for k, v in record.items() if k not in lean}),
        Path(metrics_file): text.encode("utf-8"),
    }


def write_metrics(metrics_file: Path | str, record: Mapping, name: str | None = None) -> None:
    """Write the stage's record: the compared figures to `metrics_file`, the rest to its detail file (each
    atomically; the detail first, so a metrics file on disk always has its detail beside it). `name`: the stage's
    entry in COMPARED where the file's own name is not it (train's run inside the proof's scratch)."""
    for path, data in metrics_bytes(metrics_file, record, name).items():
        write_bytes_atomic(path, data)


def read_record(files, metrics_file: Path | str) -> dict | None:
    """A stage's whole record at `files` (a core.revision Revision or Workspace): its metrics file with its detail
    file; a revision from before detail files: the metrics file alone (it held everything). None: neither."""
    lean = read_json(files, Path(metrics_file).as_posix())
    detail = read_json(files, detail_of(metrics_file).as_posix())
    if lean is None and detail is None:
        return None
    return {**(detail or {}), **(lean or {})}


def read_record_at(metrics_file: Path | str) -> dict | None:
    """`read_record` of the files on disk (`metrics_file` relative to the working directory, or absolute)."""
    return read_record(Workspace("."), metrics_file)


def read_metrics(files, metrics_file: str) -> dict[str, Any]:
    """`revision.read_metrics` of the whole record: a JSON metrics file with its detail file, flattened to dotted
    keys, so what explain, history and rerun compare (and the spreads they judge it by) is the same on either side
    of the split."""
    if not metrics_file.endswith(".json"):
        return revision.read_metrics(files, metrics_file)
    found = read_record(files, metrics_file)
    return {} if found is None else revision.flatten(found)
