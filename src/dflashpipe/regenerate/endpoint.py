"""Replies from an OpenAI-compatible server (vLLM, SGLang): what users run to regenerate at scale.

Prompts are sent to `<base>/completions` as token ids (the OpenAI API's `prompt: int[][]`), rendered and
encoded here exactly as in the in-process path, so the server's own chat template or BOS handling cannot
change them; temperature 0, one request per batch. Replies come back as token ids too where the server gives
them (vLLM's `return_token_ids`: each choice's `token_ids`), so a reply reaches training as the very tokens the
target produced, as in process; a server that answers text alone leaves them None. A connection failure, a
timeout, 429 or a 5xx is retried with exponential backoff; what still fails is one line naming the URL.

A server that needs a key gets it from the environment, never from params.yaml (which DVC records and git
keeps): `OPENAI_API_KEY`, sent as `Authorization: Bearer`. The key is read at each request and held by no
object, so it appears in no settings record, metric, lock or log; any text the server sends back is
scrubbed of it before it reaches an error. A 401 or 403 is one line naming the variable to set.

The replies depend on whatever model the server runs, which no hash of data/target covers: `served` records
what the server says it serves (`/models`) and a canary, the sha256 of its greedy reply to a fixed prompt, so
that a shard answered by another model is told apart from one the current model would write (regenerate.run).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError

API_KEY_ENV = "OPENAI_API_KEY"
"""The environment variable that holds the endpoint's API key (unset: no Authorization header is sent)."""


CANARY_PROMPT = "List the first five prime numbers, then name the largest planet of the solar system."
"""Sent as text, so the server's own tokenizer is part of what the canary covers. Short and with a definite
answer: any change of weights, tokenizer or dtype large enough to move a greedy reply is likely to show."""
CANARY_MAX_TOKENS = 24
"""Few tokens: long enough to tell models apart, short enough that a server's run-to-run numerical noise
(batching, kernels) rarely reaches a greedy tie."""


class EndpointError(DflashpipeError):
    """The endpoint is unreachable, refuses the request, or answers something that is not a completion."""


@dataclass(frozen=True)
class Completion:
    text: str
    stopped: bool
    """It ended on its own (finish_reason `stop`), not at max_tokens (`length`)."""
    token_ids: tuple[int, ...] | None = None
    """The reply's tokens as the server generated them, the stop token it ended on excluded (as in process);
    None when the server answered text alone."""


def reply_ids(choice: dict) -> tuple[int, ...] | None:
    """A choice's generated token ids less the stop token, or None. vLLM lists the token it stopped on (the eos, or
    a stop token id: `stop_reason` None or that id) among them; a stop string (`stop_reason` a string) is text
    the ids do not end with, and this client asks for none."""
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    if choice.get("finish_reason") == "stop" and ids and not isinstance(choice.get("stop_reason"), str):
        ids = ids[:-1]
    return tuple(ids)


@dataclass(frozen=True)
class ServedModel:
    """What the endpoint serves: as `/models` describes it (a field it leaves out is None, never guessed), and
    the canary that tells whether it still answers as it did."""

    id: str
    """The model name every completion request asks for."""
    root: str | None
    """vLLM: the weights it loaded (a path or hub name)."""
    max_model_len: int | None
    canary_sha256: str
    """The sha256 of the greedy reply (UTF-8 text) to CANARY_PROMPT, at most CANARY_MAX_TOKENS tokens."""

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "root": self.root,
            "max_model_len": self.max_model_len,
            "canary_sha256": self.canary_sha256,
        }


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str | None = None
    """None: the first model `<base>/models` lists."""
    retries: int = 4
    backoff_s: float = 1.0
    """The first wait; each retry waits twice as long as the one before."""
    timeout_s: float = 600.0

    def _request(self, path: str, body: dict | None = None) -> dict:
        url = self.base_url.rstrip("/") + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(API_KEY_ENV, "").strip()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(url, data=data, headers=headers)

        def scrub(text: str) -> str:  # a server may echo what it was sent
            return text.replace(key, "***") if key else text

        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:  # before URLError: it is one
                detail = scrub(exc.read().decode(errors="replace")[:300]).replace("\n", " ")
                if exc.code in (401, 403):
                    what = (
                        f"refused the key in {API_KEY_ENV}" if key else f"needs an API key and {API_KEY_ENV} is unset"
                    )
                    raise EndpointError(
                        f"regenerate.endpoint {url} {what} (HTTP {exc.code}): set {API_KEY_ENV} to the endpoint's key"
                    ) from None
                if exc.code != 429 and exc.code < 500:
                    raise EndpointError(
                        f"regenerate.endpoint {url} refused the request: HTTP {exc.code}: {detail}"
                    ) from None
                failure = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                failure = scrub(str(getattr(exc, "reason", exc)))
            except ValueError as exc:
                raise EndpointError(f"regenerate.endpoint {url} answered something that is not JSON: {exc}") from None
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise EndpointError(
            f"regenerate.endpoint {url} unreachable after {self.retries + 1} attempts ({failure}): start the "
            f"server, or set regenerate.endpoint: null to generate in this process"
        )

    def model_name(self) -> str:
        if self.model is not None:
            return self.model
        answer = self._request("/models")
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"regenerate.endpoint {self.base_url}/models lists no model: {answer!r:.200}") from None

    def served(self) -> ServedModel:
        """The model `model` names (or the first listed) as `/models` describes it, and its canary: two requests,
        made once per stage run. A `model` the list leaves out is recorded by its name alone."""
        answer = self._request("/models")
        try:
            cards = [card for card in answer["data"] if isinstance(card, dict) and "id" in card]
        except (KeyError, TypeError):
            cards = []
        if self.model is None and not cards:
            raise EndpointError(f"regenerate.endpoint {self.base_url}/models lists no model: {answer!r:.200}")
        name = self.model if self.model is not None else str(cards[0]["id"])
        card = next((c for c in cards if str(c["id"]) == name), {})
        root, length = card.get("root"), card.get("max_model_len")
        body = {
            "model": name,
            "prompt": CANARY_PROMPT,
            "max_tokens": CANARY_MAX_TOKENS,
            "temperature": 0,
            "n": 1,
        }
        reply = self._request("/completions", body)
        try:
            text = reply["choices"][0]["text"]
            if not isinstance(text, str):
                raise TypeError(f"text is {type(text).__name__}")
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(
                f"regenerate.endpoint {self.base_url}/completions: not a completions answer to the canary ({exc!r})"
            ) from None
        number = json_number(length)
        return ServedModel(
            id=name,
            root=None if root is None else str(root),
            max_model_len=int(number) if number is not None and number.is_integer() else None,
            canary_sha256=hashlib.sha256(text.encode()).hexdigest(),
        )

    def complete(self, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        """One greedy completion per prompt, in the prompts' order."""
        body = {
            "model": model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "n": 1,
            "return_token_ids": True,  # vLLM's extension; a server without it answers text alone
        }
        answer = self._request("/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if [c["index"] for c in choices] != list(range(len(prompts))):
                raise ValueError(f"{len(choices)} choices for {len(prompts)} prompts")
            return [Completion(str(c["text"]), c["finish_reason"] != "length", reply_ids(c)) for c in choices]
        except (KeyError, TypeError, ValueError) as exc:
            raise EndpointError(
                f"regenerate.endpoint {self.base_url}/completions: not a completions answer ({exc})"
            ) from None
