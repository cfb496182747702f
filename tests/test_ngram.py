"""benchmarks/ngram.py: the n-gram floor that a drafter reading its anchor should pass."""

from __future__ import annotations

import importlib.util

import numpy as np

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("ngram", ROOT / "benchmarks" / "ngram.py")
ngram = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ngram)


def rows(rule, count: int, length: int = 40, seed: int = 0):
    """Sequences whose token after the first two follows `rule(two tokens before)`; the first half unsupervised."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = list(rng.integers(0, 10, size=2))
        while len(ids) < length:
            ids.append(rule(ids[-2], ids[-1]))
        mask = np.arange(length) >= length // 2
        out.append((np.asarray(ids), mask))
    return out


def test_a_table_learns_what_the_tokens_before_decide_and_only_supervised_tokens_count():
    bigram_rule = rows(lambda a, b: (b + 3) % 10, 20)
    assert ngram.accuracy(bigram_rule[:10], bigram_rule[10:], 2) == 1.0
    assert ngram.accuracy(bigram_rule[:10], bigram_rule[10:], 1) < 0.5  # one most frequent token
    trigram_rule = rows(lambda a, b: (a * 3 + b) % 10, 200)
    bigram, trigram = (ngram.accuracy(trigram_rule[:150], trigram_rule[150:], n) for n in (2, 3))
    assert trigram == 1.0 and bigram < 0.9
    assert sum(1 for _ in ngram.pairs(bigram_rule[:1], 1)) == 20  # the supervised half only
