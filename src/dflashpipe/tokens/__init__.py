"""Stage `tokenize`: manifest shards -> `input_ids` + `loss_mask` shards, rendered with the target's own template
(target.chat).

One job per module, imported by its full name (this file re-exports nothing, so a reader of
the shards imports `shards` alone and depends on nothing else of the stage):
- `encode`: samples -> token rows and loss masks, with counts of what was skipped and why;
- `shards`: the tokens shard format, its reuse key, and the reader that training uses;
- `run`: the stage itself: which shards to reuse, the worker pool, summary.json and files.json.
"""
