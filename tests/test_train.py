"""Drafter training: replicas in lockstep, processes equal to threads, resume only under the same key."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from dflashpipe.core.errors import DflashpipeError, ParamsError
from dflashpipe.core.params import TopologyParams
from dflashpipe.core.pipeline import COMPILE, TRAIN_STATE, StageKey
from dflashpipe.core.threads import thread_budget
from dflashpipe.features.packing import pack_rows
from dflashpipe.tokens.shards import load_tokens
from dflashpipe.train.checkpoint import checkpoint_key, mismatch
from dflashpipe.train.data import BatchPlan, epoch_order
from dflashpipe.train.loop import replica_mismatches
from dflashpipe.train.topology import check_topology
from tests.conftest import ROOT
from tests.tiny import model_params

SCRIPT = ROOT / "tests" / "scenarios" / "train_run.py"
MODEL = model_params()  # the shared run's: test_compiled_training_... loads its kernels
TRAIN = {
    "max_steps": 6,
    "lr": 3e-3,
    "warmup_steps": 1,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "seed": 3,
    "checkpoint_every": 2,
    "prefetch": 2,
}


def config(name, drafters=2, targets=1, compiled=False, nodes=1, **train) -> dict:
    """A scenario run's config; `nodes` > 1 is run under torchrun, one process a node."""
    return {
        "name": name,
        "model": MODEL,
        "compile": {"enabled": compiled, "micro_batch": 2, "guard": "error"},
        "topology": {
            "target_devices": ["cpu"] * targets,
            "drafter_devices": ["cpu"] * drafters,
            "allow_shared_devices": True,
            "nodes": nodes,
        },
        "train": {**TRAIN, **train},
    }


@pytest.fixture(scope="module")
def workdir(train_inputs):
    """Real inputs (target/, manifest/, tokens/); each run writes its outputs to a folder of its own name."""
    return train_inputs


def train_process(workdir, cfg, nproc=1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(workdir), json.dumps(cfg)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(29500 + os.getpid() % 1000),
        ] + cmd[1:]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def train(workdir, cfg, nproc=1) -> dict:
    proc = train_process(workdir, cfg, nproc)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("METRICS "))
    return json.loads(line.removeprefix("METRICS "))


def weights(workdir, name) -> dict:
    return load_file(workdir / name / "drafter" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), f"{k} differs"


def test_replicas_stay_identical_and_two_processes_equal_one(workdir):
    single = train(workdir, config("single", drafters=2))
    assert single["steps"] == 6 and single["replicas"] == 2 and single["replicas_identical"] is True
    assert single["supervised_tokens"] > 0 and single["tokens_per_s"] > 0
    # its thread budget: the cores this test process may use, split among the target and the two drafter threads
    assert single["threads"] == thread_budget({"target": 1, "drafter": 2}).to_json()
    # The run's padding is what its plan's rows leave empty: pad tokens / row tokens over the run.
    lengths = load_tokens(workdir / "tokens").lengths
    plan = BatchPlan(lengths, MODEL["seq_len"], world_size=1, replicas=2, micro_batch=2, seed=TRAIN["seed"])
    rows = [row for s in range(6) for r in range(2) for row in plan.rows(s, 0, r)]
    filled = sum(min(int(lengths[i]), MODEL["seq_len"]) for row in rows for i in row)
    assert single["padding_fraction"] == pytest.approx(1 - filled / (len(rows) * MODEL["seq_len"]), abs=1e-6)
    two = train(workdir, config("two-procs", drafters=1, nodes=2), nproc=2)
    assert two["replicas"] == 2
    assert_same_weights(weights(workdir, "single"), weights(workdir, "two-procs"))
    # A different seed trains different weights: the comparison above can fail.
    train(workdir, config("other-seed", drafters=2, seed=4))
    single, other = weights(workdir, "single"), weights(workdir, "other-seed")
    assert any((single[k] != other[k]).any() for k in single)


# Killed and resumed to the same weights: tests/reliability/test_killed.py, under DVC, on the compiled path.


def step_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("train: step ")]


