"""The regenerate stage: bring data/regenerated/ to one shard per manifest training shard, reusing what holds.

Every assistant turn of a training conversation is answered again by the target, greedily: its prompt is
the conversation before it, rendered with the target's chat template and generation prompt. A later turn
is asked after the *regenerated* earlier replies (as the reference trainers do), so each conversation is
one the target could have had; turns are therefore asked in rounds (every conversation's first
assistant turn, then every second one...), each round answered together: in process by continuous batching on
one device (a device answers whole shards, so a shard's batches never depend on how many devices there are);
through endpoints one prompt a request, `concurrency` in flight per endpoint, each reply put back in its place.

A reply is kept as the token ids the target produced (the shard's `reply_ids` column), and a later turn's
prompt is those ids followed by the template's text after the reply, encoded (ChatTokenizer.generation_prompt,
which tokenize builds its rows with): the prompt is the very sequence tokenize will train on, with no reply decoded
to text and encoded again into other tokens. A template that renders an earlier turn otherwise than it was read
(Qwen3's think blocks) starts the sequence again from its generation prompt; an endpoint that returns no ids keeps
the conversation as text, which tokenize encodes as it encodes the manifest's.

What cannot be answered ends the conversation there, counted by reason: leading assistant turns with no
prompt are dropped (`no_prompt`); a turn whose prompt exceeds max_prompt_tokens (`prompt_too_long`) or
whose reply is empty (`empty_reply`) or that the endpoint refuses (`refused`, HTTP 400) ends it before that
turn; a reply cut at max_new_tokens is kept
(`stopped_at_limit`) and ends it after that turn, since what follows answered a finished reply. A
conversation left with no reply is dropped (`no_reply`, `refused`, or `no_assistant_turn`). Trailing turns after
the last reply carry no supervision and are dropped.

Reuse is the incremental shards protocol (dflashpipe.core.incremental), tokenize's too: the key is the stage key
from dvc.yaml less data/manifest, plus each input shard's sha256 (pipeline.REUSE), so growing the data
answers only the new shards. Disabled, the output is the
manifest's shards, hard-linked: tokenize's input bytes are exactly what they were without this stage.

The key leaves out who answers (endpoints, devices, concurrency): none of them decides a reply. What does and is
no dvc.yaml input, the generator (in process: device type and dtype; an endpoint: its engine's version, the
model it serves and its canary, asked once per run of every endpoint), is recorded with each shard; a shard is
reused only under the live generator, else it is answered again, and the stage says so in one line.
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from tqdm import tqdm

from dflashpipe.core.artifacts import file_sha256, link_or_copy
from dflashpipe.core.errors import SourceError
from dflashpipe.core.incremental import InputShard, ShardedOutput
from dflashpipe.core.params.sections import RegenerateParams
from dflashpipe.core.pipeline import StageKey
from dflashpipe.core.spread import Busy, Measuring, Spread
from dflashpipe.core.threads import ThreadBudget, thread_budget
from dflashpipe.data.shards import ShardWriter, conversation_hash, read_manifest_shard, verify_manifest
from dflashpipe.regenerate.endpoint import Completion, Endpoint, EndpointError, PromptRefused, ServedModel
from dflashpipe.regenerate.shards import stored_shard, with_reply_ids, write_shard
from dflashpipe.target.chat import ChatTokenizer, load_chat_tokenizer
from dflashpipe.target.weights import weights_sha256

SKIPPED_TURNS = ("no_prompt", "prompt_too_long", "empty_reply", "refused")
DROPPED_SAMPLES = ("no_assistant_turn", "no_reply", "refused")
"""`refused`: the endpoint refused the conversation's first prompt (HTTP 400, e.g. over its max_model_len): the
samples that *failed*; the other reasons are samples *skipped*. Every sample is one of replied (samples_out),
failed or skipped (`accounting`)."""


@dataclass
class RegenerateCounts:
    """What one shard (or all of them) went through; sums across shards."""

    samples_in: int = 0
    samples_out: int = 0
    replies: int = 0
    stopped_at_limit: int = 0
    generated_tokens: int = 0
    skipped_turns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIPPED_TURNS, 0))
    dropped_samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROPPED_SAMPLES, 0))

    def merge(self, other: RegenerateCounts | dict) -> None:
        other = other if isinstance(other, dict) else asdict(other)
        for name in ("samples_in", "samples_out", "replies", "stopped_at_limit", "generated_tokens"):
            setattr(self, name, getattr(self, name) + other[name])
        for name in ("skipped_turns", "dropped_samples"):
            for reason, n in other[name].items():
                getattr(self, name)[reason] += n

    def accounting(self) -> dict[str, int]:
        """SpecForge's invariant, checked: every sample in is replied, failed or skipped."""
        failed = self.dropped_samples["refused"]
        skipped = sum(self.dropped_samples.values()) - failed
        if self.samples_out + failed + skipped != self.samples_in:
            raise AssertionError(
                f"regenerate: {self.samples_in} samples in, {self.samples_out + failed + skipped} accounted for"
            )
        return {"in": self.samples_in, "replied": self.samples_out, "failed": failed, "skipped": skipped}


