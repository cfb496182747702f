"""Regenerate: the target's own greedy replies, the same in this process and from an OpenAI-compatible server;
disabled, tokenize's input is the manifest's bytes; shards are reused only under their key.

The target is tests/tiny.py's tiny Llama with the real SmolLM2 tokenizer, its LM head scaled as a trained one's
(so that greedy replies vary with the prompt) and one frequent token made a stop token (so that some replies
end on their own, and later turns are asked). The server is a stdlib HTTP server in a thread that answers
with transformers' own `generate`, one prompt at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params.sections import RegenerateParams
from dflashpipe.core.pipeline import REGENERATE_METRICS, REGENERATED, TOKENS, StageKey
from dflashpipe.regenerate.endpoint import Endpoint, EndpointError
from dflashpipe.regenerate.run import regenerate_manifest
from dflashpipe.target.chat import load_chat_tokenizer
from dflashpipe.tokens.run import tokenize_manifest
from tests.conftest import RUN_PROFILE, copy_project, run, set_params
from tests.test_tokenize import KEY, PARAMS, chat_jsonl, files, manifest
from tests.tiny import project_params, write_talking_target

REGENERATE = dataclasses.replace(
    RegenerateParams(**project_params("regenerate")), enabled=True, max_new_tokens=6, batch_size=4
)
STAGE_KEY = StageKey("regenerate", {"param:params.yaml:regenerate.max_new_tokens": "6"})


@pytest.fixture(scope="module")
def talking_target(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    return write_talking_target(tmp_path_factory.mktemp("talking-target"), smollm2_tokenizer_dir)


class CompletionsServer:
    """/v1/models and /v1/completions (token-id prompts, greedy), answered by transformers' `generate`."""

    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="float32").eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.requests: list[int] = []
        self.version = "0.0-test"
        """What GET /version answers: the engine's version, part of what a shard records."""
        self.refuse_longer_than: int | None = None
        """A prompt longer is refused with HTTP 400, as vLLM refuses one over its max_model_len."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/version":
                    self.reply({"version": server.version})
                else:
                    self.reply({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/completions" and body["temperature"] == 0 and body["model"] == "tiny"
                prompt = body["prompt"]
                assert body["return_token_ids"] is True
                if isinstance(prompt, str):  # the canary (endpoint.CANARY_PROMPT): text, as the server encodes it
                    prompt = server.tokenizer.encode(prompt)
                else:
                    server.requests.append(len(prompt))
                    if server.refuse_longer_than is not None and len(prompt) > server.refuse_longer_than:
                        data = b'{"error": {"message": "prompt too long for this model"}}'
                        self.send_response(400)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        return
                self.reply({"choices": [server.complete(0, prompt, body["max_tokens"])]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, index: int, prompt: list[int], max_tokens: int) -> dict:
        import torch

        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        stopped = tokens[-1] in self.model.generation_config.eos_token_id
        text = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
        # as vLLM: the ids end with the stop token the reply ended on
        return {"index": index, "text": text, "token_ids": tokens, "finish_reason": "stop" if stopped else "length"}


def conversations(directory: Path) -> list[list]:
    return [
        row["conversation"]
        for path in sorted(directory.glob("train-*.parquet"))
        for row in pq.read_table(path).to_pylist()
    ]


def test_the_target_answers_every_turn_in_process_and_from_an_endpoint_alike(tmp_path, talking_target):
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m = manifest(tmp_path, 30)
    here = regenerate_manifest(REGENERATE, m, talking_target, tmp_path / "here", STAGE_KEY)
    server = CompletionsServer(talking_target)
    try:
        there = regenerate_manifest(
            dataclasses.replace(REGENERATE, batch_size=7, endpoints=(server.url,)),
            m,
            talking_target,
            tmp_path / "there",
            STAGE_KEY,
        )
    finally:
        server.httpd.shutdown()
    assert conversations(tmp_path / "here") == conversations(tmp_path / "there")
    counts = here.summary["counts"]
    # one prompt per request (the server's batching keeps them together), and the same counts, tokens included
    assert len(server.requests) == counts["replies"] + counts["skipped_turns"]["empty_reply"]
    assert counts == there.summary["counts"]
    # every sample's replies are the target's; later turns asked after its earlier replies; nothing lost uncounted
    dropped = counts["dropped_samples"]
    assert counts["samples_in"] == 30 == counts["samples_out"] + sum(dropped.values())
    assert dropped["no_assistant_turn"] == 2  # chat_jsonl: every 17th sample has no assistant turn
    assert 0 < counts["stopped_at_limit"] < counts["replies"] and counts["replies"] > counts["samples_out"]
    original = {json.dumps(c[0]): c for c in conversations(m)}
    for turns in conversations(tmp_path / "here"):
        assert turns[-1]["role"] == "assistant" and turns[1]["content"] != original[json.dumps(turns[0])][1]["content"]
    # a second reply is the target's answer to the conversation that holds its own first reply
    chat = load_chat_tokenizer(talking_target)
    turns = next(t for t in conversations(tmp_path / "here") if len(t) == 4)
    prompt = chat.backend.encode(chat.render(turns[:3], add_generation_prompt=True), add_special_tokens=False).ids
    assert server.complete(0, prompt, 6)["text"] == turns[3]["content"]
    settings = here.summary["settings"]
    assert (settings["temperature"], settings["max_new_tokens"], len(settings["target_sha256"])) == (0, 6, 64)
    assert settings["chat_template_sha256"] == there.summary["settings"]["chat_template_sha256"]
    # what made the replies: here the device type and dtype, there what the endpoint served
    assert settings["generator"] == {"engine": "in_process", "device_type": "cpu", "dtype": "float32"}
    assert there.summary["settings"]["generator"]["id"] == "tiny"
    assert here.summary["accounting"] == {"in": 30, "replied": counts["samples_out"], "failed": 0, "skipped": 2}

    # A prompt longer than max_prompt_tokens is skipped, and its conversation ends before it.
    short = regenerate_manifest(
        dataclasses.replace(REGENERATE, max_prompt_tokens=48), m, talking_target, tmp_path / "short"
    )
    assert short.summary["counts"]["skipped_turns"]["prompt_too_long"] > 0
    assert short.summary["counts"]["replies"] < counts["replies"]


def test_tokenize_trains_on_the_very_sequence_the_target_read_and_wrote(tmp_path, talking_target):
    """Each regenerated reply reaches its token row as the ids the target produced, after the ids it read: run
    the target greedily on a row's tokens before a supervised reply and it writes that reply again, token for
    token, for every reply of every row (later turns included: their prompts hold the earlier replies' own ids)."""
    import numpy as np

    from dflashpipe.target.adapter import Target
    from dflashpipe.target.batching import greedy_replies
    from dflashpipe.tokens.shards import load_tokens

    chat_jsonl(tmp_path / "chats.jsonl", 40)
    regenerate_manifest(REGENERATE, manifest(tmp_path, 30), talking_target, tmp_path / "here", STAGE_KEY)
    tokens = tokenize_manifest(PARAMS, tmp_path / "here", talking_target, tmp_path / "tokens", KEY)
    assert tokens.summary["mask_method"] == {"carried": tokens.summary["samples_out"]}
    target = Target.load(talking_target, "cpu", "float32")
    stop = target.model.generation_config.eos_token_id
    data, replies = load_tokens(tmp_path / "tokens"), 0
    for i in range(len(data)):
        ids, mask = (np.asarray(a, dtype=np.int64) for a in data.sequence(i))
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
        for first in starts:
            (again,) = greedy_replies(target, [ids[:first].tolist()], REGENERATE.max_new_tokens, stop)
            assert list(again.tokens) == ids[first : first + len(again.tokens)].tolist(), (i, first)
            replies += 1
    assert replies > len(data)  # later turns were checked too


def test_an_unreachable_endpoint_is_one_error_naming_the_url(tmp_path, talking_target):
    chat_jsonl(tmp_path / "chats.jsonl", 10)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    endpoint = Endpoint(url, "tiny", retries=2, backoff_s=0.01)
    # the first request: /models, for what the server serves (endpoint.served)
    with pytest.raises(EndpointError, match=rf"^regenerate.endpoints: {url}/models unreachable after 3 attempts"):
        regenerate_manifest(REGENERATE, manifest(tmp_path, 10), talking_target, tmp_path / "out", endpoints=[endpoint])


def test_disabled_tokenize_reads_the_manifests_bytes_and_writes_the_same_tokens(tmp_path, smollm2_tokenizer_dir):
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m, out = manifest(tmp_path, 30), tmp_path / "regenerated"
    (out).mkdir()
    (out / "train-chats-00007.parquet").write_text("left over from a larger run")
    disabled = dataclasses.replace(REGENERATE, enabled=False)
    regenerate_manifest(disabled, m, smollm2_tokenizer_dir, out, STAGE_KEY)
    shards = sorted(p.name for p in m.glob("train-*"))
    assert sorted(p.name for p in out.iterdir()) == ["files.json", "summary.json", *shards]
    assert all(os.path.samefile(m / name, out / name) for name in shards)  # hard links: no bytes copied
    # tokenize under one key: the same bytes, whether it reads the manifest or the disabled stage's output
    tokenize_manifest(PARAMS, m, smollm2_tokenizer_dir, tmp_path / "from-manifest", KEY)
    tokenize_manifest(PARAMS, out, smollm2_tokenizer_dir, tmp_path / "from-regenerated", KEY)
    assert {k: v[0] for k, v in files(tmp_path / "from-manifest").items()} == {
        k: v[0] for k, v in files(tmp_path / "from-regenerated").items()
    }


def test_growing_the_data_answers_only_the_new_shards_and_a_new_key_all(tmp_path, talking_target):
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    out = tmp_path / "regenerated"
    first = regenerate_manifest(REGENERATE, manifest(tmp_path, 20), talking_target, out, STAGE_KEY)
    assert first.regenerated_shards == ["train-chats-00000.parquet", "train-chats-00001.parquet"]
    before = files(out)
    grown = regenerate_manifest(REGENERATE, manifest(tmp_path, 30), talking_target, out, STAGE_KEY)
    assert (grown.regenerated_shards, grown.reused_shards) == (["train-chats-00002.parquet"], first.regenerated_shards)
    after = files(out)
    assert all(after[name] == before[name] for name in first.regenerated_shards)  # same bytes, never rewritten
    regenerate_manifest(REGENERATE, tmp_path / "manifest", talking_target, tmp_path / "fresh", STAGE_KEY)
    assert {k: v[0] for k, v in files(tmp_path / "fresh").items()} == {k: v[0] for k, v in after.items()}
    # a damaged shard is answered again; another key answers every shard
    damaged = out / "train-chats-00001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-64])
    again = regenerate_manifest(REGENERATE, tmp_path / "manifest", talking_target, out, STAGE_KEY)
    assert again.regenerated_shards == ["train-chats-00001.parquet"]
    other = StageKey("regenerate", {"param:params.yaml:regenerate.max_new_tokens": "7"})
    assert (
        len(regenerate_manifest(REGENERATE, tmp_path / "manifest", talking_target, out, other).regenerated_shards) == 3
    )


def test_dvc_repro_regenerates_then_reuses_the_old_shards_when_the_data_grows(pipeline_run, tmp_path, talking_target):
    project = copy_project(pipeline_run, tmp_path / "project")
    shutil.rmtree(project / "models/tiny")  # the pipeline's tiny target says only "\n\n...": all empty replies
    shutil.copytree(talking_target, project / "models/tiny")
    run(["dvc", "repro", "-f", "target"], project)  # the fingerprint stats the new files; target reads them
    set_params(project, regenerate__enabled=True, regenerate__max_new_tokens=3, regenerate__batch_size=32)
    assert "Running stage 'regenerate'" in run(["dvc", "repro", "tokenize"], project).stdout
    before = files(project / REGENERATED)
    shards = [n for n in before if n.endswith(".parquet")]
    summary = json.loads((project / REGENERATED / "summary.json").read_text())
    assert summary["enabled"] and summary["counts"]["replies"] > 0
    set_params(project, data__num_samples=RUN_PROFILE["data__num_samples"] + 40)
    out = run(["dvc", "repro", "tokenize"], project)
    assert "Running stage 'regenerate'" in out.stdout and "Running stage 'tokenize'" in out.stdout
    after = files(project / REGENERATED)
    assert all(after[name] == before[name] for name in shards)
    metrics = read_record_at(project / REGENERATE_METRICS)
    # each source grows by its weight's share of the 40 (20, 12, 8): one new shard of each, every full one kept
    assert (metrics["regenerated_shards"], metrics["reused_shards"]) == (3, len(shards))
    assert json.loads((project / TOKENS / "summary.json").read_text())["samples_in"] == metrics["samples_out"]


def test_a_reply_depends_on_what_decides_it_and_not_on_who_answers_or_how_many_at_once(tmp_path, talking_target):
    """Devices, endpoints and concurrency are left out of the key (pipeline.REUSE): the bytes do not move with them.
    What decides a reply and is no dvc.yaml input (in process or an endpoint, the engine's version) is in each
    shard's record: changing it answers every shard again."""
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m = manifest(tmp_path, 30)

    def shards(out: Path) -> dict:
        return {k: v[0] for k, v in files(out).items() if k != "files.json"}

    one = regenerate_manifest(REGENERATE, m, talking_target, tmp_path / "one", STAGE_KEY)
    two = dataclasses.replace(REGENERATE, devices=("cpu", "cpu"))
    assert regenerate_manifest(two, m, talking_target, tmp_path / "two", STAGE_KEY).summary == one.summary
    assert shards(tmp_path / "two") == shards(tmp_path / "one")  # whole shards to each device
    again = regenerate_manifest(two, m, talking_target, tmp_path / "one", STAGE_KEY)
    assert again.regenerated_shards == [] and len(again.reused_shards) == 3

    a, b = CompletionsServer(talking_target), CompletionsServer(talking_target)
    try:
        serial = dataclasses.replace(REGENERATE, endpoints=(a.url,), concurrency=1)
        regenerate_manifest(serial, m, talking_target, tmp_path / "serial", STAGE_KEY)
        both = dataclasses.replace(REGENERATE, endpoints=(a.url, b.url), concurrency=3)
        regenerate_manifest(both, m, talking_target, tmp_path / "both", STAGE_KEY)
        assert shards(tmp_path / "both") == shards(tmp_path / "serial") and b.requests  # b answered some
        assert conversations(tmp_path / "both") == conversations(tmp_path / "one")
        # in process, then an endpoint, under the same key: every shard answered again, said in one line
        switched = regenerate_manifest(serial, m, talking_target, tmp_path / "one", STAGE_KEY)
        assert len(switched.regenerated_shards) == 3 and shards(tmp_path / "one") == shards(tmp_path / "serial")
        # another engine version behind the same URLs: answered again
        a.version = b.version = "0.1-test"
        upgraded = regenerate_manifest(both, m, talking_target, tmp_path / "both", STAGE_KEY)
        assert len(upgraded.regenerated_shards) == 3
        # two endpoints that serve different things are refused before anything is touched
        b.version = "0.2-test"
        before = files(tmp_path / "both")
        with pytest.raises(EndpointError) as differ:
            regenerate_manifest(both, m, talking_target, tmp_path / "both", STAGE_KEY)
        message = str(differ.value)
        assert "\n" not in message and a.url in message and b.url in message, message
        assert files(tmp_path / "both") == before
    finally:
        a.httpd.shutdown()
        b.httpd.shutdown()


def test_a_prompt_the_server_refuses_is_counted_failed_and_every_sample_accounted_for(tmp_path, talking_target):
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m = manifest(tmp_path, 30)
    server = CompletionsServer(talking_target)
    server.refuse_longer_than = 44  # the first prompts are 44 or 45 tokens: about half are refused
    try:
        params = dataclasses.replace(REGENERATE, endpoints=(server.url,), concurrency=4)
        run = regenerate_manifest(params, m, talking_target, tmp_path / "out", STAGE_KEY)
    finally:
        server.httpd.shutdown()
    counts, accounting = run.summary["counts"], run.summary["accounting"]
    assert counts["skipped_turns"]["refused"] > 0 and accounting["failed"] == counts["dropped_samples"]["refused"] > 0
    assert accounting["in"] == 30 == accounting["replied"] + accounting["failed"] + accounting["skipped"]
    assert accounting["replied"] == counts["samples_out"] > 0
