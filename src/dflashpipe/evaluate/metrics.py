"""From decoded requests to metrics/eval.json (the figures a sweep compares), metrics/detail/eval.json (everything
else, each figure's definition beside it) and the plot tables and images under metrics/eval/.

tau is counted as the DFlash paper counts it: per request, tokens committed per verify step (accepted drafts + 1
bonus), averaged over the request's steps, then the mean over requests. `tau_pooled` divides all committed tokens
by all verify steps, which weighs a long request more. Neither counts the prefill's first token: it is no verify
step's."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflashpipe.core import plots as plotting
from dflashpipe.core.artifacts import write_bytes_atomic, write_json_atomic
from dflashpipe.core.spread import Busy, Spread
from dflashpipe.evaluate import lossless
from dflashpipe.evaluate.prompts import BENCHMARK, HELD_OUT, TRAIN, EvalPrompt
from dflashpipe.evaluate.speculative import STEP_PARTS, Decoded

PLOTS_DIR = "eval"
PLOT_TABLES = ("tau_per_source", "tau_per_benchmark", "slot_acceptance", "speedup_per_prompt")
"""metrics/eval/<name>.json, each declared under the evaluate stage's `plots:` in dvc.yaml."""
PLOT_IMAGES = ("tau_per_source", "tau_per_benchmark", "slot_acceptance")
"""metrics/eval/<name>.png: static images of those tables, also declared (as image plots) in dvc.yaml."""


@dataclass
class PromptResult:
    prompt: EvalPrompt
    target: Decoded
    """Target-only greedy decoding: the tokens every speculative run must reproduce, or depart from only at a
    near-tie (dflashpipe.evaluate.lossless)."""
    speculative: Decoded
    dtype: torch.dtype
    """What the target computed in: float32 expects exact equality with `target`."""
    fastest: Decoded | None = None
    """Plain decoding in the dtype this device decodes fastest in, where `target` ran in another (else None)."""
    fastest_dtype: torch.dtype | None = None
    violations: list[int] = field(init=False)
    """Positions where the speculative run emitted a token its own verify forward did not choose."""
    divergence: lossless.Divergence | None = field(init=False)
    """The first position where it left `target`'s tokens, judged; None when they agree."""

    def __post_init__(self) -> None:
        spec, plain = self.speculative, self.target
        self.violations = lossless.exact_violations(spec.tokens, spec.verified)
        self.divergence = lossless.judge(plain.tokens, plain.logits, spec.tokens, spec.logits, self.dtype)
        for run in (spec, plain, self.fastest):  # judged: a prompt's rows (tokens x vocab) need not stay
            if run is not None:
                run.logits = []

    @property
    def baseline(self) -> Decoded:
        """The plain decoding that speedup and a step's cost divide by: the fastest this device has."""
        return self.fastest or self.target

    @property
    def lossless(self) -> bool:
        return not self.violations and (self.divergence is None or self.divergence.verdict == lossless.NUMERICS)

    def record(self) -> dict:
        """The prompt's contract entry in metrics/eval.json."""
        return {
            "id": self.prompt.sample_id,
            "split": self.prompt.split,
            "source": self.prompt.source,
            "exact": not self.violations,
            "not_verified_at": self.violations,
            "divergence": self.divergence.to_json() if self.divergence else None,
        }


def _baseline_dtype(results: list[PromptResult]) -> str | None:
    """The dtype the plain decoding that speedup divides by ran in (None: no prompt decoded)."""
    dtypes = {str(r.fastest_dtype or r.dtype).removeprefix("torch.") for r in results}
    return dtypes.pop() if len(dtypes) == 1 else None


def lossless_record(results: list[PromptResult]) -> dict:
    """The contract over every prompt decoded: `lossless`, how many matched plain greedy exactly, and each
    prompt that did not (its first divergence, margins and verdict) or that broke exactness."""
    departed = [r for r in results if r.violations or r.divergence is not None]
    return {
        "lossless": all(r.lossless for r in results),
        "contract": {
            "prompts": len(results),
            "exact": sum(not r.violations for r in results),
            "equal_to_plain": sum(r.divergence is None for r in results),
            "numerics": sum(r.divergence is not None and r.divergence.verdict == lossless.NUMERICS for r in results),
            "bugs": sum(not r.lossless for r in results),
            "departures": [r.record() for r in departed],
        },
    }