def test_a_finished_run_is_not_resumed_once_an_input_changed(workdir):
    # The bug: after an edit of train/data.py, `dvc repro train` found the finished checkpoint at max_steps,
    # "resumed" it, trained nothing and wrote the old drafter. Now a checkpoint resumes only under its key.
    cfg = config("edited", drafters=1, max_steps=4, checkpoint_every=2)
    first = train_process(workdir, cfg)
    assert first.returncode == 0, first.stderr[-4000:]
    assert len(step_lines(first.stdout)) == 4
    assert (workdir / "edited" / "state" / "checkpoint").is_dir()

    edited = train_process(workdir, {**cfg, "key_inputs": {"dep:src/dflashpipe/train/data.py": "edited"}})
    assert edited.returncode == 0, edited.stderr[-4000:]
    assert "resumed" not in edited.stdout
    checkpoint = workdir / "edited" / "state" / "checkpoint"
    assert (
        f"train: not resuming {checkpoint}: its inputs differ (src/dflashpipe/train/data.py changed)" in edited.stdout
    ), edited.stdout
    assert len(step_lines(edited.stdout)) == 4  # every step trained again, from step 0

    same = train_process(workdir, {**cfg, "key_inputs": {"dep:src/dflashpipe/train/data.py": "edited"}})
    assert same.returncode == 0, same.stderr[-4000:]
    assert f"train: resumed from {checkpoint} at step 4" in same.stdout
    assert step_lines(same.stdout) == []  # the finished run of these very inputs: nothing left to train


@pytest.fixture(scope="module")
def straight(workdir) -> bytes:
    """An uninterrupted 8-step run's weights: what a continued or a killed and resumed run must end with, byte
    for byte (its checkpoint cadence differs from theirs: no cadence is in the resume key)."""
    train(workdir, config("straight-8", drafters=1, max_steps=8, checkpoint_every=0))
    return (workdir / "straight-8" / "drafter" / "model.safetensors").read_bytes()


def test_a_longer_run_continues_from_the_decay_start_to_the_bytes_of_a_straight_run(workdir, straight):
    cfg = config("grown", drafters=1, max_steps=6, checkpoint_every=2)
    first = train_process(workdir, cfg)  # wsd: step 6 decays (6 - round(0.2 x 6) = 5), a copy is kept at 5
    assert first.returncode == 0, first.stderr[-4000:]
    state = workdir / "grown" / "state"
    longer = train_process(workdir, {**cfg, "train": {**cfg["train"], "max_steps": 8}})
    assert longer.returncode == 0, longer.stderr[-4000:]
    assert f"train: not resuming {state / 'checkpoint'}: its step 6 trained at lr 0.0003, this run's" in longer.stdout
    assert f"train: resumed from {state / 'decay-start'} at step 5" in longer.stdout
    assert [ln.split()[2] for ln in step_lines(longer.stdout)] == ["6/8", "7/8", "8/8"]  # the tail alone
    assert (workdir / "grown" / "drafter" / "model.safetensors").read_bytes() == straight

    # shorter: neither checkpoint is a prefix of it; each is named with why, and every step is trained
    shorter = train_process(workdir, {**cfg, "train": {**cfg["train"], "max_steps": 4}})
    assert shorter.returncode == 0, shorter.stderr[-4000:]
    for name, steps in (("checkpoint", 8), ("decay-start", 6)):
        line = f"train: not resuming {state / name}: it trained {steps} steps, this run trains 4; training from step 0"
        assert line in shorter.stdout, shorter.stdout
    assert len(step_lines(shorter.stdout)) == 4

    # cosine: every step's lr depends on max_steps, so a longer run trains from step 0
    cosine = config("cosine", drafters=1, max_steps=6, checkpoint_every=2, schedule="cosine")
    assert train_process(workdir, cosine).returncode == 0
    again = train_process(workdir, {**cosine, "train": {**cosine["train"], "max_steps": 8}})
    assert "its step 3 trained at lr" in again.stdout and len(step_lines(again.stdout)) == 8, again.stdout


