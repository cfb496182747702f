"""Replies from an OpenAI-compatible server (vLLM, SGLang): what users run to regenerate at scale.

Prompts are sent to `<base>/completions` as token ids (the OpenAI API's `prompt: int[]`), rendered and
encoded here exactly as in the in-process path, so the server's own chat template or BOS handling cannot
change them; temperature 0, one prompt per request, so the server's continuous batching schedules them (the
caller keeps several in flight). Replies must come back as token ids (vLLM's `return_token_ids`: each
choice's `token_ids`), so a reply reaches training as the very tokens the target produced, as in process; a
reply in text alone is refused, since text encoded again is not the target's tokens. A connection failure, a
timeout, 429 or a 5xx is retried with exponential backoff; what still fails is one line naming the URL. A 400
is the server's verdict on that one prompt (vLLM: prompt plus max_tokens over its max_model_len), the same on
every run: `PromptRefused`, which the caller counts.

A server that needs a key gets it from the environment, never from params.yaml (which DVC records and git
keeps): `OPENAI_API_KEY`, sent as `Authorization: Bearer`. The key is read at each request and held by no
object, so it appears in no settings record, metric, lock or log; any text the server sends back is
scrubbed of it before it reaches an error. A 401 or 403 is one line naming the variable to set.

The replies depend on whatever model the server runs, which no hash of data/target covers: `served` records
what the server says it serves (`/models`), its engine's version (vLLM's `GET /version`) and a canary, the sha256
of its greedy reply to a fixed prompt, so that a shard answered by another model or engine is told apart from one
the current one would write (regenerate.run).
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


CANARY_PROMPT = "The first five prime numbers are 2, 3,"
"""Sent as text, so the server's own tokenizer is part of what the canary covers. A sentence to continue, not a
question: sent without a chat template, a question gets a chat model's stop token at once (SmolLM2 answers only
`<|im_end|>`), whose hash tells no two models apart. Any change of weights, tokenizer or dtype large enough to move a
greedy reply is likely to show."""
CANARY_MAX_TOKENS = 24
"""Few tokens: long enough to tell models apart, short enough that a server's run-to-run numerical noise
(batching, kernels) rarely reaches a greedy tie."""


class EndpointError(DflashpipeError):
    """The endpoint is unreachable, refuses the request, or answers something that is not a completion."""


class PromptRefused(EndpointError):
    """HTTP 400: the server refuses this request's content (for a prompt: too long for it), and always will."""


class RouteMissing(EndpointError):
    """HTTP 404: the server has no such route (or model)."""