def _per_token(decoded: list[Decoded]) -> float:
    tokens = sum(d.decode_tokens for d in decoded)
    return sum(d.decode_s for d in decoded) / tokens if tokens else 0.0


def decode_rates(decoded: list[Decoded]) -> Spread:
    """Decode tokens/s per prompt: the repeats whose spread tells a throughput change from noise."""
    rates = [d.decode_tokens / d.decode_s for d in decoded if d.decode_tokens and d.decode_s > 0]
    return Spread.of(rates or [0.0])


def tau_over_prompts(decoded: list[Decoded]) -> dict:
    """Each prompt's tau: median, quartiles, min and max over the prompts, and how many."""
    taus = sorted(d.tau for d in decoded if d.produced) or [0.0]
    # statistics.quantiles needs two values; one prompt is its own median and quartiles
    quartiles = statistics.quantiles(taus, n=4, method="inclusive") if len(taus) > 1 else taus * 3
    q1, median, q3 = (round(q, 4) for q in quartiles)
    low, high = round(taus[0], 4), round(taus[-1], 4)
    prompts = sum(bool(d.produced) for d in decoded)
    return {"median": median, "q1": q1, "q3": q3, "min": low, "max": high, "prompts": prompts}


DEFINITIONS = {
    "tau": "per request: tokens committed (accepted drafts + 1 bonus) per verify step, averaged over its steps; "
    "then the mean over requests (the DFlash paper's count). The prefill's first token is no verify step's: "
    "not counted",
    "tau_pooled": "all committed tokens over all verify steps of the row's requests (a long request weighs more)",
    "tau_interval_95": "95% bootstrap interval of tau's mean over requests (2000 resamples, seed 0): two runs whose "
    "intervals do not overlap differ by more than the prompts' noise",
    "speedup": "plain greedy decoding's seconds per new token over speculative decoding's, summed over the row's "
    "requests (one sequence, after the prefill)",
    "acceptance_per_position": "position k: the share of verify steps that checked the k-th draft in which it "
    "was accepted",
    "requests": "decoded requests: one per turn (a second turn is asked after the target's own first reply)",
    "mean_new_tokens": "mean tokens a request produced, the prefill's first included, at most max_new_tokens",
    "floor_tau": "tau of a bigram table counted on the training tokens, drafting the held-out plain outputs",
}
"""Each figure's definition, written beside it in metrics/detail/eval.json."""

BOOTSTRAP_RESAMPLES = 2000


def tau_per_request(decoded: list[Decoded]) -> list[float]:
    """Each request's tau (committed tokens per verify step); a request that stopped at its prefill token has none."""
    return [d.tau for d in decoded if d.produced]


def tau_paper(decoded: list[Decoded]) -> float:
    """The mean over requests of each request's tau (DEFINITIONS["tau"])."""
    taus = tau_per_request(decoded)
    return round(sum(taus) / len(taus), 4) if taus else 0.0


def tau_pooled(decoded: list[Decoded]) -> float:
    steps = sum(len(d.produced) for d in decoded)
    return round(sum(sum(d.produced) for d in decoded) / steps, 4) if steps else 0.0


