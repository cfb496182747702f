"""The compile guard: after warmup, nothing compiles again, and nothing runs slow in silence.

Why each check exists (facts measured on torch 2.13, docs/design.md, "Facts the code relies on"):
- Worker threads that each trace flex_attention cold serialise on dynamo's global lock
  and compile one graph each; compiled once in the main thread first, they compile none.
  So once armed, any compile (a new frame, or a recompile on a new shape) is an error:
  dynamo's `fail_on_recompile` stance raises it, and we name the function, shapes and thread.
- `torch.fx._symbolic_trace._is_fx_tracing_flag` is a process global: while one thread
  traces with FX, another thread's compiled call raises "Detected that you are using FX
  to symbolically trace a dynamo-optimized function". We turn it into an error naming
  the cause.
- A frame dynamo failed to compile runs eagerly from then on ("Skipping the function and
  falling back to eager"), and flex_attention called uncompiled materialises the full
  score matrix ("flex_attention called without torch.compile()"): both are ~3x slower
  and silent, so both are errors.
`strict=False` relaxes every check to a logged warning.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from dflashpipe.core.errors import DflashpipeError

log = logging.getLogger("dflashpipe.compile")

EAGER_FLEX_WARNING = "flex_attention called without torch.compile"
FX_RACE_MESSAGE = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
RECOMPILE_MESSAGE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


class CompileGuardError(DflashpipeError):
    """Something compiled, or fell back to eager, after warmup."""


class CompileCounter:
    """Counts dynamo compiles by the thread that ran them (dynamo compiles in the calling thread), and of those
    the recompiles: a frame compiled again because a guard of its earlier graph failed (a new shape, device...)."""

    def __init__(self) -> None:
        self.by_thread: Counter[str] = Counter()
        self.recompiles_by_thread: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        import torch._dynamo

        if not self._installed:
            torch._dynamo.callback_handler.register_start_callback(self._on_start)
            self._installed = True

    def _on_start(self, args: Any) -> None:
        from torch._guards import CompileId

        compile_id = CompileId.from_string(getattr(args, "compile_id", None))
        recompile = bool(compile_id and compile_id.frame_compile_id)  # the frame's first compile is 0
        with self._lock:
            name = threading.current_thread().name
            self.by_thread[name] += 1
            self.recompiles_by_thread[name] += recompile

    def outside_main(self) -> int:
        with self._lock:
            return sum(n for name, n in self.by_thread.items() if name != "MainThread")

    def of_thread(self, name: str) -> dict[str, int]:
        """What the thread `name` compiled so far: the difference of two of these is what it compiled between."""
        with self._lock:
            return {"compiles": self.by_thread[name], "recompiles": self.recompiles_by_thread[name]}


COUNTER = CompileCounter()


def dynamo_counters() -> dict[str, int]:
    """The counters that say how much dynamo compiled and whether it gave up on a frame."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "frames_total": int(counters["frames"]["total"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "compiles_outside_main_thread": COUNTER.outside_main(),
    }


def inductor_cache_counters() -> dict[str, int]:
    """Inductor's FX graph cache this process: a hit is a graph whose kernels were read, not compiled."""
    from torch._dynamo.utils import counters

    return {name: int(counters["inductor"][name]) for name in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


class CompileGuard:
    """Armed in the main thread after warmup; `call` wraps every compiled call in a worker."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.armed = False

    def arm(self) -> None:
        import torch

        counts = dynamo_counters()
        gave_up = counts["frames_total"] - counts["frames_ok"]
        if gave_up:
            self._fail(
                f"dynamo gave up on {gave_up} frame(s) during warmup; they would run eagerly "
                f'("Skipping the function and falling back to eager"). Compile with fullgraph=True '
                f"and fix the graph break it reports"
            )
        if self.strict:
            torch.compiler.set_stance("fail_on_recompile")
            warnings.filterwarnings("error", message=f".*{EAGER_FLEX_WARNING}")
        self.armed = True

    def disarm(self) -> None:
        import torch

        torch.compiler.set_stance("default")
        warnings.filterwarnings("default", message=f".*{EAGER_FLEX_WARNING}")
        self.armed = False

    def _fail(self, message: str) -> None:
        if self.strict:
            raise CompileGuardError(message)
        log.warning("compile guard: %s", message)

    def call(self, name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a compiled function; turn each way of running slow into an error that says why."""
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, UserWarning) as exc:
            text = str(exc)
            where = f"{name} in thread {threading.current_thread().name!r} with inputs {describe(args, kwargs)}"
            if RECOMPILE_MESSAGE in text:
                raise CompileGuardError(
                    f"{where} needed a new compile after warmup ({text.splitlines()[0]}; "
                    f"{_guard_failure(text)}). Warmup must compile exactly the shapes training runs: "
                    f"check model.seq_len / train batch params, then `dvc repro warmup`"
                ) from None
            if FX_RACE_MESSAGE in text:
                raise CompileGuardError(
                    f"{where} failed because another thread is tracing with torch.fx "
                    f"(torch.fx._symbolic_trace._is_fx_tracing_flag is one global for the whole process). "
                    f"Nothing may call torch.fx.symbolic_trace (or a HOP's _set_compilation_env) while "
                    f"workers run compiled code"
                ) from None
            if EAGER_FLEX_WARNING in text:
                raise CompileGuardError(
                    f"{where} called flex_attention without torch.compile: the unfused fallback "
                    f"materialises the full score matrix and runs ~3x slower"
                ) from None
            raise


def describe(args: tuple, kwargs: dict) -> str:
    """Shapes and dtypes of tensor arguments: what decides whether a compiled graph is reused."""
    import torch

    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{x.dtype}{list(x.shape)}@{x.device}"
        return type(x).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _guard_failure(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("- ")]
    return "guard failed: " + "; ".join(lines[:3]) if lines else "a new function"
