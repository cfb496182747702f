"""The bigram floor (dflashpipe.evaluate.floor): counted exactly on the training tokens, drafting as the loop does."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from dflashpipe.evaluate.floor import bigram_floor, bigram_table, draft_with_table
from dflashpipe.tokens.run import tokenize_manifest
from dflashpipe.tokens.shards import load_tokens
from tests.test_tokenize import KEY, PARAMS, chat_jsonl, manifest


def test_the_table_drafts_blocks_with_the_loops_acceptance_rule():
    table = {1: 2, 2: 3, 3: 4, 9: 1}
    # block 4: anchor 1 proposes 2 3 4 against 2 3 9 (two held, 9 the bonus); anchor 9 proposes 1 2 3 against 1 2 3
    accepted, verified = draft_with_table(table, [1, 2, 3, 9, 1, 2, 3], 4)
    assert (accepted, verified) == ([2, 3], [3, 3])
    floor = bigram_floor(table, 10, [[1, 2, 3, 9, 1, 2, 3]], 4)
    assert floor == {"counted_pairs": 10, "slot_1_acceptance": 1.0, "tau": 3.0}
    assert bigram_floor({}, 0, [[5, 6, 7]], 4)["tau"] == 1.0  # an empty table: the bonus token alone


def test_the_table_is_the_most_frequent_supervised_successor_of_each_token(tmp_path, smollm2_tokenizer_dir):
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    tokenize_manifest(PARAMS, manifest(tmp_path, 30), smollm2_tokenizer_dir, tmp_path / "tokens", KEY)
    table, counted = bigram_table(tmp_path / "tokens")
    data, after = load_tokens(tmp_path / "tokens"), defaultdict(Counter)
    for i in range(len(data)):
        ids, mask = (np.asarray(a).tolist() for a in data.sequence(i))
        for j in range(1, len(ids)):
            if mask[j]:
                after[ids[j - 1]][ids[j]] += 1
    assert counted == sum(sum(c.values()) for c in after.values()) > 0
    expected = {t: min(n for n, k in c.items() if k == max(c.values())) for t, c in after.items()}
    assert table == expected
