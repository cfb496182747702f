"""The one compiled graph of training, built and run once: by `warmup` to fill the cache,
by `train` (main thread, per replica) to load it before any worker starts."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflashpipe.core.params import CompileParams, ModelParams
from dflashpipe.core.pipeline import StageKey
from dflashpipe.core.threads import ThreadBudget
from dflashpipe.model import DFlashDrafter, DraftLoss, StepInputs, sample_anchor_positions
from dflashpipe.model.attention import resolve_backend
from dflashpipe.target.adapter import Target


def compiled_step(drafter: DFlashDrafter):
    """The training forward, compiled whole (fullgraph: a graph break is an error, never a silent eager frame).

    The compiled region returns a plain tuple and the DraftLoss is built outside it. Returning the
    NamedTuple itself makes dynamo build it through `DraftLoss._make`, a Python frame that dynamo
    intercepts on the way out of the compiled code; with several threads calling, that frame is
    sometimes seen as a new function, and the compile guard's fail_on_recompile stance stopped
    training on it (tests/scenarios/compile_guard.py `drafter_threads` reproduces it)."""

    def loss_terms(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(drafter(*inputs))

    compiled = torch.compile(loss_terms, dynamic=False, fullgraph=True)
    return lambda *inputs: DraftLoss(*compiled(*inputs))


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def step_inputs(drafter: DFlashDrafter, model: ModelParams, micro_batch: int, device: torch.device) -> StepInputs:
    """Inputs of the training step's exact static shapes and dtypes (values do not matter to a compile), with
    the target's hidden states at the slots when the drafter distils."""
    shape = (micro_batch, model.seq_len)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    mask = torch.ones(shape, dtype=torch.long, device=device)
    documents = torch.zeros(shape, dtype=torch.long, device=device)
    positions = torch.arange(model.seq_len, device=device).expand(shape).contiguous()
    anchors, valid = sample_anchor_positions(mask, model.num_anchors, torch.Generator().manual_seed(0))
    features = torch.zeros((*shape, drafter.config.feature_size), device=device, dtype=drafter.feature_dtype)
    inputs = StepInputs(features, ids, mask, anchors.to(device), valid.to(device), documents, positions)
    if drafter.distill == "none":
        return inputs
    slots = (micro_batch, model.num_anchors, model.block_size - 1, drafter.config.hidden_size)
    return replace(inputs, target_hidden=torch.zeros(slots, device=device, dtype=drafter.feature_dtype))


def run_step_once(
    step_fn: Any, drafter: DFlashDrafter, model: ModelParams, micro_batch: int, device: torch.device
) -> dict:
    """Forward and backward once; leaves no gradient behind. Returns what ran and how long it took."""
    inputs = step_inputs(drafter, model, micro_batch, device)
    began = time.perf_counter()
    with autocast(device):
        out = step_fn(*inputs.args())
    out.loss.backward()
    seconds = time.perf_counter() - began
    drafter.zero_grad(set_to_none=True)
    return {
        "name": "drafter_train_step",
        "shapes": {
            "features": list(inputs.features.shape),
            "input_ids": list(inputs.input_ids.shape),
            "anchors": list(inputs.anchors.shape),
        },
        "dtype": str(inputs.features.dtype).removeprefix("torch."),
        "device": str(device),
        "backend": resolve_backend(drafter.attention, device),
        "seconds": round(seconds, 3),
    }


def build_warmup_artifact(
    model: ModelParams,
    compile: CompileParams,
    target_dir: Path | str,
    out: Path | str,
    key: StageKey | None,
    target_dtype: str,
    devices: Sequence[str] = (),
    threads: ThreadBudget | None = None,
) -> dict:
    """Compile the training step in this (main) thread only, cold, once for each of `devices`, and write
    data/compile/.

    `devices`: topology.drafter_devices, where train's drafter replicas run the step (empty: CUDA when there is
    one, else the CPU). Compiled kernels are bound to their device (dynamo guards on it; inductor's cache keys
    hold it), so warmup compiles where the replicas run, not on the default device: on an 8-GPU node that is a
    target GPU. The target is loaded once, on the first of them; each other device gets a copy of the head the
    drafter borrows (what train gives its replicas). `target_dtype`: compute.target_dtype; the drafter borrows
    the target's embedding, norm and head in it, so it decides the compiled graph's dtypes. `threads`: train's
    budget (threads.training_budget); the step is compiled at its drafter count, the count train's drafter
    threads run it at (None: this thread's count). With compile.enabled false (`auto` on the CPU) nothing is
    compiled: the artifact records no graph, and train's replicas run eagerly.

    `key` is warmup's stage key, taken before anything is built: the artifact records it, and
    train and evaluate load the artifact only under the same key (None: an artifact they refuse).
    Single-threaded by construction: nothing here starts a thread, so no two compiles
    can race, and the cache it leaves is exactly what one process compiled.
    """
    from transformers import AutoTokenizer

    from dflashpipe.compile.artifact import BUILT_FOR, INTRA_OP_THREADS, built_for, point_inductor_at, write_artifact
    from dflashpipe.compile.guard import dynamo_counters, inductor_cache_counters
    from dflashpipe.core.artifacts import atomic_directory

    targets = [torch.device(d) for d in dict.fromkeys(devices)] or [
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ]
    if threads is not None:
        threads.apply("drafter", targets[0])
    with atomic_directory(out) as tmp:
        # Compile into a sibling of the partial output: a killed run leaves both behind, and the next
        # run's atomic_directory removes them (a system temp directory would leak on every kill).
        cache = point_inductor_at(tmp.with_name(tmp.name + "-inductor"))
        try:
            target = Target.load(target_dir, targets[0], target_dtype)
            tokenizer = AutoTokenizer.from_pretrained(target_dir)
            graphs = []
            for device in targets if compile.enabled else []:
                drafter = DFlashDrafter.for_target(
                    target.model, tokenizer, model, generator=torch.Generator().manual_seed(0)
                )
                drafter.target = drafter.target.on(device)
                drafter = drafter.to(device)
                print(
                    f"warmup: compiling the training step ({compile.micro_batch} x {model.seq_len}) on "
                    f"{device}, in this thread only",
                    flush=True,
                )
                graphs.append(run_step_once(compiled_step(drafter), drafter, model, compile.micro_batch, device))
            if not compile.enabled:
                print(f"warmup: compile.enabled is false on {', '.join(map(str, targets))}: nothing to compile")
            report = {
                "graphs": graphs,
                "devices": [str(d) for d in targets],
                "counters": {**dynamo_counters(), **inductor_cache_counters()},
                # The key's inputs include the fingerprint's kernel facts (torch build, GPUs, compile
                # variables), so they are on record here too, without a second list of them.
                BUILT_FOR: built_for(key),
                # the kernels are bound to it (dynamo guards on it; inductor's cache key holds it)
                INTRA_OP_THREADS: torch.get_num_threads(),
                "threads": threads.to_json() if threads is not None else None,
                "cache": "inductor cache directory" + (" + mega-cache" if targets[0].type == "cuda" else ""),
            }
            write_artifact(tmp, cache, report, with_mega_cache=targets[0].type == "cuda")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return report
