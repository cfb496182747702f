"""The dtype the target computes in: decided once per device and kind of work, and every stage follows it."""

from __future__ import annotations

from typing import Any

import torch

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.kernels import WORK_KINDS, bfloat16_native, native_dtypes


def compute_dtype(device: Any, choice: str, kind: str = "batched") -> torch.dtype:
    """The dtype the target computes `kind` of work in (kernels.WORK_KINDS) on `device`, for
    `compute.target_dtype` = `choice`: `auto` is what the device computes natively for that kind
    (kernels.native_dtypes: bfloat16 on CUDA, and for batched work on a CPU with AMX or AVX512-BF16; float32
    elsewhere), which the fingerprint records as `target_dtype`, so every lock names the dtype its stage ran
    in; `float32`/`bfloat16` are that dtype for every kind.

    Written once, here: the loaded target, the features it hands the drafter, and bench's synthetic target
    all follow it, so they agree by construction. A device that cannot compute bfloat16 at all (a CUDA GPU
    before Ampere) is refused; a CPU without bfloat16 instructions computes it emulated, allowed but slow."""
    if kind not in WORK_KINDS:
        raise ValueError(f"kind of work {kind!r}: expected one of {WORK_KINDS}")
    device = torch.device(device)
    if choice == "auto":
        return getattr(torch, native_dtypes(device.type)[kind])
    if choice not in ("float32", "bfloat16"):
        raise ParamsError(f"params.yaml: compute.target_dtype = {choice!r}: expected auto, float32 or bfloat16")
    if choice == "bfloat16" and device.type == "cuda" and not bfloat16_native("cuda"):
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no CUDA device"
        raise ParamsError(
            f"params.yaml: compute.target_dtype = bfloat16: {device} ({name}) cannot compute bfloat16; it "
            f"supports float32: set compute.target_dtype to auto or float32"
        )
    return getattr(torch, choice)
