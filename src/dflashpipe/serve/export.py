"""`dflashpipe export DIR`: the project's drafter as a server reads it (`served_files`), with its model card and
files.json beside it, for handing on."""

from __future__ import annotations

from pathlib import Path

from dflashpipe.core.errors import SourceError
from dflashpipe.core.pipeline import DRAFTER
from dflashpipe.serve.served_files import write_served_files


def export_drafter(out_dir: Path | str, root: Path | str = ".") -> Path:
    """The project's data/drafter (checked against its files.json first) as a server reads it, in `out_dir`, with a
    card that also names the git revision, dvc.lock's sha256 and tau/speedup from metrics/eval.json, and a
    files.json of what was written."""
    from dflashpipe.core.artifacts import atomic_directory, verify_file_listing, write_file_listing
    from dflashpipe.core.pipeline import EVAL_DETAIL, EVAL_METRICS, TARGET, TOKENS
    from dflashpipe.train.card import LOCK_FILE, provenance, read_json, write_model_card

    root = Path(root)
    drafter = root / DRAFTER
    verify_file_listing(drafter, f"restore it with `dvc checkout {DRAFTER}` or rerun `dvc repro train`", SourceError)
    if not (root / LOCK_FILE).is_file():
        raise SourceError(f"{root / LOCK_FILE} not found: run `dvc repro` before exporting")
    # the detail holds the card's setup and rates; a revision from before it kept them in metrics/eval.json
    evaluation = read_json(root / EVAL_DETAIL) or read_json(root / EVAL_METRICS) or None
    with atomic_directory(Path(out_dir)) as tmp:
        write_served_files(drafter, root / TARGET, tmp)
        write_model_card(
            tmp,
            target_dir=root / TARGET,
            tokens_dir=root / TOKENS,
            params=trained_params(root),
            origin=provenance(root),
            evaluation=evaluation,
        )
        write_file_listing(tmp)
    return Path(out_dir)


def trained_params(root: Path) -> dict:
    """train's params as dvc.lock records them, with the dtype its record says it learnt in (the card's serve line)."""
    from dflashpipe.core.metrics import read_record_at
    from dflashpipe.core.pipeline import TRAIN_METRICS
    from dflashpipe.train.card import locked_train_params

    params = locked_train_params(root)
    record = read_record_at(root / TRAIN_METRICS) or {}
    if "target_dtype" in record:
        params["compute"] = {**params.get("compute", {}), "trained_in": record["target_dtype"]}
    return params
