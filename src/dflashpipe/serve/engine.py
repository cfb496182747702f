"""vLLM's offline engine on the drafter, run in the serving environment's interpreter (`vllm_run.py`), and what it
produced read back: the one way the project talks to that engine in-process (a process a check, `run_engine`, or
one for several, `EngineWorker`).

The request and result travel as JSON files in a scratch directory; vLLM's log goes to a file (there, or the
worker's) and only its tail is shown when the engine fails. A failure vLLM raised is shortened to its last line and
the field of the drafter's config.json it names (a drafter the engine cannot load is a fact about that file)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dflashpipe.core.errors import DflashpipeError

RUNNER = Path(__file__).with_name("vllm_run.py")
TOP_LOGPROBS = 20
"""Logprobs kept per position (vLLM's default cap): a divergence's two tokens are among them unless it is far
beyond any near-tie (lossless.judge then reads the missing one as the row's floor, below every kept value)."""


class EngineError(DflashpipeError):
    """The engine failed: it could not load the target or the drafter, or failed while decoding."""


@dataclass(frozen=True)
class EngineRequest:
    target: Path
    drafter: Path
    dtype: str
    """What the target computes in: evaluate's decode dtype, so both decoders round alike."""
    num_speculative: int
    """K = block_size - 1 (or evaluate.draft_tokens): vLLM never reads the drafter's block_size."""
    prompts: list[list[int]]
    max_new_tokens: int
    stop_token_ids: list[int]

    def to_json(self) -> dict:
        longest = max((len(p) for p in self.prompts), default=0)
        return {
            "target": str(self.target),
            "drafter": str(self.drafter),
            "dtype": self.dtype,
            "num_speculative": self.num_speculative,
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": TOP_LOGPROBS,
            # room for the longest prompt, its reply and one verify block past it
            "max_model_len": longest + self.max_new_tokens + self.num_speculative + 1,
        }


class Engine(Protocol):
    def __call__(self, request: EngineRequest, scratch: Path, config: dict | None = None) -> dict:
        """Serve `request` (files under `scratch`); its result (start seconds, plain and speculative runs).
        `config`: the drafter's config.json, to name the field a loading error is about."""
        ...


def engine_env() -> dict[str, str]:
    """The serving environment's own packages only: nothing of this process's environment on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def write_request(request: EngineRequest, scratch: Path) -> tuple[Path, Path]:
    scratch.mkdir(parents=True, exist_ok=True)
    request_file, result_file = scratch / "request.json", scratch / "result.json"
    request_file.write_text(json.dumps(request.to_json()), encoding="utf-8")
    return request_file, result_file


def read_result(result_file: Path, log_file: Path, exited: str, config: dict | None) -> dict:
    if not result_file.is_file():
        tail = log_file.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
        raise EngineError(f"vLLM {exited} and no result; its log ends:\n  " + "\n  ".join(tail))
    result = json.loads(result_file.read_text(encoding="utf-8"))
    if "error" in result:
        raise EngineError(shortened(result["error"], config or {}))
    return result


def run_engine(python: Path, request: EngineRequest, scratch: Path, config: dict | None = None) -> dict:
    """Run vllm_run.py under `python` on `request`, one process for it (an `Engine` once `python` is bound)."""
    request_file, result_file = write_request(request, scratch)
    log_file = scratch / "vllm.log"
    with open(log_file, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            [str(python), str(RUNNER), str(request_file), str(result_file)], stdout=log, stderr=log, env=engine_env()
        )
    return read_result(result_file, log_file, f"exited with {proc.returncode}", config)


class EngineWorker:
    """One vllm_run.py process that serves request after request (`--loop`): several checks pay vLLM's import
    once and one target's plain run once (the served tests, which serve one target with several drafters)."""

    def __init__(self, python: Path, log: Path):
        self.log = log
        with open(log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen(
                [str(python), str(RUNNER), "--loop"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env=engine_env(),
                text=True,
            )

    def __call__(self, request: EngineRequest, scratch: Path, config: dict | None = None) -> dict:
        request_file, result_file = write_request(request, scratch)
        self.process.stdin.write(f"{request_file}\t{result_file}\n")
        self.process.stdin.flush()
        self.process.stdout.readline()  # the result's path once it is written; "" if the worker died
        return read_result(result_file, self.log, f"worker exited with {self.process.poll()}", config)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def flat_keys(config: dict, prefix: str = "") -> dict[str, object]:
    """config.json's fields as dotted keys (`dflash_config.target_layer_ids`) and their values."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{name}."))
        else:
            out[name] = value
    return out


def shortened(error: dict, config: dict) -> str:
    """vLLM's error in one line: while doing what, its last line, and the config.json field it names (the longest
    of the drafter's fields the message mentions as a word), with that field's value."""
    lines = [line.strip() for line in str(error.get("message", "")).splitlines() if line.strip()]
    last = lines[-1] if lines else error.get("type", "error")
    last = last if len(last) <= 300 else last[:297] + "..."
    text = " ".join(lines)
    named = [key for key in flat_keys(config) if re.search(rf"(?<![\w.]){re.escape(key.split('.')[-1])}(?![\w])", text)]
    field = max(named, key=lambda k: (len(k.split(".")[-1]), len(k)), default=None)
    where = f"; config.json field `{field}` = {json.dumps(flat_keys(config)[field])}" if field else ""
    return f"vLLM failed {error.get('while', 'running')}: {error.get('type', 'Error')}: {last}{where}"
