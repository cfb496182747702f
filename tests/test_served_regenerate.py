"""Regeneration through a real server: vLLM's OpenAI server, started from the serving environment on 127.0.0.1
with an API key, answers the regenerate stage as the target does in process (the same rows, token ids included),
refuses a missing or wrong key in one line naming the variable, and, killed in the middle of the stage, leaves the
shards it finished for the next run to reuse.

The target is tests/tiny.py's talking target (its replies vary with the prompt, and some end at a stop token).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflashpipe.regenerate.endpoint import API_KEY_ENV, Endpoint, EndpointError
from dflashpipe.regenerate.run import regenerate_manifest
from dflashpipe.regenerate.shards import stored_shard
from tests.test_regenerate import REGENERATE, STAGE_KEY
from tests.test_tokenize import chat_jsonl, manifest
from tests.tiny import write_talking_target
from tests.vllm_server import VllmServer

KEY = "sk-served-test-4c1e"
NAME = "tiny"


@pytest.fixture(scope="module")
def talking(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    return write_talking_target(tmp_path_factory.mktemp("talking") / "target", smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def server(vllm_python, talking, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VllmServer(vllm_python, talking, NAME, log, api_key=KEY, in_process_worker=True) as running:
        yield running


def rows(directory: Path) -> list[dict]:
    """Every regenerated row, in shard order: its conversation and its replies' token ids."""
    return [
        {k: row[k] for k in ("id", "conversation", "reply_ids")}
        for path in sorted(directory.glob("train-*.parquet"))
        for row in pq.read_table(path).to_pylist()
    ]


def test_vllms_server_regenerates_the_rows_the_target_writes_in_process(server, talking, tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m = manifest(tmp_path, 30)
    here = regenerate_manifest(REGENERATE, m, talking, tmp_path / "here", STAGE_KEY)
    there = regenerate_manifest(
        dataclasses.replace(REGENERATE, batch_size=7, endpoints=(server.url,)), m, talking, tmp_path / "there"
    )
    # token for token: the replies come back as ids (stop token excluded), so later turns' prompts are the same ids
    assert rows(tmp_path / "here") == rows(tmp_path / "there")
    assert any(len(r["reply_ids"]) > 1 for r in rows(tmp_path / "there"))  # later turns were asked
    assert here.summary["counts"] == there.summary["counts"]  # tokens counted from the ids, not re-encoded text
    served = there.summary["settings"]["generator"]
    assert (served["engine"], served["id"], served["max_model_len"]) == ("endpoint", NAME, 1024)
    assert len(served["canary_sha256"]) == 64 and served["engine_version"]  # vLLM's GET /version
    assert served["canary_sha256"] != hashlib.sha256(b"").hexdigest()  # a reply, not a stop token alone
    assert all(stored_shard(p).record["settings"]["generator"] == served for p in (tmp_path / "there").glob("train-*"))


def test_vllm_refuses_a_missing_or_wrong_key_in_one_line_naming_the_variable(server, monkeypatch):
    for key, said in ((None, f"{API_KEY_ENV} is unset"), ("sk-wrong", f"refused the key in {API_KEY_ENV}")):
        if key is None:
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(API_KEY_ENV, key)
        with pytest.raises(EndpointError) as refused:
            Endpoint(server.url, retries=3, backoff_s=10).served()  # refused: not retried
        message = str(refused.value)
        assert "\n" not in message and said in message and "(HTTP 401)" in message, message
        assert f"set {API_KEY_ENV}" in message and "sk-wrong" not in message


def test_a_server_killed_mid_stage_stops_it_and_the_next_run_reuses_the_finished_shards(
    server, talking, tmp_path, monkeypatch
):
    """Last in this file: it kills the module's server (and starts another on its port)."""
    monkeypatch.setenv(API_KEY_ENV, KEY)
    chat_jsonl(tmp_path / "chats.jsonl", 40)
    m, out = manifest(tmp_path, 40), tmp_path / "there"
    params = dataclasses.replace(REGENERATE, endpoints=(server.url,), batch_size=2)
    endpoint = Endpoint(server.url, retries=2, backoff_s=0.2)

    def kill_after_the_first_shard() -> None:
        while not (out / "train-chats-00000.parquet").exists():
            time.sleep(0.01)
        server.kill()

    killer = threading.Thread(target=kill_after_the_first_shard, daemon=True)
    killer.start()
    with pytest.raises(EndpointError) as stopped:
        regenerate_manifest(params, m, talking, out, STAGE_KEY, [endpoint])
    killer.join(5)
    message = str(stopped.value)
    assert "\n" not in message and f"{server.url}/completions unreachable after 3 attempts" in message, message
    finished = sorted(p.name for p in out.glob("train-*.parquet"))
    assert "train-chats-00000.parquet" in finished and len(finished) < 4  # the shard being answered was not written
    assert not list(out.glob(".*partial*"))

    restarted = dataclasses.replace(server, process=None).start()  # the same server again, on the same port
    try:
        again = regenerate_manifest(params, m, talking, out, STAGE_KEY, [endpoint])
    finally:
        restarted.stop()
    assert again.reused_shards == finished and len(again.regenerated_shards) == 4 - len(finished)
    here = regenerate_manifest(REGENERATE, m, talking, tmp_path / "here", STAGE_KEY)
    assert here.summary["counts"] == again.summary["counts"]
    assert rows(tmp_path / "here") == rows(out)
