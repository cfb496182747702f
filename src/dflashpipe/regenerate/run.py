"""The regenerate stage: bring data/regenerated/ to one shard per manifest training shard, reusing what holds.

Every assistant turn of a training conversation is answered again by the target, greedily: its prompt is
the conversation before it, rendered with the target's chat template and generation prompt. A later turn
is asked after the *regenerated* earlier replies (as the reference trainers do), so each conversation is
one the target could have had; turns are therefore asked in rounds (every conversation's first
assistant turn, then every second one...), each round batched across conversations, sorted by length.

A reply is kept as the token ids the target produced (the shard's `reply_ids` column), and a later turn's
prompt is those ids followed by the template's text after the reply, encoded: the prompt is the very sequence
tokenize will train on, with no reply decoded to text and encoded again into other tokens. Where that cannot be
(a template that rewrites a reply, an endpoint that answers in text) the conversation is kept as text alone and
tokenize encodes it as it encodes the manifest's.

What cannot be answered ends the conversation there, counted by reason: leading assistant turns with no
prompt are dropped (`no_prompt`); a turn whose prompt exceeds max_prompt_tokens (`prompt_too_long`) or
whose reply is empty (`empty_reply`) ends it before that turn; a reply cut at max_new_tokens is kept
(`stopped_at_limit`) and ends it after that turn, since what follows answered a finished reply. A
conversation left with no reply is dropped (`no_reply`, or `no_assistant_turn`). Trailing turns after the
last reply carry no supervision and are dropped.

Reuse is the incremental shards protocol (dflashpipe.core.incremental), tokenize's too: the key is the stage key
from dvc.yaml less data/manifest, plus each input shard's sha256 (pipeline.REUSE), so growing the data
answers only the new shards. Disabled, the output is the
manifest's shards, hard-linked: tokenize's input bytes are exactly what they were without this stage.

With an endpoint, the key cannot cover the model the server runs: each shard also records what the server
served (endpoint.ServedModel, its canary included), and a shard is reused only if the live canary, asked once
per run, equals the one it recorded; else it is answered again, and the stage says so in one line.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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
from dflashpipe.regenerate.endpoint import Completion, Endpoint, ServedModel
from dflashpipe.regenerate.shards import stored_shard, with_reply_ids, write_shard
from dflashpipe.target.chat import ChatTokenizer, load_chat_tokenizer
from dflashpipe.target.weights import weights_sha256

SKIPPED_TURNS = ("no_prompt", "prompt_too_long", "empty_reply")
REPLY_KIND = "decode"
"""The kind of work (kernels.WORK_KINDS) whose dtype replies are made in here: decoding's, so that they are the
replies the decoding target gives. The shards record the dtype (`settings.dtype`)."""
DROPPED_SAMPLES = ("no_assistant_turn", "no_reply")


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


@dataclass(frozen=True)
class Answer:
    text: str
    stopped: bool
    """It ended with a stop token (else at max_new_tokens)."""
    tokens: int
    token_ids: tuple[int, ...] | None = None
    """The reply's tokens as the target produced them, its stop token excluded; None when only its text is known."""


