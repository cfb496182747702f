"""Multi-node training on one machine: two `torchrun` agents (`--nnodes 2`) meet on 127.0.0.1 and train one
replica each over gloo; the drafter is bit for bit the one a single process trains with both replicas. First
the agents alone (c10d rendezvous; each run also records which side bound it, metrics `balance`), then as
docs/pipeline.md launches them: `dvc repro train` on the head, and the command it prints on the other node."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from dflashpipe.core.metrics import read_record_at
from dflashpipe.train.nodes import RENDEZVOUS_ENV, TIMEOUT_ENV, Rendezvous, RendezvousError, launch
from tests.conftest import run, set_params, user_env
from tests.test_train import SCRIPT, assert_same_weights, config, train, weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(workdir, cfg, other_cfg=None) -> list[subprocess.CompletedProcess]:
    """Two agents, as two machines would start them: same command (the second's config `other_cfg`, if given),
    same rendezvous endpoint and id."""
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
    commands = [command, command[:-1] + [json.dumps(other_cfg or cfg)]]
    agents = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    done = []
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(command, agent.returncode, out, err))
    return done


def test_two_torchrun_nodes_train_the_drafter_of_one_node_with_both_replicas(train_inputs):
    workdir = train_inputs
    short = {"max_steps": 3, "checkpoint_every": 0}  # equal after three steps, as after six (test_train)
    single = train(workdir, config("one-node", drafters=2, **short))
    nodes = two_nodes(workdir, config("two-nodes", drafters=1, nodes=2, **short))
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


def test_a_node_with_other_inputs_stops_every_node_before_a_step(train_inputs):
    cfg = config("other-inputs", drafters=1, nodes=2, max_steps=1, checkpoint_every=0)
    edited = {**cfg, "key_inputs": {"dep:tokens/shard-0.arrow": "edited"}}  # as a stale copy of the data would
    for node in two_nodes(train_inputs, cfg, edited):
        assert node.returncode != 0 and "train: step" not in node.stdout
        assert "node 1's train inputs differ from node 0's (tokens/shard-0.arrow changed)" in node.stderr, node.stderr
    assert not (train_inputs / "other-inputs" / "drafter").exists()


def test_a_node_that_never_joins_stops_the_head_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv(RENDEZVOUS_ENV, f"127.0.0.1:{free_port()}")
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    with pytest.raises(
        RendezvousError, match=r"^1 of 2 nodes joined at 127\.0\.0\.1:\d+ within 1 s .*nothing was written"
    ):
        launch(2, "stages/train.py")  # before any worker starts: the store waits for the agents first
    assert "train: node 1: torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "variable, value",
    [(RENDEZVOUS_ENV, "head:port"), (RENDEZVOUS_ENV, ":29500"), (TIMEOUT_ENV, "0"), (TIMEOUT_ENV, "1m")],
)
def test_a_bad_rendezvous_setting_is_refused_naming_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(RendezvousError, match=f"^{variable}="):
        Rendezvous.from_env()


def test_two_nodes_through_dvc_repro_train_the_drafter_of_one_node_and_record_one_run(dvc_project):
    project = dvc_project
    drafter = project / "data" / "drafter" / "model.safetensors"
    run(["dvc", "repro", "train"], project)  # one node, two replicas: the drafter to equal, and explain's baseline
    one_node = load_file(drafter)
    one_node_metrics = read_record_at(project / "metrics" / "train" / "metrics.json")
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "one node"], project)

    set_params(project, topology__nodes=2, topology__drafter_devices=["cpu"])  # two nodes of one replica
    env = user_env({RENDEZVOUS_ENV: f"127.0.0.1:{free_port()}", TIMEOUT_ENV: "120"})
    head = subprocess.Popen(
        ["dvc", "repro", "train"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    printed = []
    for line in head.stdout:
        printed.append(line)
        if line.startswith("train: node 1: "):
            break
    assert printed and printed[-1].startswith("train: node 1: "), "".join(printed)
    other = subprocess.run(  # the other node: the printed command, run as printed, in the same (shared) directory
        shlex.split(line.removeprefix("train: node 1: ")), cwd=project, env=env, capture_output=True, text=True
    )
    printed += head.stdout.readlines()
    assert head.wait() == 0 and other.returncode == 0, "".join(printed)[-4000:] + other.stderr[-3000:]
    assert_same_weights(one_node, load_file(drafter))
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["train"]
    assert lock["params"]["params.yaml"]["topology.nodes"] == 2
    metrics = read_record_at(project / "metrics" / "train" / "metrics.json")
    assert metrics["replicas"] == 2  # and what it recorded is the run's, not the head's share
    for key in ("final_loss", "supervised_tokens", "truncated_sequences", "padding_fraction"):
        assert metrics[key] == one_node_metrics[key], key
    assert "train: step" not in other.stdout  # rank 0, on the head, reports and writes

    explained = run(["dflashpipe", "explain"], project).stdout  # against the one-node run, committed
    assert "param topology.nodes: 1 -> 2" in explained and "the same: final loss" in explained, explained


def test_a_worker_ends_when_its_agent_is_killed(tmp_path):
    """SIGKILL the head's stage (its agent) and its worker must not train on and write what DVC never records."""
    pid_file = tmp_path / "worker.pid"
    worker = (
        "import os, sys, time; from dflashpipe.train.nodes import _end_with_agent; _end_with_agent(0.05); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}])"]
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    agent.kill()
    agent.wait()
    worker_pid = int(pid_file.read_text())
    while time.monotonic() < deadline:
        try:  # gone, or a zombie that nobody has reaped yet
            if Path(f"/proc/{worker_pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(worker_pid, signal.SIGKILL)
    raise AssertionError("the worker outlived its killed agent")
