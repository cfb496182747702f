"""Devices for the target workers and the drafter replicas, checked before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params import TopologyParams
from dflashpipe.core.threads import ThreadBudget, training_budget


@dataclass(frozen=True)
class Topology:
    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]
    rank: int
    world_size: int

    @property
    def replicas(self) -> int:
        return len(self.drafters)


def check_topology(params: TopologyParams) -> Topology:
    """Every device must exist here; `WORLD_SIZE`/`RANK` (torchrun) make this one process of many."""
    available = torch.cuda.device_count()
    for key, names in (("target_devices", params.target_devices), ("drafter_devices", params.drafter_devices)):
        for name in names:
            if name.startswith("cuda") and int(name.partition(":")[2] or 0) >= available:
                raise ParamsError(
                    f"params.yaml: topology.{key} names {name!r}, but this machine has {available} CUDA device(s)"
                    + ("" if available else ": use [cpu] here, or run on a GPU machine")
                )
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return Topology(
        tuple(torch.device(d) for d in params.target_devices),
        tuple(torch.device(d) for d in params.drafter_devices),
        rank,
        world_size,
    )


def train_threads(topology: Topology) -> ThreadBudget:
    """The process's cores shared by the target and drafter threads that compute on the CPU (core.threads)."""
    return training_budget([d.type for d in topology.targets], [d.type for d in topology.drafters])