class Replier:
    """Answers a round of prompts (token ids), in their order; sorts them by length into batches (a request each,
    for an endpoint)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.rates: list[float] = []
        """Tokens/s samples for the spread: one per batch (an endpoint's request), or, in process, one per window
        of RATE_WINDOW_STEPS x batch_size tokens (continuous batching has no batches to time)."""

    def answer(self, prompts: Sequence[Sequence[int]], progress: Callable[[int], None]) -> list[Answer]:
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        batches = [order[k : k + self.batch_size] for k in range(0, len(order), self.batch_size)]
        answers: list[Answer | None] = [None] * len(prompts)

        for batch in batches:
            began = time.perf_counter()
            done = self.batch([prompts[i] for i in batch], progress)
            seconds = time.perf_counter() - began
            if seconds > 0:
                self.rates.append(sum(a.tokens for a in done) / seconds)
            for i, a in zip(batch, done, strict=True):
                answers[i] = a
        return answers  # type: ignore[return-value]

    def batch(self, prompts: list[Sequence[int]], progress: Callable[[int], None]) -> list[Answer]:
        raise NotImplementedError


class InProcessReplier(Replier):
    """The materialised target, one copy per device of topology.target_devices, one thread each."""

    def __init__(
        self, target_dir: Path, devices: Sequence[str], chat: ChatTokenizer, params: RegenerateParams, target_dtype: str
    ) -> None:
        import torch

        from dflashpipe.target.adapter import Target

        super().__init__(params.batch_size)
        for device in devices:
            if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
                raise SourceError(
                    f"params.yaml: topology.target_devices names {device!r}, but this machine has "
                    f"{torch.cuda.device_count()} CUDA device(s)"
                )
        devices = list(dict.fromkeys(devices))
        # The decode kind's dtype, not the batched one: a reply is a label only if it is the token sequence the
        # decoding target (evaluate, the served check) produces, and on a CPU with AMX the two kinds differ
        # (float32 against bfloat16), and so do the replies, enough to change what the overfit proof memorises.
        self.targets = [
            Target.load(target_dir, device, target_dtype, decoding=True, kind=REPLY_KIND) for device in devices
        ]
        # one worker thread per target copy, sharing the cores with the others on the CPU (dflashpipe.core.threads)
        self.threads: ThreadBudget = thread_budget({"target": sum(t.device.type == "cpu" for t in self.targets)})
        self.chat, self.max_new_tokens = chat, params.max_new_tokens
        self.stop = self.targets[0].stop_token_ids(chat.tokenizer)

    def answer(self, prompts: Sequence[Sequence[int]], progress: Callable[[int], None]) -> list[Answer]:
        """Continuous batching on each target copy: the prompts sorted by length, cut into batch_size groups,
        group j going to copy j mod n (so what a copy decodes does not depend on thread timing); each copy keeps
        batch_size rows decoding, a finished reply's row taken by its next prompt (target.batching.greedy_replies)."""
        from dflashpipe.target.batching import greedy_replies

        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        groups = [order[k : k + self.batch_size] for k in range(0, len(order), self.batch_size)]
        answers: list[Answer | None] = [None] * len(prompts)
        decode = self.chat.tokenizer.decode

        def worker(w: int) -> None:
            self.threads.apply("target", self.targets[w].device)  # in the worker's own thread
            mine = [i for group in groups[w :: len(self.targets)] for i in group]
            window = RateWindow(self.batch_size * RATE_WINDOW_STEPS, self.rates)
            replies = greedy_replies(
                self.targets[w],
                [prompts[i] for i in mine],
                self.max_new_tokens,
                self.stop,
                lambda n: (progress(n), window.add(n)),
                batch_size=self.batch_size,
            )
            window.close()
            for i, r in zip(mine, replies, strict=True):
                text = decode(r.tokens, skip_special_tokens=True)
                answers[i] = Answer(text, r.stopped, len(r.tokens) + r.stopped, r.tokens)

        if len(self.targets) == 1:
            worker(0)
        else:
            with ThreadPoolExecutor(len(self.targets)) as pool:
                for job in [pool.submit(worker, w) for w in range(len(self.targets))]:
                    job.result()
        return answers  # type: ignore[return-value]


RATE_WINDOW_STEPS = 8
"""In process, the rate's spread is over windows of this many full-batch forwards' tokens (a batch no longer
ends: its rows are refilled)."""


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
    """An OpenAI-compatible server. A reply the server gives as token ids is kept as those ids and its text is
    their decoding here, as in process (so both paths write the same rows); a reply in text alone is counted by
    encoding it again, and its conversation goes on as text."""

    def __init__(self, endpoint: Endpoint, model: str, chat: ChatTokenizer, params: RegenerateParams) -> None:
        super().__init__(params.batch_size)
        self.endpoint, self.chat, self.max_new_tokens = endpoint, chat, params.max_new_tokens
        self.model = model
        """The model the canary was asked of (ServedModel.id): the one whose replies the shards record."""

    def answer_of(self, c: Completion) -> Answer:
        if c.token_ids is not None:
            text = self.chat.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
            return Answer(text, c.stopped, len(c.token_ids) + c.stopped, c.token_ids)
        encoded = self.chat.backend.encode(c.text, add_special_tokens=False).ids
        return Answer(c.text, c.stopped, len(encoded) + c.stopped)

    def batch(self, prompts, progress) -> list[Answer]:
        answers = [self.answer_of(c) for c in self.endpoint.complete(self.model, prompts, self.max_new_tokens)]
        progress(sum(a.tokens for a in answers))
        return answers


@dataclass
class _Conversation:
    turns: list[dict]
    next_turn: int | None
    """The assistant turn to answer next; None: finished."""
    kept: int = 0
    """Turns kept: through the last accepted reply."""
    reply_ids: list[list[int]] | None = field(default_factory=list)
    """Each kept reply's token ids; None once a reply could not be carried as ids (the conversation is text)."""
    ids: list[int] = field(default_factory=list)
    """The token sequence through the last reply, as the target read and wrote it."""
    through: str = ""
    """The template's rendering through the last reply's text: where the next prompt's own text starts."""

    def prompt(self, chat: ChatTokenizer) -> list[int]:
        """The next turn's prompt: the sequence so far, then the template's text after it, encoded; or, for a
        conversation kept as text, its rendering encoded whole (as tokenize encodes a text conversation)."""
        text = chat.render(self.turns[: self.next_turn], add_generation_prompt=True)
        encode = chat.backend.encode
        if self.reply_ids and text.startswith(self.through):
            ids = self.ids + encode(text[len(self.through) :], add_special_tokens=False).ids
        else:
            if self.reply_ids:  # the template rewrote an earlier reply: the conversation goes on as text
                self.reply_ids = None
            ids = encode(text, add_special_tokens=False).ids
        self.through = text
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
            counts.dropped_samples["no_reply" if had_reply else "no_assistant_turn"] += 1
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
        # what the endpoint served (None in process): explain and `dvc metrics diff` show a change of model
        "served": (s.get("settings") or {}).get("served"),
        **(
            Spread.of(run.rates).record("tokens_per_s", digits=1, busy=run.busy) if run.rates else {"tokens_per_s": 0.0}
        ),
    }