@dataclass(frozen=True)
class Answer:
    text: str
    stopped: bool
    """It ended with a stop token (else at max_new_tokens)."""
    tokens: int
    token_ids: tuple[int, ...] | None = None
    """The reply's tokens as the target produced them, its stop token excluded; None when only its text is known."""


class Replier:
    """Answers a round of prompts (token ids), in their order; None for a prompt the generator refused."""

    rates: list[float]
    """Tokens/s samples for the spread: one per window of generated tokens (continuous batching, here or in the
    server, has no batches to time)."""

    def answer(self, prompts: Sequence[Sequence[int]], progress: Callable[[int], None]) -> list[Answer | None]:
        raise NotImplementedError


class InProcessReplier(Replier):
    """One materialised copy of the target on one device; the stage gives each device whole shards."""

    def __init__(self, target, threads: ThreadBudget, chat: ChatTokenizer, params: RegenerateParams) -> None:
        self.target, self.threads, self.chat = target, threads, chat
        self.batch_size, self.max_new_tokens = params.batch_size, params.max_new_tokens
        self.stop = target.stop_token_ids(chat.tokenizer)
        self.rates: list[float] = []

    def answer(self, prompts: Sequence[Sequence[int]], progress: Callable[[int], None]) -> list[Answer | None]:
        """Continuous batching: the prompts sorted by length, batch_size rows decoding, a finished reply's row
        taken by the next prompt (target.batching.greedy_replies). Which rows share a forward depends on the
        round's prompts alone, never on how many devices there are or on timing."""
        from dflashpipe.target.batching import greedy_replies

        self.threads.apply("target", self.target.device)  # in the calling (shard worker's) thread
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        window = RateWindow(self.batch_size * RATE_WINDOW_STEPS, self.rates)
        replies = greedy_replies(
            self.target,
            [prompts[i] for i in order],
            self.max_new_tokens,
            self.stop,
            lambda n: (progress(n), window.add(n)),
            batch_size=self.batch_size,
        )
        window.close()
        answers: list[Answer | None] = [None] * len(prompts)
        decode = self.chat.tokenizer.decode
        for i, r in zip(order, replies, strict=True):
            answers[i] = Answer(
                decode(r.tokens, skip_special_tokens=True), r.stopped, len(r.tokens) + r.stopped, r.tokens
            )
        return answers


RATE_WINDOW_STEPS = 8
"""The rate's spread is over windows of this many full batches' tokens (in process: batch_size rows a forward;
through endpoints: one token for each request in flight)."""


class RateWindow:
    """Tokens per second over consecutive windows of `size` tokens, appended to `rates` as each closes."""

    def __init__(self, size: int, rates: list[float]) -> None:
        self.size, self.rates = size, rates
        self.tokens, self.began = 0, time.perf_counter()

    def add(self, n: int) -> None:
        self.tokens += n
        if self.tokens >= self.size:
            self.close()

    def close(self) -> None:
        """End the window now (the last one is shorter)."""
        now = time.perf_counter()
        if self.tokens and now > self.began:
            self.rates.append(self.tokens / (now - self.began))
        self.tokens, self.began = 0, now