def bootstrap_interval(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """The 95% percentile bootstrap interval of the mean of `values`: a fixed seed, so the same values give the
    same bytes. One value (or none) has no spread: its interval is that value."""
    if len(values) < 2:
        return [round(values[0], 4)] * 2 if values else [0.0, 0.0]
    import numpy as np

    draws = np.random.default_rng(seed).choice(np.asarray(values), size=(resamples, len(values)), replace=True)
    low, high = np.percentile(draws.mean(axis=1), [2.5, 97.5])
    return [round(float(low), 4), round(float(high), 4)]


def _summary(results: list[PromptResult]) -> dict:
    spec = [r.speculative for r in results]
    base, ours = _per_token([r.baseline for r in results]), _per_token(spec)
    return {
        "prompts": len(results),
        "new_tokens": sum(len(d.tokens) for d in spec),
        "verify_steps": sum(len(d.produced) for d in spec),
        "tau": tau_paper(spec),
        "tau_pooled": tau_pooled(spec),
        "tau_over_prompts": tau_over_prompts(spec),
        "speedup": round(base / ours, 4) if ours else 0.0,
    }


def benchmark_row(results: list[PromptResult], block_size: int, max_new_tokens: int) -> dict:
    """One row of the per-benchmark table: its figures (DEFINITIONS) over the row's requests."""
    spec = [r.speculative for r in results]
    summary = _summary(results)
    return {
        "tau": summary["tau"],
        "tau_pooled": summary["tau_pooled"],
        "speedup": summary["speedup"],
        "tau_interval_95": bootstrap_interval(tau_per_request(spec)),
        "acceptance_per_position": slot_acceptance(spec, block_size),
        "requests": len(results),
        "max_new_tokens": max_new_tokens,
        "mean_new_tokens": round(summary["new_tokens"] / len(results), 2) if results else 0.0,
    }


def rows_of(results: list[PromptResult]) -> dict[str, list[PromptResult]]:
    """The table's rows: `held_out` (the eval split, every source), then each benchmark in decode order."""
    rows: dict[str, list[PromptResult]] = {HELD_OUT: [r for r in results if r.prompt.split == HELD_OUT]}
    for r in results:
        if r.prompt.split == BENCHMARK:
            rows.setdefault(r.prompt.benchmark, []).append(r)
    return rows


def train_vs_held_out(results: list[PromptResult], block_size: int) -> dict:
    """tau and slot-1 acceptance on prompts of the training distribution and on held-out ones, and the gap
    (train minus held-out: how much of the drafter's acceptance does not carry over to unseen prompts)."""
    sides = {}
    for split in (TRAIN, HELD_OUT):
        chosen = [r for r in results if r.prompt.split == split]
        summary = _summary(chosen)
        sides[split] = {
            "prompts": summary["prompts"],
            "tau": summary["tau"],
            "tau_over_prompts": summary["tau_over_prompts"],
            "slot_1_acceptance": slot_acceptance([r.speculative for r in chosen], block_size).get("1", 0.0),
        }
    gap = {key: round(sides[TRAIN][key] - sides[HELD_OUT][key], 4) for key in ("tau", "slot_1_acceptance")}
    return {**sides, "gap": gap}


def step_profile(results: list[PromptResult]) -> dict:
    """Where a verify step's time goes: each part's share of the step time (STEP_PARTS, and `other`: the
    loop and clocks between them), and a step's cost in plain decode steps (seconds per verify step over
    the same prompt's seconds per target-only token). Medians over prompts with their spread: a share
    is a ratio within one run, so a busier machine moves it less than it moves seconds."""
    runs = [r for r in results if r.speculative.profile.get("step") and r.baseline.decode_tokens]
    if not runs:
        return {"prompts": 0}
    shares = {part: [r.speculative.profile[part] / r.speculative.profile["step"] for r in runs] for part in STEP_PARTS}
    shares["other"] = [1 - sum(shares[part][i] for part in STEP_PARTS) for i in range(len(runs))]
    cost = [
        (r.speculative.profile["step"] / len(r.speculative.produced)) / (r.baseline.decode_s / r.baseline.decode_tokens)
        for r in runs
    ]
    return {
        "prompts": len(runs),
        "verify_steps": sum(len(r.speculative.produced) for r in runs),
        "share": {part: Spread.of(values).record("share", digits=3) for part, values in shares.items()},
        **Spread.of(cost).record("step_over_decode_step", digits=3),
    }


def slot_acceptance(decoded: list[Decoded], block_size: int) -> dict[str, float]:
    """Per block slot k (1 .. bs-1): the share of steps that verified slot k in which it was accepted."""
    rates = {}
    for k in range(1, block_size):
        verified = sum(1 for d in decoded for size in d.sizes if size > k)
        accepted = sum(1 for d in decoded for a in d.accepted if a >= k)
        rates[str(k)] = round(accepted / verified, 4) if verified else 0.0
    return rates


def eval_metrics(
    everything: list[PromptResult], block_size: int, busy: Busy | None = None, max_new_tokens: int = 0
) -> tuple[dict, dict[str, list[dict]]]:
    """metrics/detail/eval.json's decoding part, and the plot tables. The headline figures are the held-out
    prompts'; `benchmarks` holds a row per benchmark (rows_of); the lossless check and the step profile cover
    every request decoded. `busy`: what the machine gave the decoding, and the control beside it, recorded with
    each rate."""
    rows = rows_of(everything)
    results = rows[HELD_OUT]
    spec = [r.speculative for r in results]
    sources = sorted({r.prompt.source for r in results})
    per_source = {s: _summary([r for r in results if r.prompt.source == s]) for s in sources}
    histogram = {str(a): sum(d.accepted.count(a) for d in spec) for a in range(block_size)}
    benchmarks = {name: benchmark_row(chosen, block_size, max_new_tokens) for name, chosen in rows.items()}
    metrics = {
        **_summary(results),
        "benchmarks": benchmarks,
        # what speedup, step_over_decode_step and decode_tokens_per_s.target divide by or are
        "baseline": {"decoding": "plain greedy, one sequence", "dtype": _baseline_dtype(everything)},
        # the median over prompts, with its spread: {target, target_spread, speculative, speculative_spread}
        "decode_tokens_per_s": {
            **decode_rates([r.baseline for r in results]).record("target", busy=busy),
            **decode_rates(spec).record("speculative", busy=busy),
        },
        **lossless_record(everything),
        "per_source": per_source,
        "slot_acceptance": slot_acceptance(spec, block_size),
        "accepted_histogram": histogram,
        "train_vs_held_out": train_vs_held_out(everything, block_size),
        "step_profile": step_profile(everything),
    }
    tables = {
        "tau_per_source": [{"source": s, "tau": v["tau"]} for s, v in per_source.items()],
        "tau_per_benchmark": [{"benchmark": name, "tau": row["tau"]} for name, row in benchmarks.items()],
        "slot_acceptance": [{"slot": int(k), "acceptance": v} for k, v in metrics["slot_acceptance"].items()],
        "speedup_per_prompt": [
            {
                "prompt": i,
                "id": r.prompt.sample_id,
                "source": r.prompt.source,
                "split": r.prompt.split,
                "benchmark": r.prompt.benchmark,
                "turn": r.prompt.turn,
                **_summary([r]),
            }
            for i, r in enumerate(everything)
        ],
    }
    return metrics, tables


LEAN_ROW = ("tau", "tau_pooled", "speedup")


def lean_metrics(detail: dict) -> dict:
    """metrics/eval.json: exactly the figures a sweep compares (issue 46's contract 3); the rest is the detail's."""
    floor = detail.get("floor", {}).get("bigram", {}).get("tau")
    return {
        "tau": detail["tau"],
        "tau_pooled": detail["tau_pooled"],
        "speedup": detail["speedup"],
        "floor_tau": floor,
        "lossless": detail["lossless"],
        "benchmarks": {name: {k: row[k] for k in LEAN_ROW} for name, row in detail["benchmarks"].items()},
    }


def plot_images(tables: dict[str, list[dict]]) -> dict[str, bytes]:
    """PNG images of tau per source and per benchmark and acceptance per slot: the same tables give the same bytes."""
    specs = {
        "tau_per_source": plotting.bar_spec(
            tables["tau_per_source"], "source", "tau", "tau (tokens per verify step) per source", horizontal=True
        ),
        "tau_per_benchmark": plotting.bar_spec(
            tables["tau_per_benchmark"], "benchmark", "tau", "tau (paper count) per benchmark", horizontal=True
        ),
        "slot_acceptance": plotting.bar_spec(
            tables["slot_acceptance"],
            "slot",
            "acceptance",
            "acceptance per block slot",
            category_title="block slot",
            value_title="accepted / verified",
        ),
    }
    return {name: plotting.png(specs[name]) for name in PLOT_IMAGES}


def write_plot_tables(tables: dict[str, list[dict]], metrics_dir: Path | str) -> None:
    """The plot tables (JSON) and their images (PNG), each file written atomically."""
    images = plot_images(tables)  # rendered first: a rendering error writes nothing
    for name in PLOT_TABLES:
        write_json_atomic(Path(metrics_dir) / PLOTS_DIR / f"{name}.json", tables[name])
    for name in PLOT_IMAGES:
        write_bytes_atomic(Path(metrics_dir) / PLOTS_DIR / f"{name}.png", images[name])
