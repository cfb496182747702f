"""One prepared check of dflashpipe on a lent GPU machine, within 8 minutes, written to one JSON.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json     # the lent machine
    .venv/bin/python benchmarks/gpu_check.py --dry --out /tmp/gpu_check.json    # the same code paths, tiny, CPU

The lent machine is not set up like ours (no dvc, gguf or datasets; no network; the materialised
target does not travel), so this runs the project's own functions, not DVC stages, on randomly
initialised targets of real shapes built from the configs below. Sections, each in a process of its
own (dynamo's state is per process, and a crash or hang then costs one section, not the file):

  env            versions, device name and capability
  flex_vs_sdpa   the compiled training step with flex attention against the eager sdpa step on the
                 same inputs: loss, slot counts and every gradient within a stated tolerance; times
  compile        the story's fault: three threads calling the compiled flex_attention cold (a fresh
                 process and compile cache per run), against warmup in the main thread and three
                 threads under the armed compile guard (no compile, no error expected)
  train          the threaded train loop (train/loop.py Trainer), the target and two drafter replicas on
                 one device (on the last GPU when there are two or more: the target keeps cuda:0, so
                 the main thread warms up where the replicas run, not on the default device): each
                 replica's thread compiles nothing; supervised tokens/s, the step alone, MFU
  decode         speculative decoding (evaluate/speculative.py) with a bf16 drafter on synthetic
                 prompts: tau, speedup, lossless (random weights: tau near 1 is expected)

Sections run in priority order under one time budget (--budget-s): what no longer fits is recorded
as skipped. The JSON is rewritten after every section, so a run killed from outside keeps what ran.
--dry uses tiny configs and few steps; on the CPU, flex has no backward, so flex_vs_sdpa compares
forwards only there (the drafter eager around flex's compiled kernel) and `auto` attention trains
with sdpa; the JSON says so in each section's `notes`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dflashpipe.core.artifacts import write_json_atomic  # noqa: E402

# -- the targets: real shapes, random weights ------------------------------------------------------

TARGETS = {
    "smollm2-135m": (
        "LlamaForCausalLM",
        {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-1.7b": (
        "Qwen3ForCausalLM",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 6144,
            "vocab_size": 151936,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
}
"""SmolLM2-135M (the project's target) and Qwen3-1.7B (a larger one, head_dim 128), as their config.json say."""

DRY_TARGETS = {
    "smollm2-135m": (
        "LlamaForCausalLM",
        {
            **TARGETS["smollm2-135m"][1],
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
        },
    ),
    "qwen3-1.7b": (
        "Qwen3ForCausalLM",
        {
            **TARGETS["qwen3-1.7b"][1],
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 128,
            "vocab_size": 512,
        },
    ),
}
"""The same families, tiny (head_dim 32 != hidden/heads keeps Qwen3's explicit head_dim in play)."""

DRY_MODEL = {"layers": 1, "block_size": 4, "target_layers": 3, "num_anchors": 4, "seq_len": 64}
"""--dry: the drafter's shapes (the real run uses params.yaml's model section)."""

TOLERANCE = {"cuda": 5e-2, "cpu": 1e-4}
"""flex vs sdpa, max |a - b| / max |b| per tensor. On CUDA the step runs under bf16 autocast (as training
does): 8-bit mantissas, rounded differently by two kernels, over a few layers of backward; on the CPU, float32."""

REPEATS = 5
"""Timed runs after one untimed (compiling) run; the median is reported with min and max (--dry: 2)."""

BLOCKED_ELSEWHERE = ("dvc", "dvclive", "scmrepo", "gguf", "datasets", "pyarrow")
"""Packages the lent machine lacks (pyarrow: perhaps, so nothing may need it): no section may import them
(each section records what it imported)."""


def plan(dry: bool) -> list[tuple[str, str | None]]:
    """(section, target or run) in priority order: what matters most runs first, under the budget."""
    small, large = TARGETS
    compile_runs = ["warm", "cold-1"] if dry else ["warm", "cold-1", "cold-2", "cold-3"]
    sections = [
        ("env", None),
        ("flex_vs_sdpa", small),
        *(("compile", run) for run in compile_runs),
        ("train", small),
        ("decode", small),
        ("flex_vs_sdpa", large),
    ]
    # --dry: the large target's train and decode run the small one's code, only slower on 2 CPU cores
    return sections if dry else [*sections, ("train", large), ("decode", large)]


SHARED_CACHE = "inductor"
"""Under the run's work directory: the compile cache flex_vs_sdpa fills and train reads (the same step graph)."""

SECTION_LIMIT_S = {"env": 60, "flex_vs_sdpa": 200, "compile": 120, "train": 240, "decode": 120}
"""Each section's own wall-clock limit (also bounded by what is left of the budget): one hang costs one section."""


# -- shared pieces, in the section processes --------------------------------------------------------


def device_of(dry: bool):
    import torch

    return torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda:0")


def random_target(name: str, dry: bool, device, dtype):
    """A causal LM of the named config with seeded random weights, built on `device`, frozen."""
    import torch
    import transformers

    class_name, shape = (DRY_TARGETS if dry else TARGETS)[name]
    cls = getattr(transformers, class_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cls.config_class(**shape))
    return model.to(dtype).eval().requires_grad_(False)


class MaskTokenizer(SimpleNamespace):
    """What the drafter needs of a tokenizer (no tokenizer files travel): a mask token, the last id, and a length
    (the drafter records a mask token's string only when it was added past the tokenizer)."""

    def __len__(self) -> int:
        return self.mask_token_id + 1


def mask_tokenizer(target) -> MaskTokenizer:
    return MaskTokenizer(mask_token_id=target.config.vocab_size - 1, mask_token="<mask>")


def model_params(dry: bool, **changes):
    from dflashpipe.core.params import load_params

    model = load_params(ROOT)["model"]
    return replace(model, **(DRY_MODEL if dry else {}), **changes)


def project_params(dry: bool) -> dict:
    from dflashpipe.core.params import load_params

    p = load_params(ROOT)
    return {**p, "model": model_params(dry)}


def timed(fn, device, dry: bool) -> dict:
    """fn() once untimed (the compile), then REPEATS times (--dry: 2) with the device synchronised around each."""
    from dflashpipe.evaluate.speculative import clock

    fn()
    seconds = []
    repeats = 2 if dry else REPEATS
    for _ in range(repeats):
        began = clock(device)
        fn()
        seconds.append(clock(device) - began)
    return {
        "median_s": round(statistics.median(seconds), 6),
        "min_s": round(min(seconds), 6),
        "max_s": round(max(seconds), 6),
        "repeats": repeats,
    }


def random_step_inputs(drafter, model, micro_batch: int, device):
    """The training step's inputs in warmup's shapes (what train passes: a StepInputs), with random target
    features and token ids in place of warmup's zeros, so that two kernels have something to disagree on."""
    from dataclasses import replace

    import torch

    from dflashpipe.compile.warmup import step_inputs

    inputs = step_inputs(drafter, model, micro_batch, device)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(inputs.features.shape, generator=g).to(inputs.features)
    ids = torch.randint(0, drafter.config.vocab_size - 1, inputs.input_ids.shape, generator=g).to(inputs.input_ids)
    return replace(inputs, features=features, input_ids=ids)


def difference(a, b) -> dict:
    """Max absolute difference, and relative to the reference's largest magnitude."""
    a, b = a.detach().float(), b.detach().float()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return {"max_abs": diff, "rel": diff / scale if scale else diff}


# -- the sections --------------------------------------------------------------------------------


def section_env(dry: bool, target: str | None, work: Path) -> dict:
    import platform

    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "passed": True,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "device_count": torch.cuda.device_count(),
        "runs_on": str(device_of(dry)),
    }