class EndpointReplier(Replier):
    """OpenAI-compatible servers, all serving one model: one prompt per request, `concurrency` requests in flight
    per endpoint, whichever endpoint is free takes the next prompt. Each reply is put back at its prompt's place,
    so what is written does not depend on how many endpoints answered, how many requests were in flight, or in
    what order the answers came. A reply is kept as the token ids the server generated, its text their decoding
    here, as in process (so both paths write the same rows)."""

    def __init__(
        self, endpoints: Sequence[Endpoint], model: str, chat: ChatTokenizer, params: RegenerateParams
    ) -> None:
        self.endpoints, self.model, self.chat = list(endpoints), model, chat
        """`model`: the one the canary was asked of (ServedModel.id): the one whose replies the shards record."""
        self.max_new_tokens, self.concurrency = params.max_new_tokens, params.concurrency
        self.rates: list[float] = []
        workers = len(self.endpoints) * self.concurrency
        numbering, self.local = itertools.count(), threading.local()
        # each worker thread is bound to one endpoint as it starts: `concurrency` threads per endpoint
        self.pool = ThreadPoolExecutor(
            workers,
            thread_name_prefix="regenerate-request",
            initializer=lambda: setattr(self.local, "endpoint", self.endpoints[next(numbering) % len(self.endpoints)]),
        )

    def ask(self, prompt: Sequence[int]) -> Completion | PromptRefused:
        try:
            return self.local.endpoint.complete(self.model, prompt, self.max_new_tokens)
        except PromptRefused as refused:
            # this prompt's own verdict, counted: the canary (the same request) was accepted, so the server takes
            # requests of this form, and refuses this one for its own sake (vLLM: longer than max_model_len)
            return refused

    def answer(self, prompts: Sequence[Sequence[int]], progress: Callable[[int], None]) -> list[Answer | None]:
        # the longest first: the last requests in flight are short ones, so the round's tail is short
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        jobs = {self.pool.submit(self.ask, prompts[i]): i for i in order}
        answers: list[Answer | None] = [None] * len(prompts)
        window = RateWindow(len(self.endpoints) * self.concurrency * RATE_WINDOW_STEPS, self.rates)
        try:
            for job in as_completed(jobs):
                c = job.result()
                if isinstance(c, PromptRefused):
                    continue
                tokens = len(c.token_ids) + c.stopped
                text = self.chat.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
                answers[jobs[job]] = Answer(text, c.stopped, tokens, c.token_ids)
                progress(tokens)
                window.add(tokens)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        window.close()
        return answers

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


@dataclass
class _Conversation:
    turns: list[dict]
    next_turn: int | None
    """The assistant turn to answer next; None: finished."""
    kept: int = 0
    """Turns kept: through the last accepted reply."""
    refused: bool = False
    """The endpoint refused the turn that ended it."""
    reply_ids: list[list[int]] | None = field(default_factory=list)
    """Each kept reply's token ids; None once a reply could not be carried as ids (the conversation is text)."""
    ids: list[int] = field(default_factory=list)
    """The token sequence through the last reply, as the target read and wrote it."""
    through: str = ""
    """The template's rendering through the last reply's text: where the next prompt's own text starts."""

    def prompt(self, chat: ChatTokenizer) -> list[int]:
        """The next turn's prompt (ChatTokenizer.generation_prompt): the sequence so far extended, or the generation
        prompt encoded whole; for a conversation kept as text, always whole (as tokenize encodes a text one)."""
        ids, self.through, _ = chat.generation_prompt(
            self.ids if self.reply_ids else [], self.through, self.turns[: self.next_turn]
        )
        return ids

    def answered(self, prompt: list[int], answer: Answer) -> None:
        self.turns[self.next_turn] = {"role": "assistant", "content": answer.text}
        self.kept = self.next_turn + 1
        if self.reply_ids is not None and answer.token_ids is not None:
            self.reply_ids.append(list(answer.token_ids))
            self.ids, self.through = prompt + list(answer.token_ids), self.through + answer.text
        else:
            self.reply_ids = None
        self.next_turn = _next_assistant(self.turns, self.kept) if answer.stopped else None


def _next_assistant(turns: list[dict], after: int) -> int | None:
    return next((j for j in range(after, len(turns)) if turns[j]["role"] == "assistant"), None)