@dataclass(frozen=True)
class Completion:
    text: str
    stopped: bool
    """It ended on its own (finish_reason `stop`), not at max_tokens (`length`)."""
    token_ids: tuple[int, ...]
    """The reply's tokens as the server generated them, the stop token it ended on excluded (as in process)."""


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
    """What the endpoint serves: as `/models` and `/version` describe it (a field left out is None, never guessed),
    and the canary that tells whether it still answers as it did. Not where it loaded its weights from (vLLM's
    `root`): two servers of one model may keep them in different places."""

    id: str
    """The model name every completion request asks for."""
    max_model_len: int | None
    """Which prompts the server refuses (too long) depends on it."""
    canary_sha256: str
    """The sha256 of the greedy reply (UTF-8 text) to CANARY_PROMPT, at most CANARY_MAX_TOKENS tokens."""
    engine_version: str | None = None
    """`GET <server>/version` (vLLM); None where the server has no such route."""

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "max_model_len": self.max_model_len,
            "canary_sha256": self.canary_sha256,
            "engine_version": self.engine_version,
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

    def _request(self, path: str, body: dict | None = None, base: str | None = None) -> dict:
        url = (base or self.base_url).rstrip("/") + path
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
                        f"regenerate.endpoints: {url} {what} (HTTP {exc.code}): set {API_KEY_ENV} to the endpoint's key"
                    ) from None
                if exc.code != 429 and exc.code < 500:
                    refused = {400: PromptRefused, 404: RouteMissing}.get(exc.code, EndpointError)
                    raise refused(
                        f"regenerate.endpoints: {url} refused the request: HTTP {exc.code}: {detail}"
                    ) from None
                failure = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                failure = scrub(str(getattr(exc, "reason", exc)))
            except ValueError as exc:
                raise EndpointError(f"regenerate.endpoints: {url} answered something that is not JSON: {exc}") from None
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise EndpointError(
            f"regenerate.endpoints: {url} unreachable after {self.retries + 1} attempts ({failure}): start the "
            f"server, or set regenerate.endpoints: [] to generate in this process"
        )

    def model_name(self) -> str:
        if self.model is not None:
            return self.model
        answer = self._request("/models")
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise EndpointError(
                f"regenerate.endpoints: {self.base_url}/models lists no model: {answer!r:.200}"
            ) from None

    def served(self) -> ServedModel:
        """The model `model` names (or the first listed) as `/models` describes it, the engine's version and the
        canary: three requests, made once per stage run. A `model` the list leaves out is refused (a server that
        lists nothing is taken at its word)."""
        answer = self._request("/models")
        try:
            cards = [card for card in answer["data"] if isinstance(card, dict) and "id" in card]
        except (KeyError, TypeError):
            cards = []
        if self.model is None and not cards:
            raise EndpointError(f"regenerate.endpoints: {self.base_url}/models lists no model: {answer!r:.200}")
        name = self.model if self.model is not None else str(cards[0]["id"])
        card = next((c for c in cards if str(c["id"]) == name), {})
        length = card.get("max_model_len")
        if self.model is not None and cards and name not in (listed := [str(c["id"]) for c in cards]):
            raise EndpointError(
                f"regenerate.endpoints: {self.base_url}/models serves {listed}, not regenerate.endpoint_model "
                f"{name!r}: start the server with that model (--served-model-name), or name one it serves"
            )
        # the canary is text, so the server's tokenizer is covered; it asks for token ids as every request does,
        # so a server that leaves them out is refused here, before anything is written
        text = self.complete(name, CANARY_PROMPT, CANARY_MAX_TOKENS).text
        number = json_number(length)
        return ServedModel(
            id=name,
            max_model_len=int(number) if number is not None and number.is_integer() else None,
            canary_sha256=hashlib.sha256(text.encode()).hexdigest(),
            engine_version=self.engine_version(),
        )

    def engine_version(self) -> str | None:
        """vLLM answers `GET /version` beside `/v1` with {"version": ...}; a server without it, None."""
        try:
            answer = self._request("/version", base=self.base_url.rstrip("/").removesuffix("/v1"))
        except RouteMissing:
            return None
        version = answer.get("version") if isinstance(answer, dict) else None
        return None if version is None else str(version)

    def complete(self, model: str, prompt: Sequence[int] | str, max_new_tokens: int) -> Completion:
        """One greedy completion of one prompt; `PromptRefused` where the server refuses that prompt."""
        body = {
            "model": model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "n": 1,
            "return_token_ids": True,  # vLLM's extension
        }
        answer = self._request("/completions", body)
        try:
            (choice,) = answer["choices"]
            text, stopped, ids = str(choice["text"]), choice["finish_reason"] != "length", reply_ids(choice)
        except (KeyError, TypeError, ValueError) as exc:
            raise EndpointError(
                f"regenerate.endpoints: {self.base_url}/completions: not a completions answer ({exc})"
            ) from None
        if ids is None:
            raise EndpointError(
                f"regenerate.endpoints: {self.base_url}/completions answered text without the reply's token ids: "
                f"regenerate needs the target's own tokens, not text encoded again; serve with vLLM, which "
                f"honours `return_token_ids`, or a server that returns each choice's `token_ids`"
            )
        return Completion(text, stopped, ids)