def test_a_run_killed_between_checkpoints_continues_to_the_bytes_of_an_uninterrupted_run(workdir, straight):
    import signal

    cfg = config("killed", drafters=1, max_steps=8, checkpoint_every=3)
    cmd = [sys.executable, str(SCRIPT), str(workdir), json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("train: step 5/8"):  # two steps past the checkpoint of step 3
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stdout.close()
    assert not (workdir / "killed" / "drafter").exists()
    rerun = train_process(workdir, cfg)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "train: resumed from" in rerun.stdout and len(step_lines(rerun.stdout)) < 8, rerun.stdout
    assert (workdir / "killed" / "drafter" / "model.safetensors").read_bytes() == straight


def test_prefetch_and_the_held_out_cadence_move_no_weight_and_the_curves_grow_by_the_step(workdir, monkeypatch):
    # Both are left out of the resume key (pipeline.REUSE): checked here, not assumed.
    from dflashpipe.train.loop import Trainer
    from dflashpipe.train.stage import train_drafter

    original, rows = Trainer.report_step, []

    def counted(self, bar):
        rows.append(len((self.curves_dir / "loss.tsv").read_text().splitlines()) - 1)  # less the header
        return original(self, bar)

    monkeypatch.setattr(Trainer, "report_step", counted)
    for name, prefetch, every in (("cadence-a", 1, 0), ("cadence-b", 4, 1)):
        cfg = config(name, drafters=2, max_steps=3, checkpoint_every=0, heldout_sequences=2)
        inputs, paths = in_process(
            workdir, {**cfg, "train": {**cfg["train"], "prefetch": prefetch, "heldout_every": every}}
        )
        monkeypatch.setattr(Trainer, "curves_dir", paths.metrics / "plots" / "metrics", raising=False)
        train_drafter(inputs, paths, key=None, compile_key=None)
    assert rows == [1, 2, 3, 1, 2, 3]  # dvc plots show draws the run so far
    assert_same_weights(weights(workdir, "cadence-a"), weights(workdir, "cadence-b"))


def test_a_checkpoint_key_names_what_changed_and_counts_the_processes():
    base = StageKey("train", {"dep:stages/train.py": "a", "param:params.yaml:train.lr": "0.001"})
    one = checkpoint_key(base, world_size=1)
    assert mismatch(one, checkpoint_key(base, world_size=1)) == ""
    assert mismatch(one, checkpoint_key(base, world_size=2)) == "its inputs differ (world_size changed)"
    many = StageKey("train", {f"dep:src/{i}.py": "b" for i in range(5)} | {"param:params.yaml:train.lr": "0.002"})
    assert mismatch(one, checkpoint_key(many, 1)) == (
        "its inputs differ (src/0.py, src/1.py, src/2.py and 4 more changed)"
    )
    assert mismatch(None, one) == "it records no key (saved by an older version)"
    assert checkpoint_key(None, world_size=2) is None  # no key: never resumed
    # the CPU's thread facts decide no number of a run whose every device is a GPU
    import torch

    threads = StageKey("train", {**base.inputs, "param:data/env/fingerprint.json:threads.torch_intra_op": "16"})
    cpu, gpu = [torch.device("cpu"), torch.device("cuda:0")], [torch.device("cuda:0"), torch.device("cuda:1")]
    assert "param:data/env/fingerprint.json:threads.torch_intra_op" in checkpoint_key(threads, 1, cpu).inputs
    assert checkpoint_key(threads, 1, gpu) == checkpoint_key(base, 1, gpu)


def test_wsd_trains_every_step_before_its_decay_at_one_lr_whatever_the_length():
    from dflashpipe.core.params import TrainParams
    from dflashpipe.proof.run import ProofRun
    from dflashpipe.train.loop import decay_start, lr_at

    short, long = (TrainParams(**{**TRAIN, "max_steps": n, "warmup_steps": 4}) for n in (120, 160))
    assert (decay_start(short), decay_start(long)) == (96, 128)
    assert [lr_at(s, short) for s in range(96)] == [lr_at(s, long) for s in range(96)]
    assert lr_at(95, short) == TRAIN["lr"] and lr_at(96, short) < TRAIN["lr"]
    assert lr_at(119, short) == pytest.approx(TRAIN["lr"] * TRAIN["min_lr_ratio"])  # the last step at the floor
    cosine = [dataclasses.replace(p, schedule="cosine") for p in (short, long)]
    assert lr_at(10, cosine[0]) != lr_at(10, cosine[1])
    # the overfit proof's schedule (min_lr_ratio 1) is constant after warmup under either: its bar stands as it was
    proof = ProofRun(model=None, compute=None).train_params(300)
    for schedule in ("wsd", "cosine"):
        assert {lr_at(s, dataclasses.replace(proof, schedule=schedule)) for s in range(10, 300)} == {proof.lr}


def test_the_data_order_is_a_prefix_of_itself_when_the_epochs_grow():
    # A longer run stated in epochs takes the same rows at every step the shorter one trained: the stream of packed
    # epochs is one, whatever its length; only a warmup_ratio (warmup from the steps) would move the schedule.
    from dflashpipe.core.params import TrainParams
    from dflashpipe.train.data import run_length
    from dflashpipe.train.loop import decay_start, lr_at

    lengths = np.array([5, 30, 12, 64, 7, 40, 3, 22, 18, 9, 50, 11] * 3)
    plans = [BatchPlan(lengths, 64, world_size=1, replicas=2, micro_batch=2, seed=1) for _ in range(2)]
    one, two = (
        TrainParams(**{**TRAIN, "max_steps": 0, "epochs": e}).for_steps(
            run_length(TrainParams(**{**TRAIN, "max_steps": 0, "epochs": e}), plan).steps
        )
        for e, plan in zip((1, 2), plans, strict=True)
    )
    assert two.max_steps > one.max_steps
    rows = [[plan.rows(s, 0, r) for s in range(one.max_steps) for r in range(2)] for plan in reversed(plans)]
    assert rows[0] == rows[1]
    assert [lr_at(s, one) for s in range(decay_start(one))] == [lr_at(s, two) for s in range(decay_start(one))]


def test_the_replica_check_finds_a_replica_that_differs():
    import torch

    torch.manual_seed(0)
    first = torch.nn.Linear(4, 3)
    replicas = [first, copy.deepcopy(first), copy.deepcopy(first)]
    assert replica_mismatches(replicas) == []
    with torch.no_grad():
        replicas[2].bias[1] += 1e-6
    assert replica_mismatches(replicas) == ["replica 2: bias"]


def in_process(workdir, cfg: dict):
    """The train stage's inputs and paths for `cfg`, to run `train_drafter` in this process."""
    from dflashpipe.core.params import CompileParams, ModelParams, TrainParams, build
    from dflashpipe.train.stage import TrainPaths
    from dflashpipe.train.state import TrainInputs

    inputs = TrainInputs(
        model=build(ModelParams, cfg["model"], "model"),
        compile=build(CompileParams, cfg["compile"], "compile"),
        topology=build(TopologyParams, cfg["topology"], "topology"),
        train=build(TrainParams, cfg["train"], "train"),
    )
    out = workdir / cfg["name"]
    paths = TrainPaths(
        workdir / "tokens", workdir / "target", workdir / "compile", out / "drafter", out / "state", out / "metrics"
    )
    return inputs, paths


def test_diverged_replicas_fail_the_stage_and_write_no_drafter(workdir, monkeypatch, capsys):
    # Without gradient averaging each replica steps on its own batch: the replicas drift apart, and the
    # stage must say so instead of recording replicas_identical and writing replica 0 as the drafter.
    from dflashpipe.train.loop import Trainer
    from dflashpipe.train.stage import train_drafter

    inputs, paths = in_process(workdir, config("diverged", drafters=2, max_steps=2, checkpoint_every=0))
    monkeypatch.setattr(Trainer, "average_gradients", lambda self: None)
    with pytest.raises(DflashpipeError, match=r"drafter replicas diverged \(replica 1: .* differ from replica 0\)"):
        train_drafter(inputs, paths, key=None, compile_key=None)
    assert not paths.drafter.exists() and not (paths.metrics / "metrics.json").exists()


def test_checkpoints_come_every_n_steps_and_the_last_after_the_outputs(workdir, monkeypatch):
    # The last step's checkpoint is written only once the drafter is: a run refused before its outputs (its
    # replicas diverged) must leave no finished checkpoint, which a rerun would resume at max_steps.
    from dflashpipe.train import checkpoint
    from dflashpipe.train.stage import train_drafter

    inputs, paths = in_process(workdir, config("every-2", drafters=1, max_steps=4, checkpoint_every=2))
    original, saved = checkpoint.save_checkpoint, []

    def recorded(state, *args):
        saved.append((state.step, paths.drafter.exists(), (args[4:] or ["checkpoint"])[0]))
        return original(state, *args)

    monkeypatch.setattr(checkpoint, "save_checkpoint", recorded)
    train_drafter(inputs, paths, key=None, compile_key=None)
    # and a copy at wsd's decay start (4 steps, decay_ratio 0.2: the last step decays), where a longer run resumes
    assert saved == [(2, False, "checkpoint"), (3, False, "decay-start"), (4, True, "checkpoint")]


def test_a_checkpoint_is_due_by_steps_by_minutes_and_at_the_decay_start(monkeypatch):
    from dflashpipe.train import checkpoint
    from dflashpipe.train.state import TrainState

    clock, saved = [0.0], []
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda state, *args: saved.append((clock[0], args[4:])))
    policy = checkpoint.CheckpointPolicy(None, None, 0, True, TrainState(), None, None, minutes=2, keep_at=5)
    for step, now in [(1, 60), (2, 119), (3, 121), (4, 200), (5, 240), (6, 300)]:
        clock[0] = now
        policy.save(step, last_step=step == 6)
    # 2 minutes after the start, the decay start's copy, and the last step's
    assert saved == [(121, ()), (240, ("decay-start",)), (300, ())]
    saved.clear()
    off = checkpoint.CheckpointPolicy(None, None, 0, True, TrainState(), None, None, minutes=0, keep_at=1)
    off.save(1, last_step=True)
    assert saved == []  # both cadences 0: no checkpoint at all, nor a decay-start copy