def regenerate_rows(
    rows: list[dict], chat: ChatTokenizer, replier: Replier, params: RegenerateParams, progress: Callable[[int], None]
) -> tuple[list[dict], RegenerateCounts]:
    """The rows (manifest schema) with every reply the target's own; the conversations cut as the module says."""
    counts = RegenerateCounts(samples_in=len(rows))
    conversations = []
    for row in rows:
        turns = [dict(t) for t in row["conversation"]]
        start = next((j for j, t in enumerate(turns) if t["role"] != "assistant"), len(turns))
        counts.skipped_turns["no_prompt"] += start
        conversations.append(_Conversation(turns[start:], _next_assistant(turns[start:], 1)))
    while True:
        asked = []
        for c in conversations:
            if c.next_turn is None:
                continue
            ids = c.prompt(chat)
            if len(ids) > params.max_prompt_tokens:
                counts.skipped_turns["prompt_too_long"] += 1
                c.next_turn = None
            else:
                asked.append((c, ids))
        if not asked:
            break
        for (c, ids), answer in zip(asked, replier.answer([ids for _, ids in asked], progress), strict=True):
            if answer is None:
                counts.skipped_turns["refused"] += 1
                c.next_turn, c.refused = None, True
                continue
            if not answer.text.strip():
                counts.skipped_turns["empty_reply"] += 1
                c.next_turn = None
                continue
            c.answered(ids, answer)
            counts.replies += 1
            counts.generated_tokens += answer.tokens
            counts.stopped_at_limit += not answer.stopped
    out = []
    for row, c in zip(rows, conversations, strict=True):
        if c.kept == 0:
            had_reply = any(t["role"] == "assistant" for t in c.turns)
            reason = "refused" if c.refused else "no_reply" if had_reply else "no_assistant_turn"
            counts.dropped_samples[reason] += 1
            continue
        turns = c.turns[: c.kept]
        out.append(
            {
                "id": row["id"],
                "source": row["source"],
                "conversation": turns,
                "hash": conversation_hash(turns),
                "reply_ids": c.reply_ids or [],  # [] for a conversation kept as text
            }
        )
    counts.samples_out = len(out)
    return out, counts


# --- the stage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegenerateRun:
    """What one run produced (`summary`: the same bytes however it came about) and what it did."""

    summary: dict
    regenerated_shards: list[str]
    reused_shards: list[str]
    generated_tokens: int
    seconds: float
    rates: list[float]
    threads: dict | None = None
    """The in-process generators' thread budget (dflashpipe.core.threads); None when none ran here."""
    busy: Busy | None = None
    """What the machine gave the generation, and the control beside it (spread.Measuring)."""


def regenerate_metrics(run: RegenerateRun) -> dict:
    """The counts, and how much of the work this run redid, for `dvc metrics diff`."""
    s = run.summary
    counts = s.get("counts") or {}
    return {
        "enabled": s["enabled"],
        "shards": len(s["shards"]),
        "regenerated_shards": len(run.regenerated_shards),
        "reused_shards": len(run.reused_shards),
        **counts,
        "generated_tokens_this_run": run.generated_tokens,
        "seconds": round(run.seconds, 3),
        "threads": run.threads,
        "accounting": s.get("accounting"),
        # what made the replies: explain and `dvc metrics diff` show a change of model, engine or numerics
        "generator": (s.get("settings") or {}).get("generator"),
        **(
            Spread.of(run.rates).record("tokens_per_s", digits=1, busy=run.busy) if run.rates else {"tokens_per_s": 0.0}
        ),
    }


