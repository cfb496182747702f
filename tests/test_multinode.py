"""Multi-node training as docs/pipeline.md launches it, on one machine: two `torchrun` agents (`--nnodes 2`) meet
through c10d rendezvous on 127.0.0.1 and train one replica each over gloo; the drafter is bit for bit the one a
single process trains with both replicas. Each run also records which side bound it (metrics `balance`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.test_train import SCRIPT, assert_same_weights, config, train, weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(workdir, cfg) -> list[subprocess.CompletedProcess]:
    """Two agents, as two machines would start them: same command, same rendezvous endpoint and id."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        cfg["name"],
        str(SCRIPT),
        str(workdir),
        json.dumps(cfg),
    ]
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = []
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(command, agent.returncode, out, err))
    return done


def test_two_torchrun_nodes_train_the_drafter_of_one_node_with_both_replicas(train_inputs):
    workdir = train_inputs
    short = {"max_steps": 3, "checkpoint_every": 0}  # equal after three steps, as after six (test_train)
    single = train(workdir, config("one-node", drafters=2, **short))
    nodes = two_nodes(workdir, config("two-nodes", drafters=1, **short))
    for node in nodes:
        assert node.returncode == 0, node.stdout[-2000:] + node.stderr[-4000:]
    metrics = [
        json.loads(ln.removeprefix("METRICS ")) for n in nodes for ln in n.stdout.splitlines() if "METRICS " in ln
    ]
    assert len(metrics) == 2 and all(m["replicas"] == 2 for m in metrics)  # one replica a node, two in all
    assert_same_weights(weights(workdir, "one-node"), weights(workdir, "two-nodes"))

    # what each run measured of its two sides, in the plan's terms, and said in its log
    balance = single["balance"]
    assert balance["steps"] == single["steps"] and balance["target"]["workers"] == 1
    assert balance["drafter"]["workers"] == 2 and balance["bound_by"] in ("target", "drafter")
    assert balance["bound_by"] == single["throughput"]["bound_by"]
    waiting = "drafter" if balance["bound_by"] == "target" else "target"
    assert balance["waited"] == f"the {waiting} side waited for the {balance['bound_by']} side"
    assert 0 <= balance[waiting]["waiting_fraction"] <= 1
    assert all(
        n.stdout.count(f"train: bound by the {m['balance']['bound_by']} side") == 1
        for n, m in zip(nodes, metrics, strict=True)
    )