@pytest.mark.parametrize("where", ["main", "target"])
def test_a_failure_in_any_thread_stops_every_thread_and_is_raised(workdir, monkeypatch, where):
    # The main thread holds the loop: its failure (here in the optimizer step) must stop the drafter and
    # target threads it started, and a worker's failure (here in the target's forward) must end the main
    # thread's wait for the step's results. Either way the run raises that error and leaves no thread behind.
    import threading

    from dflashpipe.train import loop
    from dflashpipe.train.stage import train_drafter

    owner, name = (loop.Trainer, "optimizer_step") if where == "main" else (loop, "target_inputs")
    original, calls = getattr(owner, name), []

    def second_call_fails(*args, **kwargs):
        if where == "main" or threading.current_thread().name != "MainThread":  # the target's, past parity's
            calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise RuntimeError(f"planted failure in {calls[-1]}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, second_call_fails)
    inputs, paths = in_process(workdir, config(f"fails-in-{where}", drafters=2, max_steps=4, checkpoint_every=0))
    thread = "MainThread" if where == "main" else "target-0"
    with pytest.raises(RuntimeError, match=f"planted failure in {thread}"):
        train_drafter(inputs, paths, key=None, compile_key=None)
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("drafter-", "target-"))]
    assert not paths.drafter.exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_fix(workdir, pipeline_run):
    cfg = config("damaged", drafters=1, max_steps=2)
    checkpoint = workdir / "damaged" / "state" / "checkpoint"
    # a real checkpoint (the shared run's, at its last step): it is verified before anything else is read
    shutil.copytree(pipeline_run / TRAIN_STATE / "checkpoint", checkpoint)
    victim = checkpoint / "drafter" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the weights: safetensors itself would load this without a word
    victim.write_bytes(bytes(data))
    proc = train_process(workdir, cfg)
    assert proc.returncode != 0
    assert f"TrainCheckpointError: {victim}: does not match its sha256 in {checkpoint / 'files.json'}" in proc.stderr
    assert f"`rm -r {checkpoint}`" in proc.stderr
    (checkpoint / "optimizer.pt").write_bytes(b"\x80\x04crafted")  # never reaches torch.load
    victim.write_bytes(bytes(data[:100]))
    assert "TrainCheckpointError" in train_process(workdir, cfg).stderr