def _target_sha256(target_dir: Path) -> str:
    h = hashlib.sha256(b"config.json\0" + file_sha256(target_dir / "config.json").encode())
    for name, digest in sorted(weights_sha256(target_dir).items()):
        h.update(name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


class SameGenerator:
    """The reuse check's last condition (a `parse` for ShardedOutput.open): what made the replies that no dvc.yaml
    input names, in process the device type and dtype, through an endpoint its engine's version, the model it
    serves and its canary. A shard whose recorded generator is not the live one is answered again (None)."""

    def __init__(self, live: dict) -> None:
        self.live = live
        self.changed: dict[str, int] = {}
        """A line saying what differs -> how many shards it sends back to be answered."""

    def __call__(self, record: dict) -> dict | None:
        recorded = record["settings"].get("generator")
        if recorded == self.live:
            return record
        old = recorded if isinstance(recorded, dict) else {}
        what = ", ".join(
            f"{k} {_short(old.get(k))} -> {_short(self.live.get(k))}"
            for k in sorted(old.keys() | self.live.keys())
            if old.get(k) != self.live.get(k)
        )
        self.changed[what] = self.changed.get(what, 0) + 1
        return None

    def report(self) -> None:
        """One line per difference: why shards the key would keep are answered again."""
        for what, n in sorted(self.changed.items()):
            print(f"regenerate: the generator changed ({what}): answering {n} shard(s) again")


def _short(value) -> str:
    text = str(value)
    return text[:12] if len(text) == 64 else text  # a sha256, as the canary's


def regenerate_devices(devices: str | Sequence[str]) -> list[str]:
    """regenerate.devices made concrete: `auto` is every visible CUDA device, else the CPU."""
    import torch

    if devices == "auto":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    for device in devices:
        if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
            raise SourceError(
                f"params.yaml: regenerate.devices names {device!r}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); use auto for every one it has"
            )
    return list(devices)


def same_model(endpoints: Sequence[Endpoint]) -> ServedModel:
    """What every endpoint serves, asked of each; refused where two differ: the replies would depend on which
    server a prompt reached."""
    served = [e.served() for e in endpoints]
    for endpoint, other in zip(endpoints[1:], served[1:], strict=True):
        if other.to_json() != served[0].to_json():
            raise EndpointError(
                f"regenerate.endpoints: {endpoints[0].base_url} serves {served[0].to_json()} but "
                f"{endpoint.base_url} serves {other.to_json()}: every endpoint must serve the same model, engine "
                f"and max_model_len"
            )
    return served[0]


def regenerate_manifest(
    params: RegenerateParams,
    manifest_dir: Path | str,
    target_dir: Path | str,
    out_dir: Path | str,
    key: StageKey | None = None,
    endpoints: Sequence[Endpoint] | None = None,
    target_dtype: str = "auto",
    template_kwargs: dict | None = None,
) -> RegenerateRun:
    """Bring `out_dir` to one shard per manifest training shard, then summary.json, then files.json.

    `key`: the stage's reuse key (stages/regenerate.py); None reuses nothing. `endpoints`: override the ones
    params name (tests pass a short backoff). `target_dtype`: compute.target_dtype, for replies made here.
    `template_kwargs`: target.chat_template_kwargs; an endpoint gets them in the prompts' token ids, rendered here."""
    began = time.perf_counter()
    manifest_dir, target_dir, out_dir = Path(manifest_dir), Path(target_dir), Path(out_dir)
    chat = load_chat_tokenizer(target_dir, template_kwargs) if params.enabled else None
    entries = verify_manifest(manifest_dir)["shards"]
    # an output shard bears its manifest shard's name: growing the manifest appends shards here too
    inputs = {e["file"]: InputShard(e["file"], e["sha256"]) for e in entries}
    if not params.enabled:  # nothing is generated and nothing reused: the links replace whatever is there
        output: ShardedOutput[dict] = ShardedOutput.open(out_dir, inputs, None, stored_shard)
        for e in entries:
            link_or_copy(manifest_dir / e["file"], out_dir / e["file"])
        shards = [{**e, "input": inputs[e["file"]].to_json()} for e in entries]
        return _finish(output, {"enabled": False, "shards": shards}, 0, began, [])

    if endpoints is None:
        endpoints = [Endpoint(url, params.endpoint_model) for url in params.endpoints]
    # asked before anything is touched, even when every shard's key holds: only the servers can say what they run
    served = same_model(endpoints) if endpoints else None
    devices: list[str] = []
    if served is None:
        from dflashpipe.target.dtype import compute_dtype  # torch, only where replies are made here

        devices = regenerate_devices(params.devices)
        dtype = str(compute_dtype(devices[0], target_dtype)).removeprefix("torch.")
        generator = {"engine": "in_process", "device_type": devices[0].partition(":")[0], "dtype": dtype}
    else:
        generator = {"engine": "endpoint", **served.to_json()}
    same = SameGenerator(generator)
    output = ShardedOutput.open(out_dir, inputs, key, stored_shard, same)
    same.report()

    settings: dict = {
        "temperature": 0,
        "max_new_tokens": params.max_new_tokens,
        "max_prompt_tokens": params.max_prompt_tokens,
        "batch_size": params.batch_size,
        "chat_template_sha256": hashlib.sha256(chat.template.encode()).hexdigest(),
        "chat_template_kwargs": chat.chosen_kwargs,
        "target_sha256": _target_sha256(target_dir),
        "generator": generator,
    }
    by_name = {e["file"]: e for e in entries}

    def answer(name: str, replier: Replier) -> tuple[str, list[dict], RegenerateCounts]:
        rows = read_manifest_shard(manifest_dir, by_name[name]).to_pylist()
        with tqdm(desc=f"regenerate {name}", unit="tok", unit_scale=True, mininterval=1.0) as bar:
            out_rows, counts = regenerate_rows(rows, chat, replier, params, bar.update)
        return name, out_rows, counts

    repliers: list[Replier] = []
    threads: ThreadBudget | None = None
    generated = 0
    # what the machine gave the generation, and the control beside it (on the first device)
    with Measuring(devices[0] if devices else None) as window:
        if output.todo:  # loading the target (or opening connections) only when there is work
            if served is not None:
                repliers = [EndpointReplier(endpoints, served.id, chat, params)]
            else:
                from dflashpipe.target.adapter import Target

                # one worker thread per target copy, sharing the cores with the others on the CPU
                threads = thread_budget({"target": sum(d == "cpu" for d in devices)})
                load = partial(Target.load, target_dir, target_dtype=target_dtype, decoding=True)
                repliers = [InProcessReplier(load(d), threads, chat, params) for d in devices]
        # whole shards to each replier (a device, or the endpoints together): a shard's replies never depend on
        # how many there are; each shard is written here, in this thread, as it comes back
        free: queue.SimpleQueue[Replier] = queue.SimpleQueue()
        for r in repliers:
            free.put(r)

        def on_free_replier(name: str):
            replier = free.get()
            try:
                return answer(name, replier)
            finally:
                free.put(replier)

        with ThreadPoolExecutor(max(1, len(repliers))) as pool:
            jobs = [pool.submit(on_free_replier, name) for name in output.todo]
            try:
                for job in as_completed(jobs):
                    name, out_rows, counts = job.result()
                    writer = ShardWriter()
                    for row in out_rows:
                        writer.add(row["id"], row["source"], row["conversation"], row["hash"])
                    table = with_reply_ids(writer.table(), [row["reply_ids"] for row in out_rows])
                    record = {
                        "key": output.keys[name],
                        "input": inputs[name].to_json(),
                        "settings": settings,
                        "counts": asdict(counts),
                    }
                    write_shard(out_dir / name, table, record)
                    output.wrote(name, record)
                    generated += counts.generated_tokens
            except BaseException:  # the shards written stay; a rerun reuses them
                for job in jobs:
                    job.cancel()
                raise
            finally:
                for r in repliers:
                    if isinstance(r, EndpointReplier):
                        r.close()
    output.run.written.sort(key=list(inputs).index)  # the order the input lists them, whatever finished first
    shards = [
        {**entry, "counts": output.records[entry["file"]]["counts"]}
        for entry in output.entries(lambda record: record["counts"]["samples_out"])
    ]
    total = output.total(RegenerateCounts(), lambda record: record["counts"])
    summary = {
        "enabled": True,
        "settings": settings,
        "counts": asdict(total),
        "accounting": total.accounting(),
        "shards": shards,
    }
    rates = [rate for r in repliers for rate in r.rates]
    return _finish(output, summary, generated, began, rates, threads.to_json() if threads else None, window.busy)


def _finish(
    output: ShardedOutput,
    summary: dict,
    generated: int,
    began: float,
    rates: list[float],
    threads: dict | None = None,
    busy: Busy | None = None,
) -> RegenerateRun:
    output.finish(summary)
    shards = output.run
    seconds = time.perf_counter() - began
    run = RegenerateRun(summary, shards.written, shards.reused, generated, seconds, rates, threads, busy)
    what = (
        "linked the manifest's"
        if not summary["enabled"]
        else f"answered {len(shards.written)}, reused {len(shards.reused)}"
    )
    print(f"regenerate: {what} shard(s) of {len(summary['shards'])}")
    return run
