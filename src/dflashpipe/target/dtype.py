"""The dtype the target computes in, decided once per device: every stage that runs the target follows it."""

from __future__ import annotations

from typing import Any

import torch


def compute_dtype(device: Any, choice: str) -> torch.dtype:
    """The dtype the target computes in on `device` for `compute.target_dtype` = `choice`: `auto` is
    bfloat16 on CUDA and float32 elsewhere; `float32`/`bfloat16` are that dtype everywhere.

    Written once, here: the loaded target, the features it hands the drafter, and bench's synthetic
    target all follow it, so they agree by construction. `auto` keeps float32 on a CPU even where it
    computes bfloat16 natively: there bfloat16 is faster but changes about half the greedy replies
    (docs/pipeline.md), and a newcomer's first run should not depend on which CPU it met."""
    if choice == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if choice not in ("float32", "bfloat16"):
        raise ValueError(f"compute.target_dtype = {choice!r}: expected auto, float32 or bfloat16")
    return getattr(torch, choice)
