"""The dtype the target computes in: decided once per device, and every stage follows it."""

from __future__ import annotations

from typing import Any

import torch

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.kernels import bfloat16_native, native_dtype


def compute_dtype(device: Any, choice: str) -> torch.dtype:
    """The dtype the target computes in on `device` for `compute.target_dtype` = `choice`: `auto` is
    kernels.native_dtype (bfloat16 on a CUDA GPU that computes it, float32 on every CPU), which the fingerprint
    records as `target_dtype`, so every lock names the dtype its stage ran in.

    Written once, here, with no kind of work: the replies, the features, the trainer's borrowed modules, evaluate's
    and the served check's decoding all compute in it, so what the drafter learns from is what it is judged on. A
    device that cannot compute bfloat16 at all (a CUDA GPU before Ampere) is refused; a CPU without bfloat16
    instructions computes it emulated, allowed but slow."""
    device = torch.device(device)
    if choice == "auto":
        return getattr(torch, native_dtype(device.type))
    if choice not in ("float32", "bfloat16"):
        raise ParamsError(f"params.yaml: compute.target_dtype = {choice!r}: expected auto, float32 or bfloat16")
    if choice == "bfloat16" and device.type == "cuda" and not bfloat16_native("cuda"):
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no CUDA device"
        raise ParamsError(
            f"params.yaml: compute.target_dtype = bfloat16: {device} ({name}) cannot compute bfloat16; it "
            f"supports float32: set compute.target_dtype to auto or float32"
        )
    return getattr(torch, choice)
