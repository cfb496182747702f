"""target.chat_template_kwargs reach every rendering: regenerate's prompts (an endpoint's too), tokenize's text,
evaluate's prompts; a kwarg the template does not read is one line, before any work, in every stage that renders.

The template honours `enable_thinking` as Qwen3's does (written here, not copied): false, the generation prompt
ends in an empty, closed think block, so the target answers without thinking; true or unset, the prompt leaves
the block to the target, which opens it and thinks. "No thinking when off" is therefore not "no `<think>` text":
the prompt and the token rows the drafter trains on hold that one empty block; it means no think block with
anything in it, anywhere, and no `<think>` in a reply or in a supervised token. The endpoint here answers as a
thinking target would: with a think block unless its prompt closed one.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import astuple, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params.loading import build
from dflashpipe.core.params.sections import ComputeParams, EvaluateParams, ModelParams, ProofParams
from dflashpipe.evaluate.evaluation import EvaluateInputs, evaluate_drafter
from dflashpipe.evaluate.prompts import eval_prompts
from dflashpipe.proof.stage import run_proof
from dflashpipe.regenerate.endpoint import Endpoint
from dflashpipe.regenerate.run import regenerate_manifest
from dflashpipe.target.chat import load_chat_tokenizer
from dflashpipe.tokens.run import tokenize_manifest
from dflashpipe.tokens.shards import load_tokens
from tests.test_regenerate import REGENERATE, STAGE_KEY
from tests.test_tokenize import KEY, chat_jsonl
from tests.tiny import manifest_params, project_params, source, tokenize_params

THINKING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set thought = message.content.split('</think>')[0].split('<think>')[-1].strip('\\n') "
    "if '</think>' in message.content else '' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    # a reply after the last question shows its thought (an empty block if none); earlier replies lose theirs
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n' + thought + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
OFF = {"enable_thinking": False}
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""The generation prompt with thinking off: an empty block, closed."""
ANSWER = "Here is a short answer to your question."
THOUGHT = "<think>\nThe user asks a question; I should work it out first.\n</think>\n\n"


def filled_blocks(text: str) -> list[str]:
    """The think blocks with something in them, and an opened block never closed."""
    blocks = re.findall(r"<think>(.*?)(?:</think>|$)", text, re.S)
    return [b for b in blocks if b.strip()] + (["unclosed"] if text.count("<think>") > text.count("</think>") else [])


@pytest.fixture(scope="module")
def thinking_target(tmp_path_factory, tiny_target_dir) -> Path:
    """The tiny target (the SmolLM2 tokenizer) with the thinking template: what rendering reads of a target, and
    the config and weights that regenerate's reuse key hashes."""
    out = tmp_path_factory.mktemp("thinking") / "target"
    shutil.copytree(tiny_target_dir, out)
    (out / "chat_template.jinja").write_text(THINKING)
    return out