def test_compiled_training_compiles_nothing_in_worker_threads(workdir, pipeline_run):
    # The warmup stage's artifact for these very shapes (the shared run's model params are MODEL's), loaded
    # in the main thread; then the real per-step worker code (anchors, mask, compiled step, backward) runs
    # in three threads at once.
    shutil.copytree(pipeline_run / COMPILE, workdir / "compile", dirs_exist_ok=True)
    # The artifact is used only if it was built for warmup's key as it is now: that project's.
    cfg = {**config("compiled", drafters=3, compiled=True, max_steps=12), "compile_key_root": str(pipeline_run)}
    metrics = train(workdir, cfg)
    assert metrics["steps"] == 12 and metrics["replicas_identical"] is True
    assert metrics["compile"]["source"] == "artifact"
    assert metrics["compile"]["compiles_in_worker_threads"] == 0
    assert metrics["compile"]["new_graphs_in_workers"] == 0
    replicas = metrics["compile"]["replicas"]
    assert sorted(replicas) == ["0", "1", "2"]
    assert all(r["compiles_in_thread"] == 0 and r["recompiles_in_thread"] == 0 for r in replicas.values())
    # warmup compiled for the device the replicas run on: the first one's kernels are read, not compiled
    warm_start = replicas["0"]["warm_start"]
    assert warm_start["fxgraph_cache_hit"] >= 1 and warm_start["fxgraph_cache_miss"] == 0, warm_start


