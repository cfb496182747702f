"""The floor a drafter has to beat: a bigram table counted on its own training tokens, drafting the same prompts.

A DFlash drafter's slot 1 predicts the token after its anchor, and it sees the anchor, so the most frequent next
token after each token (counted where the training data supervises the next token) is what a drafter that has
learnt nothing but its anchor would propose. Run as a drafter (each proposal the table's entry for the one
before it) on the target's own greedy output for evaluate's prompts, with the loop's acceptance rule, it gives a
slot-1 acceptance and a tau that the trained drafter's, on the same prompts, should exceed.

Counting reads at most MAX_PAIRS supervised pairs, in the training data's order: a floor, not a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

MAX_PAIRS = 20_000_000
"""Supervised (token, next) pairs counted at most: the first shards of a large training set are plenty."""


def bigram_table(tokens_dir: Path | str) -> tuple[dict[int, int], int]:
    """{token: the next token seen most often after it} over the supervised positions of data/tokens/ (ties: the
    smaller id), and how many pairs were counted."""
    from dflashpipe.tokens.shards import load_tokens

    data, parts, counted = load_tokens(tokens_dir), [], 0
    for i in range(len(data)):
        ids, mask = data.sequence(i)
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.flatnonzero(np.asarray(mask[1:], dtype=bool)) + 1  # positions whose token is supervised
        parts.append(ids[labels - 1] << 32 | ids[labels])
        counted += len(labels)
        if counted >= MAX_PAIRS:
            break
    if not parts:
        return {}, 0
    pairs, counts = np.unique(np.concatenate(parts)[:MAX_PAIRS], return_counts=True)
    before, after = pairs >> 32, pairs & 0xFFFFFFFF
    # per `before` (pairs sorted by it, then by `after`): the first of its largest counts
    order = np.lexsort((after, -counts, before))
    first = np.concatenate([[True], before[order][1:] != before[order][:-1]])
    chosen = order[first]
    return dict(zip(before[chosen].tolist(), after[chosen].tolist(), strict=True)), int(min(counted, MAX_PAIRS))


def draft_with_table(table: dict[int, int], tokens: Sequence[int], block_size: int) -> tuple[list[int], list[int]]:
    """The table drafting the greedy output `tokens` (its first token the prefill's) as speculative_generate
    verifies a block: per step, how many proposals were accepted and how many slots were verified."""
    accepted, verified, done = [], [], 1
    while done < len(tokens):
        size = min(block_size, len(tokens) - done + 1)
        proposal, held = tokens[done - 1], 0
        for k in range(size - 1):
            proposal = table.get(proposal, -1)
            if proposal != tokens[done + k]:
                break
            held += 1
        accepted.append(held)
        verified.append(size - 1)
        done += held + 1
    return accepted, verified


def bigram_floor(table: dict[int, int], counted: int, outputs: list[Sequence[int]], block_size: int) -> dict:
    """The table's slot-1 acceptance and tau drafting every output in `outputs`, as metrics/eval.json records it."""
    steps = [draft_with_table(table, tokens, block_size) for tokens in outputs]
    accepted = [a for acc, _ in steps for a in acc]
    slot_1 = sum(1 for acc, ver in steps for a, v in zip(acc, ver, strict=True) if v >= 1 and a >= 1)
    tried = sum(1 for _, ver in steps for v in ver if v >= 1)
    produced = sum(len(tokens) - 1 for tokens in outputs)
    return {
        "counted_pairs": counted,
        "slot_1_acceptance": round(slot_1 / tried, 4) if tried else 0.0,
        "tau": round(produced / len(accepted), 4) if accepted else 0.0,
    }