def _target_sha256(target_dir: Path) -> str:
    h = hashlib.sha256(b"config.json\0" + file_sha256(target_dir / "config.json").encode())
    for name, digest in sorted(weights_sha256(target_dir).items()):
        h.update(name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


class SameModel:
    """The reuse check's last condition with an endpoint (a `parse` for ShardedOutput.open): a shard whose
    recorded canary is not the live one was answered by another model, so it is not reusable (None)."""

    def __init__(self, live: ServedModel) -> None:
        self.live = live.canary_sha256
        self.changed: set[str] = set()
        """The recorded canaries that differ ("none": a shard that recorded no served model)."""

    def __call__(self, record: dict) -> dict | None:
        recorded = (record["settings"].get("served") or {}).get("canary_sha256")
        if recorded == self.live:
            return record
        self.changed.add(str(recorded)[:12] if recorded else "none")
        return None

    def report(self) -> None:
        """One line per recorded canary that differs: why shards the key would keep are answered again."""
        for old in sorted(self.changed):
            print(f"regenerate: endpoint's model changed: canary {old} -> {self.live[:12]}; answering its shards again")


def regenerate_manifest(
    params: RegenerateParams,
    devices: Sequence[str],
    manifest_dir: Path | str,
    target_dir: Path | str,
    out_dir: Path | str,
    key: StageKey | None = None,
    endpoint: Endpoint | None = None,
    target_dtype: str = "auto",
    template_kwargs: dict | None = None,
) -> RegenerateRun:
    """Bring `out_dir` to one shard per manifest training shard, then summary.json, then files.json.

    `key`: the stage's reuse key (stages/regenerate.py); None reuses nothing. `endpoint`: overrides the
    one params name (tests pass a short backoff). `target_dtype`: compute.target_dtype, for replies made here.
    `template_kwargs`: target.chat_template_kwargs; an endpoint gets them in the prompts' token ids, rendered here."""
    began = time.perf_counter()
    manifest_dir, target_dir, out_dir = Path(manifest_dir), Path(target_dir), Path(out_dir)
    chat = load_chat_tokenizer(target_dir, template_kwargs) if params.enabled else None
    entries = verify_manifest(manifest_dir)["shards"]
    # an output shard bears its manifest shard's name: growing the manifest appends shards here too
    inputs = {e["file"]: InputShard(e["file"], e["sha256"]) for e in entries}
    if endpoint is None and params.endpoint is not None:
        endpoint = Endpoint(params.endpoint, params.endpoint_model)
    # asked even when every shard's key holds: only the server can say whether it still runs the same model
    served = endpoint.served() if endpoint is not None and params.enabled else None
    same_model = SameModel(served) if served is not None else None
    # disabled, nothing is generated and nothing reused: the links replace whatever is there
    output: ShardedOutput[dict] = (
        ShardedOutput.open(out_dir, inputs, key if params.enabled else None, stored_shard)
        if same_model is None
        else ShardedOutput.open(out_dir, inputs, key, stored_shard, same_model)
    )
    if same_model is not None:
        same_model.report()
    if not params.enabled:
        for e in entries:
            link_or_copy(manifest_dir / e["file"], out_dir / e["file"])
        shards = [{**e, "input": inputs[e["file"]].to_json()} for e in entries]
        return _finish(output, {"enabled": False, "shards": shards}, 0, began, [])

    from dflashpipe.target.dtype import compute_dtype  # torch, only where replies are made here

    settings: dict = {
        "temperature": 0,
        "max_new_tokens": params.max_new_tokens,
        "max_prompt_tokens": params.max_prompt_tokens,
        "batch_size": params.batch_size,
        "chat_template_sha256": hashlib.sha256(chat.template.encode()).hexdigest(),
        "chat_template_kwargs": chat.chosen_kwargs,
        "target_sha256": _target_sha256(target_dir),
        # the numerics the replies were made in (in process: this machine's decode dtype; an endpoint's are its own)
        "dtype": str(compute_dtype(devices[0], target_dtype, REPLY_KIND)).removeprefix("torch.")
        if endpoint is None
        else None,
        "generator": "in_process" if endpoint is None else {"endpoint": endpoint.base_url, "model": endpoint.model},
    }
    if served is not None:
        settings["served"] = served.to_json()
    by_name = {e["file"]: e for e in entries}
    replier: Replier | None = None
    generated = 0
    # what the machine gave the generation, and the control beside it (on the first target device)
    with Measuring(devices[0] if endpoint is None else None) as window:
        for name in output.todo:
            if replier is None:  # loading the target (or asking the endpoint) only when there is work
                replier = (
                    InProcessReplier(target_dir, devices, chat, params, target_dtype)
                    if endpoint is None or served is None
                    else EndpointReplier(endpoint, served.id, chat, params)
                )
            rows = read_manifest_shard(manifest_dir, by_name[name]).to_pylist()
            with tqdm(desc=f"regenerate {name}", unit="tok", unit_scale=True, mininterval=1.0) as bar:
                out_rows, counts = regenerate_rows(rows, chat, replier, params, bar.update)
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
    shards = [
        {**entry, "counts": output.records[entry["file"]]["counts"]}
        for entry in output.entries(lambda record: record["counts"]["samples_out"])
    ]
    total = output.total(RegenerateCounts(), lambda record: record["counts"])
    summary = {"enabled": True, "settings": settings, "counts": asdict(total), "shards": shards}
    threads = replier.threads.to_json() if isinstance(replier, InProcessReplier) else None
    rates = replier.rates if replier is not None else []
    return _finish(output, summary, generated, began, rates, threads, window.busy)


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
