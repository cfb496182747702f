"""An endpoint that needs a key: the key comes from OPENAI_API_KEY, goes out as a bearer token, and shows up in
no error or record; a refusal is one line naming the variable. The server is a stdlib HTTP server in a thread.

What the endpoint serves (`/models` and the canary) is recorded with every shard it answered; a shard is reused
only while the server answers the canary as it did. The server's "model" is a reply table: changing its reply
to the canary prompt is serving another model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflashpipe.core.artifacts import write_json_atomic
from dflashpipe.regenerate.endpoint import (
    API_KEY_ENV,
    CANARY_MAX_TOKENS,
    CANARY_PROMPT,
    Endpoint,
    EndpointError,
    ServedModel,
)
from dflashpipe.regenerate.run import regenerate_manifest, regenerate_metrics
from dflashpipe.regenerate.shards import stored_shard
from tests.test_regenerate import REGENERATE, STAGE_KEY
from tests.test_tokenize import chat_jsonl, files, manifest

KEY = "sk-test-7f3a9c-never-printed"
CARD = {"id": "tiny", "object": "model", "root": "/srv/models/tiny-v1", "max_model_len": 2048}
"""A model card as vLLM's /models gives it (less the fields nothing reads)."""


class KeyedServer:
    """/v1/models and /v1/completions behind `Authorization: Bearer KEY`; a refusal echoes the header it got
    (as some servers do), so an error that passed the server's text on would show the key."""

    def __init__(self, status: int = 401, card: dict | None = None, replies: dict[str, str] | None = None) -> None:
        self.seen: list[str | None] = []
        self.status = status
        self.card = card or {"id": "tiny"}
        self.replies = dict(replies or {})
        """Text prompt -> its greedy reply: the model the server runs. Token-id prompts are answered "ok"; every
        reply's token ids are [3000, 3001]."""
        self.bodies: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def authorised(self) -> bool:
                got = self.headers.get("Authorization")
                server.seen.append(got)
                if got != f"Bearer {KEY}":
                    self.answer(status, {"error": {"message": f"invalid api key: {got}\nsecond line"}})
                    return False
                return True

            def do_GET(self) -> None:
                if self.authorised():
                    self.answer(200, {"data": [server.card]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.authorised():
                    server.bodies.append(body)
                    text = server.replies[body["prompt"]] if isinstance(body["prompt"], str) else "ok"
                    # the ids stand for the text: nothing here decodes them but the stage, into its own text
                    choice = {"index": 0, "text": text, "token_ids": [3000, 3001], "finish_reason": "length"}
                    self.answer(200, {"choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(params=[401, 403])
def server(request):
    s = KeyedServer(request.param)
    yield s
    s.close()


def test_the_key_from_the_environment_is_sent_as_a_bearer_token(server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    endpoint = Endpoint(server.url, retries=0)
    assert endpoint.model_name() == "tiny"
    assert [endpoint.complete("tiny", p, 4).text for p in ([1, 2], [3])] == ["ok", "ok"]
    assert server.seen == [f"Bearer {KEY}"] * 3  # /models, then one request per prompt
    assert KEY not in repr(endpoint)  # nothing holds it: no settings record or log can carry it


def test_no_key_is_one_line_naming_the_variable(server, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(EndpointError) as refused:
        Endpoint(server.url, "tiny", retries=3, backoff_s=10).complete("tiny", [1], 4)  # refused: no retry
    message = str(refused.value)
    assert "\n" not in message and API_KEY_ENV in message and "unset" in message, message
    assert server.seen == [None]


def test_a_wrong_key_is_one_line_naming_the_variable_and_never_the_key(server, monkeypatch):
    wrong = KEY + "-revoked"
    monkeypatch.setenv(API_KEY_ENV, wrong)
    with pytest.raises(EndpointError) as refused:
        Endpoint(server.url, retries=0).model_name()
    message = str(refused.value)
    assert "\n" not in message and f"set {API_KEY_ENV}" in message and f"HTTP {server.status}" in message
    assert wrong not in message and KEY not in message, message


def test_text_a_server_echoes_is_scrubbed_of_the_key(monkeypatch):
    """Any other refusal passes the server's text on: with the key in it replaced."""
    monkeypatch.setenv(API_KEY_ENV, KEY)

    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            data = f"bad request from {self.headers.get('Authorization')}".encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EndpointError, match=r"HTTP 400: bad request from Bearer \*\*\*") as refused:
            Endpoint(f"http://127.0.0.1:{httpd.server_address[1]}/v1", retries=0).model_name()
        assert KEY not in str(refused.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- what the endpoint serves, recorded with every shard -------------------------------------------------------

FIRST, SECOND = "2, 3, 5, 7, 11. Jupiter.", "2 3 5 7 11 and Saturn"
"""Two "models": their greedy replies to the canary prompt."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def served_server(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    s = KeyedServer(card=CARD, replies={CANARY_PROMPT: FIRST})
    yield s
    s.close()


def test_served_is_what_models_says_and_the_canary_reply_hashed(served_server):
    # where the server keeps its weights (`root`) is not what it serves: two servers of one model may differ there
    assert Endpoint(served_server.url, retries=0).served() == ServedModel("tiny", 2048, sha256(FIRST))
    canary = served_server.bodies[-1]
    assert (canary["model"], canary["prompt"], canary["temperature"]) == ("tiny", CANARY_PROMPT, 0)
    assert canary["max_tokens"] == CANARY_MAX_TOKENS
    assert set(served_server.seen) == {f"Bearer {KEY}"}
    # what /models leaves out is recorded as absent, never guessed; a model it does not list is refused in a line
    served_server.card = {"id": "tiny"}
    assert Endpoint(served_server.url, retries=0).served() == ServedModel("tiny", None, sha256(FIRST))
    with pytest.raises(EndpointError) as other:
        Endpoint(served_server.url, "tiny-alias", retries=0).served()
    message = str(other.value)
    assert "\n" not in message and served_server.url in message and "['tiny'], not" in message, message
    assert "regenerate.endpoint_model 'tiny-alias'" in message


def canaries_asked(server: KeyedServer) -> int:
    return sum(isinstance(b["prompt"], str) for b in server.bodies)


def test_shards_record_the_served_model_and_are_answered_again_when_it_changes(
    served_server, tmp_path, tiny_target_dir, capsys
):
    chat_jsonl(tmp_path / "chats.jsonl", 20)
    m, out = manifest(tmp_path, 20), tmp_path / "regenerated"
    params = dataclasses.replace(REGENERATE, endpoints=(served_server.url,))

    def regenerate():
        run = regenerate_manifest(params, m, tiny_target_dir, out, STAGE_KEY, [Endpoint(served_server.url, retries=0)])
        write_json_atomic(tmp_path / "metrics.json", regenerate_metrics(run))
        return run

    # (a) every shard records what served it: /models' description and the canary
    first = regenerate()
    shards = sorted(p for p in out.glob("train-*.parquet"))
    assert len(shards) == 2 and first.regenerated_shards == [p.name for p in shards]
    served = {
        "engine": "endpoint",
        "id": "tiny",
        "max_model_len": 2048,
        "canary_sha256": sha256(FIRST),
        "engine_version": None,  # no GET /version here
    }
    assert all(stored_shard(p).record["settings"]["generator"] == served for p in shards)
    assert first.summary["settings"]["generator"] == served
    assert json.loads((tmp_path / "metrics.json").read_text())["generator"] == served
    assert canaries_asked(served_server) == 1
    capsys.readouterr()

    # (b) the same server: every shard reused, untouched; the canary asked once for the run
    before = files(out)
    again = regenerate()
    assert (again.regenerated_shards, again.reused_shards) == ([], first.regenerated_shards)
    assert all(files(out)[p.name] == before[p.name] for p in shards)
    assert canaries_asked(served_server) == 2
    assert "generator changed" not in capsys.readouterr().out

    # (c) another model behind the same URL and name: the key holds, but every shard is answered again
    served_server.replies[CANARY_PROMPT] = SECOND
    changed = regenerate()
    assert changed.regenerated_shards == first.regenerated_shards and changed.reused_shards == []
    printed = capsys.readouterr().out
    line = f"generator changed (canary_sha256 {sha256(FIRST)[:12]} -> {sha256(SECOND)[:12]}): answering 2 shard(s)"
    assert printed.count(line) == 1, printed
    assert all(stored_shard(p).record["settings"]["generator"]["canary_sha256"] == sha256(SECOND) for p in shards)
    assert json.loads((tmp_path / "metrics.json").read_text())["generator"]["canary_sha256"] == sha256(SECOND)

    # (d) the key went out with every request and is in no file written, nor in what was printed
    assert set(served_server.seen) == {f"Bearer {KEY}"}
    written = [p for p in Path(tmp_path).rglob("*") if p.is_file() and p.name != "chats.jsonl"]
    assert out / "summary.json" in written and tmp_path / "metrics.json" in written
    assert not [p for p in written if KEY.encode() in p.read_bytes()]
    assert KEY not in printed
