"""An endpoint that needs a key: the key comes from OPENAI_API_KEY, goes out as a bearer token, and shows up in
no error or record; a refusal is one line naming the variable. The server is a stdlib HTTP server in a thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflashpipe.regenerate.endpoint import API_KEY_ENV, Endpoint, EndpointError

KEY = "sk-test-7f3a9c-never-printed"


class KeyedServer:
    """/v1/models and /v1/completions behind `Authorization: Bearer KEY`; a refusal echoes the header it got
    (as some servers do), so an error that passed the server's text on would show the key."""

    def __init__(self, status: int = 401) -> None:
        self.seen: list[str | None] = []
        self.status = status
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
                    self.answer(200, {"data": [{"id": "tiny"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.authorised():
                    choices = [{"index": i, "text": "ok", "finish_reason": "stop"} for i in range(len(body["prompt"]))]
                    self.answer(200, {"choices": choices})

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
    assert [c.text for c in endpoint.complete("tiny", [[1, 2], [3]], 4)] == ["ok", "ok"]
    assert server.seen == [f"Bearer {KEY}"] * 2
    assert KEY not in repr(endpoint)  # nothing holds it: no settings record or log can carry it


def test_no_key_is_one_line_naming_the_variable(server, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(EndpointError) as refused:
        Endpoint(server.url, "tiny", retries=3, backoff_s=10).complete("tiny", [[1]], 4)  # refused: no retry
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
