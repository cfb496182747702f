"""Compile-guard scenarios, one per process (dynamo's state is per process and sticky).

    python tests/scenarios/compile_guard.py SCENARIO ARTIFACT_DIR
    python tests/scenarios/compile_guard.py drafter_threads STEPS

Prints one JSON line with what happened; tests/test_compile.py asserts on it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflashpipe.compile.artifact import (  # noqa: E402
    BUILT_FOR,
    built_for,
    load_artifact,
    point_inductor_at,
    write_artifact,
)
from dflashpipe.compile.guard import COUNTER, CompileGuard, dynamo_counters  # noqa: E402
from dflashpipe.core.pipeline import StageKey  # noqa: E402

SEQ = 256
KEY = StageKey(
    "warmup", {"dep:tests/scenarios/compile_guard.py": "flex-causal-256", "param:params.yaml:model.seq_len": "256"}
)
"""The stage key the `cold` scenario's artifact is built for and the others load it under (as warmup and train do)."""


def causal(b, h, q, kv):
    return q >= kv


def setup():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    q = torch.randn(1, 2, SEQ, 16)
    mask = create_block_mask(causal, None, None, SEQ, SEQ, device="cpu")
    return torch, flex, flex_attention, create_block_mask, q, mask


def in_threads(n, fn):
    errors = []

    def run(i):
        try:
            fn(i)
        except Exception as exc:  # reported, asserted by the test
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,), name=f"drafter-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def packed_batch(drafter, step: int) -> tuple:
    """The train loop's 7 step inputs for a packed row whose documents (and so anchors) change with `step`."""
    import torch

    from dflashpipe.model import sample_anchor_positions
    from tests.tiny import random_batch

    features, ids, loss_mask, _, _ = random_batch(drafter)
    g = torch.Generator().manual_seed(step)
    starts = torch.rand(ids.shape, generator=g) < 0.15
    starts[:, 0] = True
    documents = starts.long().cumsum(dim=1) - 1
    index = torch.arange(ids.shape[1]).expand_as(ids)
    positions = index - torch.where(starts, index, 0).cummax(dim=1).values
    anchors, valid = sample_anchor_positions(loss_mask, 3, g, documents)
    return features, ids, loss_mask, anchors, valid, documents, positions


def drafter_threads(steps: int) -> dict:
    """Three drafter replicas, each compiled and run once in the main thread as train does, then
    trained `steps` steps each in its own thread under the armed guard, on packed rows of other
    documents every step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from dflashpipe.compile.warmup import compiled_step
    from tests.tiny import tiny_drafter

    point_inductor_at(Path(tempfile.mkdtemp()))
    COUNTER.install()
    replicas = [tiny_drafter(layers=1) for _ in range(3)]
    steps_fn = [compiled_step(d) for d in replicas]
    batches = [packed_batch(replicas[0], step) for step in range(steps + 1)]
    for fn in steps_fn:
        fn(*batches[0]).loss.backward()
    guard = CompileGuard(strict=True)
    guard.arm()
    before = dynamo_counters()

    def train(i: int) -> None:
        for step in range(1, steps + 1):
            guard.call("drafter step", steps_fn[i], *batches[step]).loss.backward()
            replicas[i].zero_grad(set_to_none=True)

    errors = in_threads(3, train)
    after = dynamo_counters()
    return {
        "errors": errors,
        "new_graphs": after["unique_graphs"] - before["unique_graphs"],
        "compiles_outside_main_thread": after["compiles_outside_main_thread"],
    }


def main(scenario: str, arg: str) -> dict:
    if scenario == "drafter_threads":  # arg: steps per thread
        return drafter_threads(int(arg))
    artifact = Path(arg)
    if scenario == "cold":
        cache = point_inductor_at(Path(tempfile.mkdtemp()))
    else:  # as train does: the artifact first, so the main thread's compile is a warm one
        load_artifact(artifact, Path(tempfile.mkdtemp()) / "cache", KEY)
    COUNTER.install()
    torch, flex, eager_flex, create_block_mask, q, mask = setup()
    flex(q, q, q, block_mask=mask)  # the main thread compiles once
    from torch._dynamo.utils import counters

    result = {"fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"])}
    if scenario == "cold":
        write_artifact(artifact, cache, {BUILT_FOR: built_for(KEY)}, with_mega_cache=False)
        return result
    guard = CompileGuard(strict=True)
    guard.arm()
    before = dynamo_counters()
    if scenario in ("warm", "threads"):
        result["errors"] = in_threads(
            3, lambda i: [guard.call("flex", flex, q, q, q, block_mask=mask) for _ in range(20)]
        )
    elif scenario == "new_shape":
        bigger = torch.randn(1, 2, SEQ * 2, 16)
        big_mask = create_block_mask(causal, None, None, SEQ * 2, SEQ * 2, device="cpu")
        result["errors"] = in_threads(
            1, lambda i: guard.call("flex", flex, bigger, bigger, bigger, block_mask=big_mask)
        )
    elif scenario == "eager_flex":
        result["errors"] = in_threads(1, lambda i: guard.call("flex", eager_flex, q, q, q, block_mask=mask))
    elif scenario == "fx_race":
        # Deterministic, not a timing race: the tracer thread parks inside a traced forward, so the
        # process-global flag is set for the whole time the worker calls the compiled function.
        tracing, release = threading.Event(), threading.Event()

        class Parked(torch.nn.Module):
            def forward(self, x):
                tracing.set()
                release.wait(timeout=120)
                return x * 2

        tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(Parked()), name="fx-tracer")
        tracer.start()
        tracing.wait(timeout=120)
        try:
            result["errors"] = in_threads(1, lambda i: guard.call("flex", flex, q, q, q, block_mask=mask))
        finally:
            release.set()
            tracer.join()
    after = dynamo_counters()
    result["new_graphs"] = after["unique_graphs"] - before["unique_graphs"]
    result["compiles_outside_main_thread"] = after["compiles_outside_main_thread"]
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