class ThinkingServer:
    """/v1/models and /v1/completions answering token-id prompts as a thinking target: a think block first unless
    the prompt closed one; each prompt it was sent is kept, decoded."""

    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.prompts: list[str] = []
        self.asked: list[tuple[int, ...]] = []
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
                self.reply({"data": [{"id": "thinker"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if isinstance(body["prompt"], str):  # the canary
                    canary = {"index": 0, "text": "2, 3, 5", "token_ids": [17, 28, 33], "finish_reason": "length"}
                    self.reply({"choices": [canary]})
                    return
                prompt = tokenizer.decode(body["prompt"], skip_special_tokens=False)
                server.prompts.append(prompt)
                server.asked.append(tuple(body["prompt"]))
                text = ANSWER if prompt.endswith("</think>\n\n") else THOUGHT + ANSWER
                tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                self.reply({"choices": [{"index": 0, "text": text, "token_ids": tokens, "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def manifest(root: Path) -> Path:
    from dflashpipe.data.manifest import build_manifest

    root.mkdir(exist_ok=True)
    chat_jsonl(root / "chats.jsonl", 24)
    out = root / "manifest"
    build_manifest(manifest_params(16, 8, source("jsonl", name="chats", path="chats.jsonl", eval=4)), out, root=root)
    return out


@dataclass
class Made:
    prompts: list[str]
    """What the server was asked, decoded."""
    rows: list[str]
    supervised: list[str]
    """Each row's supervised tokens, decoded."""
    asked: list[tuple[int, ...]]
    """What the server was asked, as the ids it read."""
    sequences: list[tuple[np.ndarray, np.ndarray]]
    """Each row's ids and loss mask."""


def regenerate_and_tokenize(root: Path, target: Path, kwargs: dict | None) -> Made:
    """What the server was asked, the replies it gave, and the token rows tokenize made of them."""
    server = ThinkingServer(target)
    try:
        regenerate_manifest(
            REGENERATE,
            manifest(root),
            target,
            root / "regenerated",
            STAGE_KEY,
            [Endpoint(server.url, retries=0)],
            template_kwargs=kwargs,
        )
    finally:
        server.httpd.shutdown()
    params = tokenize_params(max_length=512, min_supervised_tokens=1)
    run = tokenize_manifest(params, root / "regenerated", target, root / "tokens", KEY, template_kwargs=kwargs)
    assert run.summary["samples_out"] > 0
    chat = load_chat_tokenizer(target)
    data, rows, supervised = load_tokens(root / "tokens"), [], []
    sequences = [tuple(np.asarray(a, dtype=np.int64) for a in data.sequence(i)) for i in range(len(data))]
    for ids, mask in sequences:
        rows.append(chat.tokenizer.decode(ids.tolist(), skip_special_tokens=False))
        supervised.append(chat.tokenizer.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False))
    return Made(server.prompts, rows, supervised, server.asked, sequences)


def test_thinking_off_reaches_the_endpoints_prompts_the_replies_and_the_token_rows(tmp_path, thinking_target):
    prompts, rows, supervised = astuple(regenerate_and_tokenize(tmp_path / "off", thinking_target, OFF))[:3]
    assert prompts and all(p.endswith(CLOSED) for p in prompts)
    assert not any(filled_blocks(text) for text in prompts + rows)
    # the last reply follows an empty block, as its prompt did; earlier replies lose theirs, as in Qwen3's template
    assert all(CLOSED in row for row in rows)
    assert not any("<think>" in text for text in supervised)  # the replies, as the drafter learns them
    settings = json.loads((tmp_path / "off" / "regenerated" / "summary.json").read_text())["settings"]
    assert settings["chat_template_kwargs"] == OFF

    # Unset, the prompt leaves thinking to the target, and the rows hold its thoughts: the test can fail.
    prompts, rows, supervised = astuple(regenerate_and_tokenize(tmp_path / "unset", thinking_target, None))[:3]
    assert prompts and not any(p.endswith(CLOSED) for p in prompts)
    assert all(filled_blocks(row) for row in rows) and all("<think>" in text for text in supervised)


def supervised_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_every_supervised_reply_follows_the_ids_its_target_answered_after(tmp_path, thinking_target, tiny_target_dir):
    """Qwen3's template renders a finished turn without the think block its generation prompt opened, so a row made
    from the conversation's rendering would train an earlier reply after a context the target never read (and a
    server never shows). Each supervised reply must follow exactly the ids the server was asked with for it; the
    multi-turn chats keep their last reply (one row, no token more: docs/pipeline.md)."""
    made = regenerate_and_tokenize(tmp_path / "off", thinking_target, OFF)
    asked = set(made.asked)
    assert len(asked) > len(made.sequences), "no multi-turn chat: nothing to tell the two contexts apart"
    for ids, mask in made.sequences:
        runs = supervised_runs(mask)
        assert runs and all(tuple(ids[:start].tolist()) in asked for start, _ in runs), made.rows
    # where the template renders each turn as its generation prompt read it (ChatML), every reply of a multi-turn
    # chat is supervised in its one row
    made = regenerate_and_tokenize(tmp_path / "chatml", tiny_target_dir, None)
    assert max(len(supervised_runs(mask)) for _, mask in made.sequences) == 2
    assert all(tuple(ids[:s].tolist()) in set(made.asked) for ids, m in made.sequences for s, _ in supervised_runs(m))


def test_evaluate_renders_its_prompts_with_the_kwargs(tmp_path, thinking_target):
    m = manifest(tmp_path)
    off, unset = load_chat_tokenizer(thinking_target, OFF), load_chat_tokenizer(thinking_target)
    texts = {
        name: [chat.tokenizer.decode(p.prompt_ids) for p in eval_prompts(m, chat, 4, 1024)[0]]
        for name, chat in (("off", off), ("unset", unset))
    }
    assert texts["off"] and all(t.endswith(CLOSED) and not filled_blocks(t) for t in texts["off"])
    assert not any(t.endswith(CLOSED) for t in texts["unset"])


def test_a_kwarg_the_template_does_not_read_names_the_template_and_what_it_reads(thinking_target, tmp_path):
    with pytest.raises(ParamsError) as error:
        load_chat_tokenizer(thinking_target, {"enable_thinkin": False})
    message = str(error.value)
    assert "\n" not in message
    assert "target.chat_template_kwargs names ['enable_thinkin']" in message
    assert f"{thinking_target / 'chat_template.jinja'} does not read" in message
    # not messages or add_generation_prompt (the renderer's own), nor `thought` (the template sets it)
    assert "(it reads ['enable_thinking'])" in message
    # what the renderer sets itself is no kwarg either
    with pytest.raises(ParamsError, match=r"names \['add_generation_prompt'\]"):
        load_chat_tokenizer(thinking_target, {"add_generation_prompt": True})
    # a template in tokenizer_config.json is named by that file
    legacy = tmp_path / "legacy"
    shutil.copytree(thinking_target, legacy)
    (legacy / "chat_template.jinja").unlink()
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING}))
    assert load_chat_tokenizer(legacy, OFF).template == THINKING
    with pytest.raises(ParamsError, match=re.escape(f"{legacy / 'tokenizer_config.json'} does not read")):
        load_chat_tokenizer(legacy, {"thinking": False})


def test_every_stage_that_renders_refuses_a_bad_kwarg_before_any_work(tmp_path, thinking_target):
    bad = {"enable_thinkin": False}
    m = manifest(tmp_path)
    compute = build(ComputeParams, project_params("compute"), "compute")
    evaluate = build(EvaluateParams, project_params("evaluate"), "evaluate")
    refused = {
        "regenerate": lambda: regenerate_manifest(
            REGENERATE, m, thinking_target, tmp_path / "regenerated", template_kwargs=bad
        ),
        "tokenize": lambda: tokenize_manifest(
            tokenize_params(), m, thinking_target, tmp_path / "tokens", template_kwargs=bad
        ),
        # the drafter, metrics and engine are never looked at: none exists
        "evaluate": lambda: evaluate_drafter(
            EvaluateInputs(evaluate, compute, bad), "none", thinking_target, m, "none", "none", tmp_path / "metrics"
        ),
        "proof": lambda: run_proof(
            build(ProofParams, project_params("proof"), "proof"),
            build(ModelParams, project_params("model"), "model"),
            compute,
            thinking_target,
            tmp_path / "proof.json",
            tmp_path,
            template_kwargs=bad,
        ),
    }
    for stage, call in refused.items():
        with pytest.raises(ParamsError, match=r"target.chat_template_kwargs names \['enable_thinkin'\]"):
            call()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "manifest"], stage
