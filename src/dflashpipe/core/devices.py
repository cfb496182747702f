"""The GPUs our users rent, as their vendor publishes them: dense peak rates, memory and the link to the
node's other GPUs, each row with its source.

One table for two readers: train's MFU (train/flops.py matches a row on `torch.cuda.get_device_name`) and
`dflashpipe plan` (a row named on its command line). A CPU is not here: its rate is measured on the machine
that plans (dflashpipe.commands.plan.inputs). Tensor-core figures are the datasheets' dense ones (NVIDIA quotes them
"with sparsity": half of that); the link is one way (the datasheets quote both directions added).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator: what a plan computes memory and time against."""

    name: str
    """What a user names it: `dflashpipe plan --device H100`."""
    match: str
    """A substring of `torch.cuda.get_device_name` that identifies it (rows are tried in table order)."""
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    fp32_flops: float
    """Dense fp32 peak without tensor cores, FLOP/s (what a float32 CPU-style step could use)."""
    memory_bytes: float
    link_bytes_per_s: float | None
    """One way, from this device to another of its node; None: one memory for every worker (a CPU)."""
    source: str
    """Where the figures come from: a published datasheet, or a measurement on this machine."""

    def peak(self, dtype: str) -> float:
        """The peak for a compute dtype: bf16 tensor cores, or fp32."""
        return self.bf16_flops if dtype == "bfloat16" else self.fp32_flops


H100_SHEET = "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/"
PUBLISHED = (
    # The PCIe and NVL variants name themselves in torch's device name: before the plain "H100" row.
    Device("H100-PCIe", "H100 PCIe", 756e12, 51e12, 80 * GB, 64 * GB, f"{H100_SHEET} (PCIe Gen5: 128 GB/s both ways)"),
    Device("H100-NVL", "H100 NVL", 835e12, 60e12, 94 * GB, 300 * GB, f"{H100_SHEET} (NVLink bridge: 600 GB/s)"),
    Device("H100", "H100", 989e12, 67e12, 80 * GB, 450 * GB, f"{H100_SHEET} (SXM5; NVLink: 900 GB/s)"),
    Device(
        "H200",
        "H200",
        989e12,
        67e12,
        141 * GB,
        450 * GB,
        "NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ (SXM; NVLink: 900 GB/s)",
    ),
    Device(
        "H800",
        "H800",
        989e12,
        67e12,
        80 * GB,
        200 * GB,
        "NVIDIA H800 SXM5 product brief (the H100 SXM5 die; NVLink cut to 400 GB/s)",
    ),
    Device(
        "B200",
        "B200",
        2250e12,
        75e12,
        180 * GB,
        900 * GB,
        "NVIDIA HGX B200 datasheet, https://www.nvidia.com/en-us/data-center/hgx/ (per GPU; NVLink 5: 1.8 TB/s)",
    ),
    Device(
        "A100",
        "A100",
        312e12,
        19.5e12,
        80 * GB,
        300 * GB,
        "NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ (80 GB SXM; NVLink 3: 600 GB/s)",
    ),
    Device(
        "L40S",
        "L40S",
        362e12,
        91.6e12,
        48 * GB,
        32 * GB,
        "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/ (no NVLink; PCIe Gen4: 64 GB/s)",
    ),
    Device(
        "RTX-4090",
        "RTX 4090",
        165e12,
        82.6e12,
        24 * GB,
        32 * GB,
        "NVIDIA Ada Lovelace whitepaper (RTX 4090: bf16 with fp32 accumulate; PCIe Gen4: 64 GB/s)",
    ),
)
"""Published devices, in the order their `match` is tried."""


def published(name: str) -> Device | None:
    """The row a user names (case-insensitive), or None."""
    return next((d for d in PUBLISHED if d.name.lower() == name.lower()), None)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the row that `torch.cuda.get_device_name` output matches; None for none."""
    return next((d.bf16_flops for d in PUBLISHED if d.match in device_name), None)
