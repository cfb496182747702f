"""The tokenize stage: bring data/tokens/ to one tokens shard per conversation shard, reusing what still holds.

Its input is data/regenerated/ (the manifest's shards as they are, or with the target's own replies; the
same names and, disabled, the same bytes), called "the manifest" below.
Incremental by content. A tokens shard depends only on its manifest shard and on what dvc.yaml
lists for the stage (the tokenizer and template in data/target, the tokenize params, this package's
code, the stage script, the library versions): the caller passes that as a `StageKey`, read from
dvc.yaml itself, so a shard is reused on exactly the condition under which DVC would keep the
output (see `dflashpipe.core.pipeline`; the protocol is `dflashpipe.core.incremental`). `data/tokens/` is a DVC
`persist` output: on a rerun, a shard
whose stored key matches and whose content hashes to its stored sha256 is reused untouched; every other
one is encoded again and written atomically. Files that are not a current shard are removed first
(summary.json and files.json too), so a killed run leaves no listing that vouches for it.

`summary.json` is rebuilt from the shards' own stored statistics, so it is the same bytes
however the shards came about; what was encoded or reused in this run goes to a separate run
report (the metrics). `files.json` (sha256 of every file) is the very last write: the reader
checks the directory against it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from tqdm import tqdm

from dflashpipe.core.incremental import InputShard, ShardedOutput
from dflashpipe.core.params import TokenizeParams
from dflashpipe.core.pipeline import StageKey
from dflashpipe.core.spread import Busy, Measuring, Spread
from dflashpipe.core.threads import thread_budget
from dflashpipe.regenerate.shards import REPLY_IDS, ConversationShard, read_conversation_shards
from dflashpipe.target.chat import ChatTokenizer, load_chat_tokenizer
from dflashpipe.tokens.encode import EncodedRows, SampleEncoder, TokenStats, concat_rows, length_edges
from dflashpipe.tokens.shards import shard_name, stored_shard, write_shard

CHUNK_SAMPLES = 64
"""Samples per task handed to a worker: small enough to balance, large enough for encode_batch."""


# --- running it across processes -----------------------------------------------------------

_WORKER: dict[str, Any] = {}
"""Per process: the encoder, and the manifest shard it last read."""


def _init_worker(chat: ChatTokenizer, params: TokenizeParams) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no extra threads
    _WORKER.clear()
    _WORKER["encoder"] = SampleEncoder(chat, params)


def _encode_task(task: tuple[int, str, int, int]) -> tuple[int, EncodedRows, TokenStats, float]:
    """One chunk of a manifest shard, encoded; with its encoding seconds (for the rate's spread)."""
    began = time.perf_counter()
    index, path, start, stop = task
    if _WORKER.get("path") != path:
        carried = [REPLY_IDS] if REPLY_IDS in pq.read_schema(path).names else []  # regenerated shards carry them
        _WORKER["path"], _WORKER["table"] = (
            path,
            pq.read_table(path, columns=["id", "source", "conversation", *carried]),
        )
    part = _WORKER["table"].slice(start, stop - start)
    samples = list(zip(*(part.column(name).to_pylist() for name in part.column_names), strict=True))
    rows, stats = _WORKER["encoder"].encode(samples)
    return index, rows, stats, time.perf_counter() - began


def _tasks(shards: list[ConversationShard]) -> list[tuple[int, str, int, int]]:
    return [
        (s.index, str(s.path), start, min(start + CHUNK_SAMPLES, s.samples))
        for s in shards
        for start in range(0, s.samples, CHUNK_SAMPLES)
    ]


@contextlib.contextmanager
def _results(tasks: list, chat: ChatTokenizer, params: TokenizeParams, num_proc: int) -> Iterator[Iterator]:
    """Task results in task order, from `num_proc` forked workers (or this process for one)."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # set before forking: children inherit it, no fork warning
    try:
        if num_proc == 1 or len(tasks) <= 1:
            _init_worker(chat, params)
            yield map(_encode_task, tasks)
        else:
            ctx = multiprocessing.get_context("fork")  # children inherit the loaded tokenizer and imports
            with ctx.Pool(min(num_proc, len(tasks)), initializer=_init_worker, initargs=(chat, params)) as pool:
                yield pool.imap(_encode_task, tasks)
    finally:
        _WORKER.clear()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


# --- the stage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeRun:
    """What one run produced (`summary`, the same bytes however it came about) and what it did."""

    summary: dict
    encoded_shards: list[str]
    reused_shards: list[str]
    encoded_samples: int
    encoded_tokens: int
    num_proc: int
    seconds: float
    chunk_rates: list[float] = field(default_factory=list)
    """Tokens/s of each encoded chunk x the processes encoding side by side: the repeats of the rate."""
    threads: dict = field(default_factory=dict)
    """The thread budget (dflashpipe.core.threads): the cores, and the processes that shared them."""
    busy: Busy | None = None
    """What the machine gave the encoding, and the control beside it (spread.Measuring)."""


def tokenize_metrics(run: TokenizeRun) -> dict:
    """The headline numbers, and how much of the work this run redid, for `dvc metrics diff`."""
    s = run.summary
    return {
        "samples_in": s["samples_in"],
        "samples_out": s["samples_out"],
        "samples_skipped": sum(s["skipped"].values()),
        "tokens": s["tokens"],
        "supervised_tokens": s["supervised_tokens"],
        "truncated": s["truncated"],
        "shards": len(s["shards"]),
        "encoded_shards": len(run.encoded_shards),
        "reused_shards": len(run.reused_shards),
        "encoded_samples": run.encoded_samples,
        "seconds": round(run.seconds, 3),
        "threads": run.threads,
        # The median over encoded chunks with its range (see core/spread.py), so a move within the
        # machine's noise is not blamed on an input; 0.0 and no spread when nothing was encoded.
        **(
            Spread.of(run.chunk_rates).record("encoded_tokens_per_second", digits=1, busy=run.busy)
            if run.chunk_rates
            else {"encoded_tokens_per_second": 0.0}
        ),
    }


def tokenize_manifest(
    params: TokenizeParams,
    manifest_dir: Path | str,
    target_dir: Path | str,
    out_dir: Path | str,
    key: StageKey | None = None,
    template_kwargs: dict | None = None,
) -> TokenizeRun:
    """Bring `out_dir` to one tokens shard per manifest shard, then summary.json, then files.json.

    `key` is what decides every shard besides its own input: the stage's key from dvc.yaml (see
    stages/tokens.py). A shard whose stored key (this key and its input shard's sha256) matches is
    reused untouched; the returned run says which. With `key` None nothing is reused: every shard
    is encoded again. `template_kwargs`: target.chat_template_kwargs, for every rendering."""
    began = time.perf_counter()
    manifest_dir, out_dir = Path(manifest_dir), Path(out_dir)
    chat = load_chat_tokenizer(target_dir, template_kwargs)
    shards = read_conversation_shards(manifest_dir)
    names = {s.index: shard_name(s.path.name) for s in shards}
    output: ShardedOutput[TokenStats] = ShardedOutput.open(
        out_dir,
        {names[s.index]: InputShard(s.path.name, s.sha256) for s in shards},
        key,
        stored_shard,
        TokenStats.from_json,  # stats of another shape: the shard is encoded again
    )
    made = set(output.todo)
    todo = [s for s in shards if names[s.index] in made]

    def empty_stats() -> TokenStats:
        return TokenStats(length_histogram=[0] * len(length_edges(params.max_length)))

    def finish(shard: ConversationShard, parts: list[tuple[EncodedRows, TokenStats]]) -> None:
        stats = empty_stats()
        for _, part_stats in parts:
            stats.merge(part_stats)
        name = names[shard.index]
        write_shard(
            out_dir / name,
            concat_rows([p[0] for p in parts]),
            stats,
            output.keys[name],
            output.inputs[name].to_json(),
        )
        output.wrote(name, stats)

    num_proc = params.num_proc or thread_budget({}).cores  # 0: a process per core this process may use
    tasks = _tasks(todo)
    # each process encodes in one thread (TOKENIZERS_PARALLELISM=false): the budget records the split
    budget = thread_budget({"process": min(num_proc, len(tasks)) if len(tasks) > 1 else 1})
    tasks_left = {s.index: sum(1 for t in tasks if t[0] == s.index) for s in todo}
    for s in todo:
        if tasks_left[s.index] == 0:  # an empty manifest shard still gets its (empty) tokens shard
            finish(s, [])
    pending: dict[int, list[tuple[EncodedRows, TokenStats]]] = {}
    chunk_rates: list[float] = []
    with (
        Measuring() as window,  # what the machine gave the encoding, and the control beside it
        _results(tasks, chat, params, num_proc) as results,
        tqdm(total=sum(s.samples for s in todo), desc="tokenize", unit="sample", mininterval=1.0) as bar,
    ):
        for index, rows, stats, seconds in results:
            if seconds > 0:
                chunk_rates.append(stats.tokens * min(num_proc, len(tasks)) / seconds)
            bar.update(stats.samples_in)
            pending.setdefault(index, []).append((rows, stats))
            tasks_left[index] -= 1
            if tasks_left[index] == 0:
                finish(shards[index], pending.pop(index))

    total = output.total(empty_stats())
    entries = output.entries(lambda stats: stats.samples_out)
    summary = {
        "length_histogram_max_tokens": length_edges(params.max_length),
        **total.to_json(),
        # what the rows were rendered with: a server must render its prompts with the same (the drafter's card)
        "chat_template_kwargs": chat.chosen_kwargs,
        "shards": entries,
    }
    output.finish(summary)
    run = TokenizeRun(
        summary,
        sorted(output.run.written),
        output.run.reused,
        sum(s.samples for s in todo),
        sum(output.records[names[s.index]].tokens for s in todo),
        num_proc,
        time.perf_counter() - began,
        chunk_rates,
        budget.to_json(),
        window.busy,
    )
    print(
        f"tokenize: encoded {len(run.encoded_shards)} shard(s), reused {len(run.reused_shards)}; "
        f"{total.samples_out} of {total.samples_in} samples kept, {total.tokens} tokens"
    )
    return run
