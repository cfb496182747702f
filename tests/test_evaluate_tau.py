"""How evaluate counts tau (the paper's way and pooled), its spread, the per-benchmark rows and the lean
metrics/eval.json (issue 46's contract 3), on hand-made decoding runs."""

from __future__ import annotations

import torch

from dflashpipe.evaluate.metrics import (
    DEFINITIONS,
    PromptResult,
    bootstrap_interval,
    eval_metrics,
    lean_metrics,
    tau_paper,
    tau_pooled,
)
from dflashpipe.evaluate.prompts import BENCHMARK, HELD_OUT, TRAIN, EvalPrompt
from dflashpipe.evaluate.speculative import Decoded

CONTRACT_3 = {"tau", "tau_pooled", "speedup", "floor_tau", "lossless", "benchmarks"}


def run(accepted: list[int], seconds: float = 1.0) -> Decoded:
    """A speculative run whose steps accepted `accepted` drafts each (every step commits accepted + 1 bonus)."""
    tokens = list(range(1 + sum(a + 1 for a in accepted)))  # the prefill's token first: no step's
    return Decoded(tokens, seconds, 0.0, accepted, [a + 1 for a in accepted], [4] * len(accepted), verified=tokens)


def result(accepted: list[int], split: str = HELD_OUT, benchmark: str = HELD_OUT, turn: int = 1) -> PromptResult:
    spec = run(accepted)
    plain = Decoded(spec.tokens, 0.5 * (len(spec.tokens) - 1), 0.0, verified=spec.tokens)
    prompt = EvalPrompt(f"{benchmark}-{len(accepted)}", "src", [1], split, benchmark, turn)
    return PromptResult(prompt, plain, spec, torch.float32)


def test_the_paper_averages_per_request_and_pooling_weighs_a_long_request_more():
    # a short request that drafts well (2 steps of 4 tokens: tau 4) and a long one that does not (6 steps of 1)
    short, long = run([3, 3]), run([0] * 6)
    assert (short.tau, long.tau) == (4.0, 1.0)
    assert tau_paper([short, long]) == 2.5  # (4 + 1) / 2: each request counts once
    assert tau_pooled([short, long]) == round(14 / 8, 4)  # (8 + 6) tokens / 8 steps
    # equal-length requests agree both ways; a request that stopped at its prefill token has no step and no tau
    assert tau_paper([run([1, 1]), run([3, 3])]) == tau_pooled([run([1, 1]), run([3, 3])]) == 3.0
    assert tau_paper([short, run([])]) == 4.0 and tau_pooled([]) == tau_paper([]) == 0.0


def test_the_bootstrap_interval_is_deterministic_and_narrows_with_more_requests():
    taus = [1.0, 1.2, 1.1, 1.4, 1.0, 1.3, 1.05, 1.15]
    low, high = bootstrap_interval(taus)
    assert low < sum(taus) / len(taus) < high and bootstrap_interval(taus) == [low, high]
    wider = bootstrap_interval(taus[:3])
    assert wider[1] - wider[0] > high - low
    assert bootstrap_interval([1.5]) == [1.5, 1.5] and bootstrap_interval([]) == [0.0, 0.0]


def test_a_row_per_benchmark_held_out_first_and_the_lean_file_holds_contract_3_alone():
    results = [
        result([3, 3]),
        result([0] * 6),
        result([2, 2], TRAIN, TRAIN),
        result([1, 1], BENCHMARK, "mt_bench", 1),
        result([3, 3, 3, 3], BENCHMARK, "mt_bench", 2),
        result([3], BENCHMARK, "humaneval"),
    ]
    detail, tables = eval_metrics(results, 4, max_new_tokens=32)
    rows = detail["benchmarks"]
    assert list(rows) == [HELD_OUT, "mt_bench", "humaneval"]  # training prompts stay for train_vs_held_out
    held = rows[HELD_OUT]
    assert (held["tau"], held["tau_pooled"], held["requests"]) == (2.5, round(14 / 8, 4), 2)
    assert (detail["tau"], detail["tau_pooled"]) == (held["tau"], held["tau_pooled"])
    assert held["speedup"] == 3.5  # plain: 0.5 s per new token; speculative: 14 new tokens in 2 s
    assert held["tau_interval_95"][0] <= 2.5 <= held["tau_interval_95"][1]
    assert held["acceptance_per_position"] == {"1": 0.25, "2": 0.25, "3": 0.25}  # 2 of 8 steps accepted each
    assert held["max_new_tokens"] == 32 and held["mean_new_tokens"] == 8.0
    mt_bench = rows["mt_bench"]  # turns of tau 2 and 4: one request each
    assert (mt_bench["requests"], mt_bench["tau"], mt_bench["tau_pooled"]) == (2, 3.0, round(20 / 6, 4))
    assert [r["benchmark"] for r in tables["tau_per_benchmark"]] == list(rows)
    assert [r["turn"] for r in tables["speedup_per_prompt"]] == [1, 1, 1, 1, 2, 1]

    detail["floor"] = {"bigram": {"tau": 1.02, "slot_1_acceptance": 0.01}}
    lean = lean_metrics(detail)
    assert set(lean) == CONTRACT_3 and lean["floor_tau"] == 1.02 and lean["lossless"] is True
    assert lean["benchmarks"]["mt_bench"] == {"tau": 3.0, "tau_pooled": 3.3333, "speedup": mt_bench["speedup"]}
    assert all(set(row) == {"tau", "tau_pooled", "speedup"} for row in lean["benchmarks"].values())
    assert {"tau", "tau_pooled", "tau_interval_95", "speedup", "acceptance_per_position"} <= set(DEFINITIONS)
    assert lean_metrics({**detail, "floor": {}})["floor_tau"] is None  # no training tokens: no floor counted


def test_the_thinking_setting_is_what_the_template_was_rendered_with():
    from dflashpipe.evaluate.evaluation import thinking_setting

    assert thinking_setting({"enable_thinking": False}) == "enable_thinking=false"
    assert thinking_setting({}) == "template default"