def test_distilled_training_compiles_in_the_main_thread_only_and_keeps_replicas_identical(workdir):
    # The target worker draws the anchors and adds the target's final hidden states at the slots to the
    # step's inputs; warmup has no kernels for that step here, so it compiles cold in the main thread.
    model = {**MODEL, "distill": "kl", "distill_weight": 0.5}
    metrics = train(workdir, {**config("distilled", drafters=2, compiled=True, max_steps=2), "model": model})
    assert metrics["steps"] == 2 and metrics["replicas_identical"] is True
    assert metrics["compile"]["compiles_in_worker_threads"] == 0
    assert metrics["compile"]["new_graphs_in_workers"] == 0
    # each replica's own record: its device, and no graph compiled (nor recompiled) in its thread
    expected = {"compiles_in_thread": 0, "recompiles_in_thread": 0, "device": "cpu"}
    replicas = metrics["compile"]["replicas"]
    assert sorted(replicas) == ["0", "1"] and all(r.items() >= expected.items() for r in replicas.values())


def test_a_warmup_for_other_shapes_than_the_replicas_run_shows_in_their_record(workdir):
    # The main thread warms each replica's step at micro_batch 1; the workers run 2: what a warmup compiled for
    # another micro_batch (or device) would leave. Under guard: warn each replica's record shows its thread's
    # compile; under guard: error the worker refuses it (tests/test_compile.py, a worker that hits a new shape).
    cfg = {**config("warmed_other", drafters=2, compiled=True, max_steps=1), "warmup_micro_batch": 1}
    cfg["compile"]["guard"] = "warn"
    replicas = train(workdir, cfg)["compile"]["replicas"]
    assert sorted(replicas) == ["0", "1"]
    assert all(r["compiles_in_thread"] >= 1 and r["recompiles_in_thread"] >= 1 for r in replicas.values()), replicas


def test_bad_topology_is_refused_before_anything_loads():
    with pytest.raises(ParamsError, match=r"topology.drafter_devices names 'cuda:5', but this machine has 0 CUDA"):
        check_topology(TopologyParams(target_devices=("cpu",), drafter_devices=("cuda:5",), allow_shared_devices=False))
    with pytest.raises(ParamsError, match=r"\['cpu'\] are both target and drafter devices.*allow_shared_devices"):
        TopologyParams(target_devices=("cpu",), drafter_devices=("cpu",), allow_shared_devices=False)
    with pytest.raises(ParamsError, match="topology.drafter_devices is empty"):
        TopologyParams(target_devices=("cpu",), drafter_devices=(), allow_shared_devices=True)


def test_the_data_order_depends_only_on_seed_and_step():
    lengths = np.arange(1, 11) * 3  # 10 sequences, packed into rows of 16 tokens
    plan = BatchPlan(lengths, 16, world_size=2, replicas=2, micro_batch=2, seed=1)
    rows = [row for s in range(10) for rank in range(2) for r in range(2) for row in plan.rows(s, rank, r)]
    first_epoch = [i for row in rows[: len(pack_rows(epoch_order(10, 1, 0), lengths, 16))] for i in row]
    assert sorted(first_epoch) == list(range(10))  # every sequence once per epoch
    threads_view = BatchPlan(lengths, 16, world_size=1, replicas=4, micro_batch=2, seed=1)
    assert [threads_view.rows(3, 0, r) for r in range(4)] == [plan.rows(3, k, r) for k in range(2) for r in range(2)]


