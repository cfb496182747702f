"""Stage `features`: the target's hidden states at the drafter's layers, computed once per token shard.

Online (`features.mode: online`), train runs the frozen target on every batch it trains on, so every
epoch pays the target's forward again; on the CPU that forward is most of a step. Offline, the
`features` stage computes them once, one shard per token shard, and train reads them back: the
target's cost is paid once, and an epoch after the first costs only the drafter.

One job per module, imported by its full name (this file re-exports nothing, so train, which reads
the shards and packs its epochs the same way, imports `shards` and `packing` alone and depends on nothing
else of the stage):
- `packing`: token sequences packed into fixed-shape rows and laid out, here and in train alike;
- `shards`: the features shard format, its reuse check, and the reader that training uses (`FeatureStore`);
- `run`: the stage itself: the target's forward over each token shard's packed rows, summary.json and
  files.json.
"""
