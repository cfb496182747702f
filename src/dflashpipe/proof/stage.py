"""The `proof` stage: the overfit proof on the pipeline's own target and drafter shape, its figure recorded.

metrics/proof.json holds what a sweep or a bisection compares: the memorised tau after `proof.steps` steps and
whether it met the bar (`proof.min_tau`); the rest is in metrics/detail/proof.json. The proof's data and drafter
live in a scratch directory and are removed after it: only the figure is an output, and the stage is data-free
(growing the training data never reruns it), like warmup and bench.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dflashpipe.core.metrics import write_metrics
from dflashpipe.core.params import ComputeParams, ModelParams
from dflashpipe.core.params.sections import ProofParams
from dflashpipe.proof.run import ProofDataError, ProofRun, memorise


def run_proof(
    params: ProofParams,
    model: ModelParams,
    compute: ComputeParams,
    target_dir: Path | str,
    metrics_path: Path | str,
    root: Path | str = ".",
    template_kwargs: dict | None = None,
) -> dict:
    from dflashpipe.target.chat import load_chat_tokenizer

    root = Path(root)
    load_chat_tokenizer(target_dir, template_kwargs)  # a kwarg the template does not read: refused before any work
    run = ProofRun.of(params, model, compute, template_kwargs)
    # a scratch directory of DVC's own: removed before a run and after a passing one, kept after a failure to look at
    work = root / ".dvc" / "tmp" / "proof"
    shutil.rmtree(work, ignore_errors=True)
    try:
        [c] = memorise(run, Path(target_dir), work, [params.steps], root)
    except ProofDataError as exc:
        # recorded as a failed proof, never a pass and never a silent skip (a random test target answers nothing)
        metrics = {"tau": None, "min_tau": params.min_tau, "passed": False, "failed": str(exc)}
        write_metrics(metrics_path, metrics, name="proof")
        print(f"proof: FAILED: {exc}")
        return metrics
    shutil.rmtree(work, ignore_errors=True)
    passed = c.lossless and c.exact_prompts == c.prompts and c.tau >= params.min_tau
    metrics = {
        "tau": c.tau,
        "min_tau": params.min_tau,
        "passed": passed,
        "steps": c.steps,
        "final_loss": c.final_loss,
        "supervised_tokens_per_step": round(c.supervised_tokens / c.steps, 1),
        "train_acceptance": c.train_acceptance,
        "prompts": c.prompts,
        "exact_prompts": c.exact_prompts,
        "lossless": c.lossless,
        "lengths": c.lengths,
        "slot_acceptance": c.slot_acceptance,
        "seconds": {"train": c.train_s, "decode": c.decode_s},
    }
    write_metrics(metrics_path, metrics, name="proof")
    verdict = "passed" if passed else "FAILED"
    print(f"proof: tau {c.tau:.3f} after {c.steps} steps (bar {params.min_tau}): {verdict}")
    return metrics