# -- one flat gradient bucket, and the FLOP accounting --------------------------------------------


def test_the_mean_gradient_is_the_replicas_mean_clipped_once_over_the_whole_bucket():
    import torch

    from dflashpipe.train.loop import mean_gradient

    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(3)]
    buckets = [torch.cat([t.reshape(-1) for t in group]) for group in grads]
    params = [torch.zeros_like(t, requires_grad=True) for t in grads[0]]
    for p, i in zip(params, range(2), strict=True):
        p.grad = sum(group[i] for group in grads) / 3
    unclipped = mean_gradient([b.clone() for b in buckets], world_size=1, clip=0.0)
    torch.testing.assert_close(unclipped, torch.cat([p.grad.reshape(-1) for p in params]))
    # Clipping the bucket is clip_grad_norm_ over all the tensors: one total norm, one scale.
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    clipped = mean_gradient([b.clone() for b in buckets], world_size=1, clip=0.5)
    torch.testing.assert_close(clipped, torch.cat([p.grad.reshape(-1) for p in params]))
    assert abs(clipped.norm().item() - 0.5) < 1e-5


def test_the_flop_formulas_count_what_torch_counts_with_causal_attention_halved():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dflashpipe.target.hidden_states import target_layer_features
    from dflashpipe.train.flops import drafter_forward_flops, target_forward_flops
    from tests.tiny import random_batch, tiny_drafter, tiny_target

    target = tiny_target()
    target.set_attn_implementation("eager")  # attention as matmuls, which torch counts (CPU sdpa it does not)
    drafter = tiny_drafter(target)
    seq_len, num_anchors = 32, 3
    features, ids, _, anchors, _ = random_batch(drafter, batch=1, seq_len=seq_len, num_anchors=num_anchors)
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad(), FlopCounterMode(display=False) as counted_target:
        target_layer_features(target, ids, torch.ones_like(ids), layer_ids)
    with torch.no_grad(), FlopCounterMode(display=False) as counted_drafter:
        drafter.logits(drafter.block_hidden(features, ids, anchors)[:, :, 1:])
    # torch counts causal attention in full (4 x S^2 x width per layer); the convention counts half.
    width = target.config.num_attention_heads * (target.config.hidden_size // target.config.num_attention_heads)
    masked_half = (max(layer_ids) + 1) * 2 * seq_len**2 * width
    assert target_forward_flops(target, layer_ids, seq_len) == counted_target.get_total_flops() - masked_half
    # The drafter's sdpa is not counted on the CPU: its attention, A x bs queries over S + A x bs keys, is added.
    queries = num_anchors * drafter.config.block_size
    attention = drafter.config.num_layers * 4 * queries * (seq_len + queries) * width
    assert drafter_forward_flops(drafter, seq_len, num_anchors) == counted_drafter.get_total_flops() + attention


def test_peak_flops_are_matched_on_the_device_name_and_unknown_on_the_cpu():
    import torch

    from dflashpipe.train.flops import device_peak_flops, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 3060") is None
    assert device_peak_flops(torch.device("cpu")) is None


def test_held_out_sequences_are_never_trained_on_and_measured_every_n_steps(workdir):
    from dflashpipe.train.data import held_out, without

    data = load_tokens(workdir / "tokens")
    held = held_out(data.starts, 3)
    assert held == list(range(int(data.starts[1]) - 3, int(data.starts[1])))  # the first shard's last ones
    plan = BatchPlan(without(data.lengths, held), 64, 1, 2, 2, seed=1)
    trained = {i for step in range(40) for r in range(2) for row in plan.rows(step, 0, r) for i in row}
    assert not trained & set(held), "held-out sequences were packed into training rows"
    assert trained == set(range(len(data))) - set(held), "a sequence other than the held-out ones went missing"
    with pytest.raises(ParamsError, match=r"train.heldout_sequences = \d+: the first token shard holds"):
        held_out(data.starts, int(data.starts[1]))

    metrics = train(workdir, config("heldout", drafters=2, max_steps=5, heldout_sequences=3, heldout_every=2))
    curve = metrics["heldout_acceptance"]
    # after step 1, every 2nd step, and the last
    assert curve["sequences"] == 3 and curve["measured"] == 4
    assert curve["first"]["step"] == 1 and curve["last"]["step"] == 5
    assert 1.0 <= curve["last"]["tau"] <= MODEL["block_size"]
    assert metrics["replicas_identical"] is True
    assert (workdir / "heldout" / "metrics" / "plots" / "images" / "heldout_acceptance.png").is_file()


def test_a_run_stated_in_epochs_takes_the_steps_that_cover_every_row_of_them():
    from dflashpipe.core.params import TrainParams
    from dflashpipe.train.data import run_length

    lengths = np.array([5, 30, 12, 64, 7, 40, 3, 22, 18, 9, 50, 11] * 3)
    plan = BatchPlan(lengths, 64, world_size=2, replicas=3, micro_batch=2, seed=1)
    rows = sum(len(pack_rows(epoch_order(len(lengths), 1, e), lengths, 64)) for e in range(3))
    train = TrainParams(**{**TRAIN, "max_steps": 0, "epochs": 3, "warmup_steps": 0, "warmup_ratio": 0.25})
    length = run_length(train, plan)
    assert (length.rows, length.rows_per_step, length.epochs) == (rows, 12, 3)
    assert (length.steps - 1) * 12 < rows <= length.steps * 12  # every row of the 3 epochs, and no step more
    assert length.warmup_steps == round(0.25 * length.steps)
    assert run_length(TrainParams(**TRAIN), plan).steps == TRAIN["max_steps"]  # stated in steps: as stated
    with pytest.raises(ParamsError, match="train.epochs is set, but the token data holds no sequence"):
        run_length(train, BatchPlan(np.zeros(4, np.int64), 64, 1, 1, 1, seed=1))


def test_the_derived_steps_drive_the_schedule_checkpoints_and_held_out_and_are_recorded(workdir, monkeypatch):
    from dflashpipe.train import checkpoint
    from dflashpipe.train.data import held_out, without
    from dflashpipe.train.loop import lr_at
    from dflashpipe.train.stage import train_drafter

    epochs = {"max_steps": 0, "epochs": 1, "warmup_steps": 0, "warmup_ratio": 0.5, "checkpoint_every": 2}
    cfg = config("epochs", drafters=1, heldout_sequences=2, heldout_every=100, **epochs)
    inputs, paths = in_process(workdir, cfg)
    data = load_tokens(workdir / "tokens")
    kept = without(data.lengths, held_out(data.starts, 2))
    rows = len(pack_rows(epoch_order(len(kept), TRAIN["seed"], 0), kept, MODEL["seq_len"]))
    steps = -(-rows // 2)  # one replica x micro_batch 2, rounded up
    saved = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda state, *args: saved.append(state.step))
    from dflashpipe.train.loop import decay_start

    metrics = train_drafter(inputs, paths, key=None, compile_key=None)
    assert metrics["steps"] == steps
    assert metrics["run_length"] == {
        "steps": steps,
        "warmup_steps": round(steps / 2),
        "epochs": 1,
        "rows": rows,
        "rows_per_step": 2,
        "from": "train.epochs: ceil(rows / rows_per_step)",
    }
    assert saved == sorted([s for s in range(2, steps, 2)] + [decay_start(inputs.train.for_steps(steps)), steps])
    assert metrics["heldout_acceptance"]["last"]["step"] == steps  # measured after the derived last step
    with (paths.metrics / "plots" / "metrics" / "lr.tsv").open() as f:
        lrs = [float(row["lr"]) for row in csv.DictReader(f, delimiter="\t")]
    # the schedule runs over the derived steps; the warmup, half of them, reaches lr at its last step
    assert lrs == pytest.approx([lr_at(s, inputs.train.for_steps(steps)) for s in range(steps)])
    assert lrs.index(max(lrs)) == round(steps / 2) - 1
