"""Training on several machines through one `dvc repro`.

DVC holds the repository's lock while a stage runs and records the run of the machine it ran on, so a
run of `topology.nodes` machines is one `dvc repro` on the head node and a plain torchrun agent on each other:

1. The train stage on the head, not yet a torchrun worker, prints first the command each other node runs,
   then starts the head's own agent in its process, as node 0; that agent's one worker runs the stage.
2. The agents meet at torchrun's static rendezvous, a store on the head. Static, not c10d: c10d ranks nodes
   by hostname and process id, while a node rank given on the command line makes the head rank 0, the one
   process that writes outputs and checkpoints, so DVC records the head's run and nothing else is written.
3. Each worker's train key (every dep and param of the stage, and the process count) must equal rank 0's
   before any step: a node whose checkout has other inputs stops every node, naming what differs.
4. A node that has not joined within the timeout stops the head with one line; nothing is written.
5. A worker ends with its agent: killed with the head's stage (DVC interrupted), it must not train on and
   write outputs that no `dvc repro` will record.

Where the head listens and how long it waits decide nothing of the drafter, so they come from the
environment (`DFLASHPIPE_RENDEZVOUS`, `DFLASHPIPE_RENDEZVOUS_TIMEOUT`), not params.yaml: a run moved to
another head reruns nothing and still resumes its checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import threading
import time
from dataclasses import dataclass

import torch

from dflashpipe.core.errors import DflashpipeError, ParamsError
from dflashpipe.core.pipeline import StageKey
from dflashpipe.model import DraftLoss
from dflashpipe.train.topology import Topology
from dflashpipe.train.workers import StepResult

RENDEZVOUS_ENV = "DFLASHPIPE_RENDEZVOUS"
TIMEOUT_ENV = "DFLASHPIPE_RENDEZVOUS_TIMEOUT"
DEFAULT_PORT = 29500
DEFAULT_TIMEOUT_S = 600  # torchrun's own
INPUTS = "docs/pipeline.md#many-nodes"
"""Where a user reads how the other nodes get the head's inputs."""


class RendezvousError(DflashpipeError):
    """The head's agent could not gather the other nodes."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the head's agent listens (and the others connect), and how long it waits for them."""

    host: str
    port: int
    timeout_s: int

    @classmethod
    def from_env(cls) -> Rendezvous:
        """`DFLASHPIPE_RENDEZVOUS` (HOST or HOST:PORT; default this machine's name, port 29500) and
        `DFLASHPIPE_RENDEZVOUS_TIMEOUT` (seconds; default 600)."""
        raw = os.environ.get(RENDEZVOUS_ENV, "").strip() or socket.getfqdn()
        host, _, port = raw.rpartition(":") if ":" in raw else (raw, "", str(DEFAULT_PORT))
        timeout = os.environ.get(TIMEOUT_ENV, "").strip() or str(DEFAULT_TIMEOUT_S)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RendezvousError(f"{RENDEZVOUS_ENV}={raw!r}: expected HOST or HOST:PORT (a port 1-65535)")
        if not timeout.isdigit() or int(timeout) == 0:
            raise RendezvousError(f"{TIMEOUT_ENV}={timeout!r}: expected a whole number of seconds, at least 1")
        return cls(host, int(port), int(timeout))

    def agent_args(self, nodes: int, node_rank: int, script: str) -> list[str]:
        """torchrun's arguments for node `node_rank` of `nodes`, one process each, running `script`."""
        return [
            *("--nnodes", str(nodes), "--nproc-per-node", "1", "--node-rank", str(node_rank)),
            *("--master-addr", self.host, "--master-port", str(self.port), "--rdzv-conf", f"timeout={self.timeout_s}"),
            script,
        ]


def is_worker() -> bool:
    """Whether this process is a torchrun worker (a process of a run), not the stage that DVC started."""
    return "WORLD_SIZE" in os.environ


