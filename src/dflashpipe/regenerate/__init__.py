"""Stage `regenerate`: the target's own greedy replies to every training prompt, shard by manifest shard.

One job per module, imported by its full name (in this process, the replies are
`dflashpipe.target.batching.greedy_replies`: batched greedy decoding with a KV cache):
- `endpoint`: the replies from an OpenAI-compatible server (vLLM, SGLang), with retries;
- `shards`: the output's format, its reuse key, and the reader tokenize uses;
- `run`: the stage itself: rounds of turns, skip counts, reuse, summary.json and files.json.
"""