def section_flex_vs_sdpa(dry: bool, target_name: str, work: Path) -> dict:
    """The drafter's training step, flex (compiled whole, as train compiles it) against sdpa (eager, the
    reference), same initialisation, same inputs."""
    import torch

    from dflashpipe.compile.artifact import point_inductor_at
    from dflashpipe.compile.warmup import autocast, compiled_step
    from dflashpipe.model import DFlashDrafter

    point_inductor_at(work / SHARED_CACHE)
    device = device_of(dry)
    target = random_target(target_name, dry, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    micro_batch = project_params(dry)["compile"].micro_batch
    model = model_params(dry)
    drafters = {
        backend: DFlashDrafter.for_target(
            target,
            mask_tokenizer(target),
            replace(model, attention=backend),
            generator=torch.Generator().manual_seed(0),
        ).to(device)
        for backend in ("flex", "sdpa")
    }
    inputs = random_step_inputs(drafters["sdpa"], model, micro_batch, device)
    backward = device.type == "cuda"  # FlexAttention has no backward on the CPU
    steps = {"flex": compiled_step(drafters["flex"]) if backward else drafters["flex"], "sdpa": drafters["sdpa"]}

    def step(backend: str):
        drafter = drafters[backend]
        with torch.set_grad_enabled(backward), autocast(device):
            out = steps[backend](*inputs.args())
        if backward:
            out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        drafter.zero_grad(set_to_none=True)
        return out, grads

    (flex_out, flex_grads), (sdpa_out, sdpa_grads) = step("flex"), step("sdpa")
    diffs = {
        "loss": difference(flex_out.loss, sdpa_out.loss),
        "slot_correct": difference(flex_out.slot_correct, sdpa_out.slot_correct),
        "slot_count": difference(flex_out.slot_count, sdpa_out.slot_count),
    }
    if not backward:
        # Without gradients, the loss alone is too blunt (1e-7 differences vanish in it): compare the drafted
        # blocks' hidden states.
        with torch.no_grad():
            hidden = {
                b: drafters[b].block_hidden(
                    inputs.features, inputs.input_ids, inputs.anchors, inputs.document_ids, inputs.position_ids
                )
                for b in drafters
            }
        diffs["block_hidden"] = difference(hidden["flex"], hidden["sdpa"])
    grad_diffs = {n: difference(flex_grads[n], sdpa_grads[n]) for n in sdpa_grads if n in flex_grads}
    worst = max(grad_diffs, key=lambda n: grad_diffs[n]["rel"]) if grad_diffs else None
    tol = TOLERANCE[device.type]
    same_grads = set(flex_grads) == set(sdpa_grads) and all(d["rel"] <= tol for d in grad_diffs.values())
    close = all(diffs[k]["rel"] <= tol for k in ("loss", "block_hidden") if k in diffs)
    passed = close and diffs["slot_count"]["max_abs"] == 0 and same_grads
    result = {
        "passed": passed,
        "tolerance_rel": tol,
        "outputs": diffs,
        "grads": {"tensors": len(grad_diffs), "worst": worst, **(grad_diffs[worst] if worst else {})},
        "loss": {"flex": float(flex_out.loss), "sdpa": float(sdpa_out.loss)},
        "step_s": {
            "flex_compiled": timed(lambda: step("flex"), device, dry),
            "sdpa_eager": timed(lambda: step("sdpa"), device, dry),
        },
        "shapes": {
            "micro_batch": micro_batch,
            "seq_len": model.seq_len,
            "num_anchors": model.num_anchors,
            "block_size": model.block_size,
            "layers": model.layers,
        },
        "notes": []
        if backward
        else [
            "CPU: forward only (FlexAttention has no backward on the CPU); flex is the eager drafter around "
            "flex's compiled kernel, not the step compiled whole"
        ],
    }
    if not passed:
        result["error"] = f"flex and sdpa differ beyond {tol} (see outputs and grads)"
    return result


def flex_inputs(dry: bool, device):
    """Attention inputs of the small target's drafter layer ([B, H, Q, D] queries over the DFlash mask's
    context + blocks), through the project's own mask and backend selection."""
    import torch

    from dflashpipe.model import dflash_mask_mod, sample_anchor_positions
    from dflashpipe.model.attention import build_mask

    model = model_params(dry)
    micro_batch = project_params(dry)["compile"].micro_batch
    shape = (DRY_TARGETS if dry else TARGETS)["smollm2-135m"][1]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(micro_batch, model.seq_len, dtype=torch.long)
    mask[:, model.seq_len // 2 :] = 1
    anchors, _ = sample_anchor_positions(mask, model.num_anchors, g)
    q_len, kv_len = model.num_anchors * model.block_size, model.seq_len + model.num_anchors * model.block_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(micro_batch, heads, q_len, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(micro_batch, kv_heads, kv_len, head_dim, generator=g).to(device, dtype) for _ in "kv")
    mod = dflash_mask_mod(anchors.to(device), model.seq_len, model.block_size)
    return q, k, v, build_mask(mod, "flex", micro_batch, q_len, kv_len, device)


def section_compile(dry: bool, run: str, work: Path) -> dict:
    """Three threads call the project's compiled flex_attention (model/attention.py `attend`), started
    together. `cold-N`: nothing compiled before, in a fresh compile cache. `warm`: compiled once in the
    main thread first, then the guard armed (train's order). Forward only, under no_grad: the compile in
    threads is the fault; a forward compile shows it at a fraction of a backward compile's time."""
    import torch

    from dflashpipe.compile.artifact import point_inductor_at
    from dflashpipe.compile.guard import COUNTER, CompileGuard, dynamo_counters
    from dflashpipe.model.attention import attend

    point_inductor_at(work / f"inductor-{run}")  # a cache nobody wrote: nothing compiled before this run
    COUNTER.install()
    device = device_of(dry)
    q, k, v, mask = flex_inputs(dry, device)
    calls_per_thread = 5
    guard = CompileGuard(strict=True)
    main_thread_s = None
    if run == "warm":
        began = time.perf_counter()
        with torch.no_grad():
            attend(q, k, v, mask, "flex")
        main_thread_s = round(time.perf_counter() - began, 3)
        guard.arm()
    before = dynamo_counters()
    start = threading.Barrier(3)
    errors: list[str] = []

    def drafter_thread(i: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(calls_per_thread):
                    guard.call("flex_attention", attend, q, k, v, mask, "flex")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # recorded: the point of the cold runs is what goes wrong
            errors.append(f"thread {i}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

    threads = [threading.Thread(target=drafter_thread, args=(i,), name=f"drafter-{i}") for i in range(3)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threads_s = round(time.perf_counter() - began, 3)
    if guard.armed:
        guard.disarm()
    after = dynamo_counters()
    compiles_in_threads = after["compiles_outside_main_thread"] - before["compiles_outside_main_thread"]
    result = {
        "run": run,
        "errors": errors,
        "new_graphs_in_threads": after["unique_graphs"] - before["unique_graphs"],
        "compiles_in_worker_threads": compiles_in_threads,
        "compiles_by_thread": dict(sorted(COUNTER.by_thread.items())),
        "threads_s": threads_s,
        "main_thread_compile_s": main_thread_s,
        "calls": 3 * calls_per_thread,
        "shapes": {"q": list(q.shape), "kv": list(k.shape), "dtype": str(q.dtype).removeprefix("torch.")},
    }
    if run == "warm":  # the guarded order must be clean; a cold run passes by running to the end
        result["passed"] = not errors and compiles_in_threads == 0 and result["new_graphs_in_threads"] == 0
        if not result["passed"]:
            result["error"] = "compiled in the main thread first, the guarded threads still compiled or failed"
    else:
        result["passed"] = True
    return result


class SyntheticTokens:
    """Random token sequences in TokenData's interface (what the train loop reads): between a quarter and
    half of seq_len long (so rows pack several documents), ids below the mask id, the loss mask on each
    sequence's second half."""

    def __init__(self, count: int, seq_len: int, mask_token_id: int, seed: int = 0) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(seq_len // 4, seq_len // 2 + 1, size=count)
        self._ids = [rng.integers(0, mask_token_id, size=n).astype(np.int32) for n in self.lengths]
        self._masks = [(np.arange(n) >= n // 2).astype(np.uint8) for n in self.lengths]
        self.starts = np.array([0, count], dtype=np.int64)  # one shard (where train.heldout_sequences would come from)

    def __len__(self) -> int:
        return len(self._ids)

    def sequence(self, i: int):
        return self._ids[i], self._masks[i]

    @property
    def supervised_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self._masks))


def section_train(dry: bool, target_name: str, work: Path) -> dict:
    """Train's own loop, set up as train/stage.py sets it up (build, warm up in the main thread, arm the
    guard, run), minus what needs files this machine lacks: token shards (synthetic data instead), a
    tokenizer (a mask id instead), DVCLive plots and checkpoints (not written)."""
    import torch

    from dflashpipe.compile.artifact import point_inductor_at
    from dflashpipe.compile.guard import COUNTER, CompileGuard, dynamo_counters
    from dflashpipe.compile.warmup import autocast
    from dflashpipe.core.params import TopologyParams
    from dflashpipe.train.loop import Trainer
    from dflashpipe.train.metrics import train_metrics
    from dflashpipe.train.state import TrainInputs
    from dflashpipe.train.topology import check_topology

    point_inductor_at(work / SHARED_CACHE)
    target_device, name = train_devices(0 if dry else torch.cuda.device_count())
    device = torch.device(name)
    p = project_params(dry)
    steps = 3 if dry else 20
    schedule = p["train"].for_steps(steps)  # a run stated in epochs too: its warmup ratio, of these steps
    inputs = TrainInputs(
        model=p["model"],
        compile=replace(p["compile"], enabled=True, guard="error"),
        topology=TopologyParams(
            target_devices=(target_device,), drafter_devices=(name, name), allow_shared_devices=True
        ),
        train=replace(
            schedule,
            warmup_steps=min(schedule.warmup_steps, steps),
            checkpoint_every=0,
            heldout_sequences=0,  # its synthetic data is one shard of a few sequences; throughput is the point
        ),
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-target-") as tmp:
        # Trainer.build loads the target the way train does (load_materialised_target), so it is written first.
        target = random_target(target_name, dry, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        target.save_pretrained(tmp)
        tokenizer = mask_tokenizer(target)
        del target
        data = SyntheticTokens(64, inputs.model.seq_len, tokenizer.mask_token_id)
        COUNTER.install()
        trainer = Trainer(inputs, data, check_topology(inputs.topology), Path(tmp), pad_id=0)
        # compiled in the main thread at the drafter threads' count, as the train stage does (dflashpipe.core.threads)
        trainer.threads.apply("drafter", device)
        trainer.build(tokenizer)
    warm_s = trainer.warm_up_compiled()
    replica = trainer.replicas[0]
    step_inputs = random_step_inputs(replica.drafter, inputs.model, inputs.compile.micro_batch, device)

    def one_step() -> None:
        with autocast(device):
            out = replica.step_fn(*step_inputs.args())
        out.loss.backward()
        replica.drafter.zero_grad(set_to_none=True)

    step = timed(one_step, device, dry)
    guard = CompileGuard(strict=True)
    guard.arm()
    before, by_replica = dynamo_counters(), trainer.compiled_by_replicas()
    began = time.perf_counter()
    trainer.run(guard)
    loop_s = time.perf_counter() - began
    guard.disarm()
    after = dynamo_counters()
    metrics = train_metrics(
        trainer.state,
        inputs,
        trainer.topology,
        replica.drafter,
        trainer.targets[0].model,
        before,
        after,
        warm_s,
        "compiled cold by this check",
        not trainer.replica_mismatches(),
    )
    metrics["compile"]["replicas"] = trainer.replica_compiles(by_replica)
    positions = inputs.compile.micro_batch * inputs.model.seq_len
    clean = no_compiles_after_warmup(metrics["compile"])
    passed = clean and metrics["replicas_identical"] and metrics["tokens_per_s"] > 0
    result = {
        "passed": passed,
        "topology": {"target": [target_device], "drafters": [name, name]},
        "steps": steps,
        "loop_s": round(loop_s, 3),
        "tokens_per_s": metrics["tokens_per_s"],
        "mfu": (metrics.get("throughput") or {}).get("mfu"),
        "step": {**step, "positions_per_s": round(positions / step["median_s"], 2)},
        "metrics": metrics,
        "notes": [
            "tokens_per_s: supervised drafter tokens/s of the threaded loop over its steps after the first "
            "(train/metrics.py); step: one replica's compiled forward+backward alone, micro_batch x seq_len positions",
            "mfu: train/metrics.py's model FLOP/s over the device's bf16 peak; null where the peak is unknown (a CPU)",
            "metrics.compile.replicas: per replica its device, inductor's cache hits and misses when the main "
            "thread warmed it up (the cache flex_vs_sdpa filled on cuda:0), and what its own thread compiled",
        ],
    }
    if not passed:
        result["error"] = "a replica's thread compiled, replicas diverged or nothing trained (see metrics)"
    return result


def train_devices(gpus: int) -> tuple[str, str]:
    """(target, drafter) devices of the train section on a machine of `gpus` GPUs: with two or more, the
    drafters on the last one, away from cuda:0 (the default device), as profiles/gpu8.yaml places them."""
    if gpus == 0:
        return "cpu", "cpu"
    return "cuda:0", f"cuda:{gpus - 1}"


def no_compiles_after_warmup(compile: dict) -> bool:
    """train metrics' `compile` record: no new graph in any worker thread, and none in any replica's thread."""
    replicas = compile.get("replicas") or {}
    in_threads = sum(r["compiles_in_thread"] + r["recompiles_in_thread"] for r in replicas.values())
    return (
        bool(replicas)
        and in_threads == 0
        and compile["compiles_in_worker_threads"] == 0
        and (compile["new_graphs_in_workers"] == 0)
    )


def section_decode(dry: bool, target_name: str, work: Path) -> dict:
    """evaluate's decode_prompts on synthetic prompts: the drafter in bf16 with sdpa (as evaluate runs it).
    The target runs twice: in float32, where greedy speculative output must equal the target's own
    (lossless), and in bf16 as evaluate serves it on CUDA. A random target's logits are nearly flat, so
    bf16 rounding in a block forward can flip an argmax against the one-token forward: recorded with the
    lossless contract's verdict on each divergence (numerics or a bug), not failed."""
    import torch

    from dflashpipe.evaluate.evaluation import decode_prompts
    from dflashpipe.evaluate.metrics import eval_metrics
    from dflashpipe.evaluate.prompts import EvalPrompt
    from dflashpipe.model import DFlashDrafter

    device = device_of(dry)
    target = random_target(target_name, dry, device, torch.float32)
    model = model_params(dry, attention="sdpa")
    drafter = DFlashDrafter.for_target(
        target, mask_tokenizer(target), model, generator=torch.Generator().manual_seed(0)
    ).to(device, torch.bfloat16)
    drafter.eval()
    g = torch.Generator().manual_seed(0)
    count, length, new_tokens = (2, 16, 12) if dry else (4, 64, 32)
    prompts = [
        EvalPrompt(
            f"synthetic-{i}",
            "synthetic",
            torch.randint(0, drafter.config.mask_token_id, (length,), generator=g).tolist(),
        )
        for i in range(count)
    ]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        target.to(dtype)  # in place: the drafter borrows these very modules
        began = time.perf_counter()
        results = decode_prompts(target, drafter, prompts, new_tokens, [])
        decoding, _ = eval_metrics(results, drafter.config.block_size)
        keep = (
            "tau",
            "tau_pooled",
            "speedup",
            "lossless",
            "contract",
            "decode_tokens_per_s",
            "new_tokens",
            "verify_steps",
        )
        runs[str(dtype).removeprefix("torch.")] = {
            **{k: decoding[k] for k in keep},
            "seconds": round(time.perf_counter() - began, 3),
        }
    passed = runs["float32"]["lossless"]
    result = {
        "passed": passed,
        "drafter_dtype": "bfloat16",
        "attention": "sdpa",
        "prompts": count,
        "prompt_tokens": length,
        "max_new_tokens": new_tokens,
        "target_float32": runs["float32"],
        "target_bfloat16": runs["bfloat16"],
    }
    if not passed:
        result["error"] = "speculative output differs from the float32 target's greedy output"
    return result


SECTIONS = {
    "env": section_env,
    "flex_vs_sdpa": section_flex_vs_sdpa,
    "compile": section_compile,
    "train": section_train,
    "decode": section_decode,
}


def imported_packages() -> list[str]:
    """Top-level installed modules this process imported (not the stdlib's, ours, or inductor's generated
    ones): what the lent machine must have."""
    found = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if "." not in name and ("site-packages" in path or "dist-packages" in path):
            found.add(name)
    return sorted(found)


def run_section_here(name: str, arg: str | None, dry: bool, work: Path) -> dict:
    """In the section's own process: its figures, or the error that stopped it (never a bare traceback)."""
    began = time.perf_counter()
    try:
        result = SECTIONS[name](dry, arg, work)
    except Exception as exc:
        tb = traceback.format_exc().strip().splitlines()
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "traceback_tail": tb[-12:]}
    result["seconds"] = round(time.perf_counter() - began, 3)
    result["imported"] = imported_packages()
    return result


# -- the driver ---------------------------------------------------------------------------------


RESULT = "GPU-CHECK-RESULT "


def label(name: str, arg: str | None) -> dict:
    return {"section": name, ("run" if name == "compile" else "target"): arg}


def run_section(name: str, arg: str | None, dry: bool, work: Path, limit_s: float) -> dict:
    """One section in a fresh process, within `limit_s`; whatever happens, a record of it."""
    command = [sys.executable, __file__, "--section", name, "--work", str(work)]
    command += (["--arg", arg] if arg else []) + (["--dry"] if dry else [])
    began = time.perf_counter()
    # A session of its own, so that a timeout ends the section and the compile workers it started.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {
            **label(name, arg),
            "status": "timeout",
            "wall_s": round(time.perf_counter() - began, 1),
            "error": f"no result within {limit_s:.0f} s",
            "stderr_tail": stderr[-3000:],
        }
    wall = round(time.perf_counter() - began, 1)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        return {
            **label(name, arg),
            "status": "crashed",
            "wall_s": wall,
            "error": f"exit status {proc.returncode}, no result",
            "stderr_tail": stderr[-3000:],
        }
    result = json.loads(lines[-1].removeprefix(RESULT))
    return {
        **label(name, arg),
        "status": "passed" if result.get("passed") else "failed",
        "wall_s": wall,
        "result": result,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON to write")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU: tests the code paths")
    parser.add_argument(
        "--budget-s", type=float, help="wall-clock budget of all sections (default 450; --dry: 1800, no section limits)"
    )
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--arg", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = 1800.0 if args.dry else 450.0
    if args.section:  # a section's own process
        print(RESULT + json.dumps(run_section_here(args.section, args.arg, args.dry, args.work)), flush=True)
        return 0

    began = time.perf_counter()
    report = {"check": "benchmarks/gpu_check.py", "dry": args.dry, "budget_s": args.budget_s, "sections": []}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for name, arg in plan(args.dry):
            left = args.budget_s - (time.perf_counter() - began)
            if left < 30:
                report["sections"].append({**label(name, arg), "status": "skipped", "error": "out of time budget"})
            else:
                # --dry runs on a shared CPU whose speed says nothing: only the budget bounds it there
                limit = left if args.dry else min(SECTION_LIMIT_S[name], left)
                record = run_section(name, arg, args.dry, Path(work), limit)
                report["sections"].append(record)
                print(
                    f"gpu_check: {name} {arg or ''}: {record['status']} in {record['wall_s']} s"
                    + (
                        f" ({record.get('error') or record['result'].get('error')})"
                        if record["status"] != "passed"
                        else ""
                    ),
                    flush=True,
                )
            report["env"] = next(
                (s["result"] for s in report["sections"] if s["section"] == "env" and "result" in s), None
            )
            report["passed"] = all(s["status"] == "passed" for s in report["sections"])
            report["wall_s"] = round(time.perf_counter() - began, 1)
            write_json_atomic(args.out, report)  # after every section: a run killed from outside keeps what ran
    print(f"gpu_check: {'all sections passed' if report['passed'] else 'NOT all sections passed'}; wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