def launch(nodes: int, script: str) -> None:
    """The head's part of a run of `nodes` machines: print each other node's command, then run this node's
    agent (node 0) until its worker, rank 0, has trained and written the outputs. `script`: the stage's
    script, relative to the project root, where every node starts."""
    rendezvous = Rendezvous.from_env()
    where = f"{rendezvous.host}:{rendezvous.port}"
    print(
        f"train: topology.nodes is {nodes}: this is node 0, waiting {rendezvous.timeout_s} s at {where} for the "
        f"others; on each, in a checkout with this one's inputs ({INPUTS}), run:",
        flush=True,
    )
    for k in range(1, nodes):
        print(f"train: node {k}: {shlex.join(['torchrun', *rendezvous.agent_args(nodes, k, script)])}", flush=True)

    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(rendezvous.agent_args(nodes, 0, script)))
    except DistStoreError as exc:  # the store's wait for the agents ran out: "... 1/2 clients joined."
        joined = re.search(r"(\d+)/\d+ clients joined", str(exc))
        raise RendezvousError(
            f"{joined.group(1) if joined else 'not all'} of {nodes} nodes joined at {where} within "
            f"{rendezvous.timeout_s} s ({TIMEOUT_ENV}): start the command printed above on each other node; "
            f"nothing was written"
        ) from None
    except DistNetworkError as exc:
        raise RendezvousError(
            f"cannot listen at {where} ({str(exc).splitlines()[0]}): set {RENDEZVOUS_ENV}=HOST:PORT to an "
            f"address of this node that the others reach, at a free port"
        ) from None
    except ChildFailedError as exc:  # the worker has said why, as a stage does
        raise SystemExit(exc.get_first_failure()[1].exitcode or 1) from None


def join(topology: Topology, nodes: int, key: StageKey | None) -> None:
    """Make this process one of the run's `nodes` (`topology.world_size` > 1) and refuse, on every process, a run
    whose processes hold other train keys than rank 0's: their data or params differ, and so would their steps."""
    if topology.world_size != nodes:  # one process a node: the count decides the global batch, so it is a param
        raise ParamsError(
            f"params.yaml: topology.nodes is {nodes}, but this run has {topology.world_size} process(es) (torchrun's "
            f"WORLD_SIZE): start train with `dvc repro` on one node, and each other node with the command it prints"
        )
    if topology.world_size == 1:
        return
    _end_with_agent()
    import torch.distributed as dist

    dist.init_process_group("nccl" if topology.drafters[0].type == "cuda" else "gloo")
    if key is None:
        return
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")  # to gather bytes on the CPU
    keys = [StageKey.from_json(json.loads(text)) for text in all_gathered(json.dumps(key.to_json()), group)]
    for rank, other in enumerate(keys):
        if other is None or other.digest != keys[0].digest:
            differs = other.changes_since(keys[0], shown=3) if other else "an unreadable key"
            raise DflashpipeError(
                f"node {rank}'s train inputs differ from node 0's ({differs}): every node needs the head's "
                f"checkout and data ({INPUTS}); nothing was written"
            )


def _end_with_agent(poll_s: float = 1.0) -> None:
    """Exit this worker once its agent (the parent process) is gone: torchrun's workers outlive a SIGKILLed agent."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        os._exit(1)  # no cleanup that could write: what this process made is the killed run's

    threading.Thread(target=watch, name="end-with-agent", daemon=True).start()


def all_gathered(text: str, group) -> list[str]:
    """`text` of every process, by rank: bytes in tensors, since gathering objects would unpickle peers' data."""
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group)
    longest = max(int(s) for s in sizes)
    texts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(texts, torch.nn.functional.pad(mine, (0, longest - mine.numel())), group=group)
    return [t[: int(s)].numpy().tobytes().decode() for t, s in zip(texts, sizes, strict=True)]


def every_replica(results: list[StepResult], device: torch.device) -> list[StepResult]:
    """Every replica's result of a step, by global replica (this process's alone outside torchrun), gathered on
    `device` (the backend's): a step's record is then the run's, the very numbers that one process holding all
    the replicas records, not the head's share of them."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return results
    terms = results[0].loss_terms
    sizes = [t.numel() for t in terms] + [1, 1]  # the loss terms, truncated, padding_fraction

    def flat(res: StepResult) -> torch.Tensor:
        parts = [*res.loss_terms, torch.tensor([res.truncated, res.padding_fraction], dtype=torch.float64)]
        return torch.cat([t.detach().to(device, torch.float64).reshape(-1) for t in parts])

    mine = torch.stack([flat(res) for res in results])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    gathered = []
    for row in (row.cpu() for rows in every for row in rows):
        *loss, truncated, padding = row.split(sizes)
        loss_terms = DraftLoss(*(part.to(t.dtype).reshape(t.shape) for part, t in zip(loss, terms, strict=True)))
        gathered.append(StepResult(loss_terms, int(truncated.item()), padding.item()))
    return gathered
