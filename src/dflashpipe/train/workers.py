"""The threads of a training run: what passes between them and the main thread, and how they stop.

- A target worker takes the (step, replica) items assigned to it round-robin (`RunState.target_items`), at
  most `train.prefetch` ahead of the drafters: a slot per item, freed when the drafter receives it.
- A drafter worker takes its replica's inputs step by step (`RunState.drafter_items`) and hands the main thread
  its result; it then waits until the main thread has ended that step, so its next forward reads the new weights.
- The first failure in any thread, the main one included, is kept and sets the abort event: every waiting thread
  then stops (`Aborted`), and once all have ended the main thread raises that failure (`RunState.threads`).

What each thread computes, and the loop the main thread holds, are train/loop.py's `Trainer`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dflashpipe.compile.guard import CompileGuard
from dflashpipe.features.packing import Batch
from dflashpipe.model import DraftLoss, StepInputs

POLL_S = 0.05
T = TypeVar("T")


@dataclass(frozen=True)
class TargetFeatures:
    """What a target worker hands one drafter replica for one step."""

    batch: Batch
    inputs: StepInputs
    """The step's inputs; its features (and target_hidden) already on the replica's device and dtype."""
    release: Callable[[], None]
    """Frees the target worker's prefetch slot: the drafter calls it on receipt."""


@dataclass(frozen=True)
class StepResult:
    """What a drafter replica hands the main thread for a step, once its backward is done (its gradients stay
    on the replica)."""

    loss_terms: DraftLoss
    truncated: int
    padding_fraction: float
    """Of the replica's rows (all replicas' rows are the same size)."""


class Aborted(Exception):
    """Another thread failed; this one stops quietly and the first error is reported."""


def _wait(cond: threading.Condition, ready: Callable[[], bool], abort: threading.Event) -> None:
    """Wait on `cond` (held) until `ready()`; an abort wakes every waiter (Aborted)."""
    while not ready():
        if abort.is_set():
            raise Aborted()
        cond.wait(POLL_S)


class Mailbox(Generic[T]):
    """Items from one thread to another, by step. `get` waits; an abort wakes every waiter."""

    def __init__(self, abort: threading.Event) -> None:
        self.items: dict[int, T] = {}
        self.cond = threading.Condition()
        self.abort = abort

    def put(self, step: int, item: T) -> None:
        with self.cond:
            self.items[step] = item
            self.cond.notify_all()

    def get(self, step: int) -> T:
        with self.cond:
            _wait(self.cond, lambda: step in self.items, self.abort)
            return self.items.pop(step)


class Stepped:
    """The last step the main thread has finished (optimizer stepped, gradients cleared): a drafter thread
    waits here after each step, so its next forward reads the updated weights."""

    def __init__(self, abort: threading.Event, step: int) -> None:
        self.step = step
        self.cond = threading.Condition()
        self.abort = abort

    def finished(self, step: int) -> None:
        with self.cond:
            self.step = step
            self.cond.notify_all()

    def wait(self, step: int) -> None:
        with self.cond:
            _wait(self.cond, lambda: self.step >= step, self.abort)


@dataclass
class RunState:
    """What the threads of one `Trainer.run` share: steps [first_step, max_steps)."""

    first_step: int
    max_steps: int
    prefetch: int
    """Items a target worker may run ahead of the drafters (train.prefetch)."""
    guard: CompileGuard
    abort: threading.Event
    """Set by the first failure: every waiting thread then stops."""
    mailboxes: list[Mailbox[TargetFeatures]]
    """One per replica: what the target workers hand that replica, by step."""
    results: list[Mailbox[StepResult]]
    """One per replica: what that replica hands the main thread, by step."""
    stepped: Stepped
    """The main thread's progress, which the drafter threads wait on."""
    target_busy_s: list[float]
    """Per target worker, cumulative: its forwards and copies, not its waits."""
    step_began: float
    """perf_counter() when the step now running began (the end of the previous one)."""
    errors: list[BaseException] = field(default_factory=list)
    errors_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(
        cls, first_step: int, max_steps: int, prefetch: int, guard: CompileGuard, targets: int, replicas: int
    ) -> RunState:
        """A run of `targets` target workers and `replicas` drafter replicas, none of them started yet."""
        abort = threading.Event()
        return cls(
            first_step=first_step,
            max_steps=max_steps,
            prefetch=prefetch,
            guard=guard,
            abort=abort,
            mailboxes=[Mailbox(abort) for _ in range(replicas)],
            results=[Mailbox(abort) for _ in range(replicas)],
            stepped=Stepped(abort, first_step - 1),
            target_busy_s=[0.0] * targets,
            step_began=time.perf_counter(),
        )

    def fail(self, exc: BaseException) -> None:
        """Keep the first failure (re-raised by `threads`) and stop every thread."""
        with self.errors_lock:
            self.errors.append(exc)
        self.abort.set()

    def guarded(self, worker: Callable[[], None]) -> None:
        """Run a worker thread's body; the first failure stops every thread and is re-raised by `threads`."""
        try:
            worker()
        except Aborted:
            pass  # another thread failed first, and reports it
        except BaseException as exc:
            self.fail(exc)

    def target_items(self, t: int) -> Iterator[tuple[int, int, Callable[[], None]]]:
        """Target worker t's (step, replica) items, round-robin over the targets, each with the release of its
        prefetch slot (for the drafter to call on receipt): at most `prefetch` ahead of the drafters, so memory
        stays bounded. Ends early on an abort."""
        n_targets, n_replicas = len(self.target_busy_s), len(self.mailboxes)
        slots = threading.Semaphore(self.prefetch)
        for i in range(t, (self.max_steps - self.first_step) * n_replicas, n_targets):
            step, r = divmod(i, n_replicas)
            while not slots.acquire(timeout=POLL_S):
                if self.abort.is_set():
                    return
            yield step + self.first_step, r, slots.release

    def drafter_items(self, r: int) -> Iterator[tuple[int, TargetFeatures]]:
        """Replica r's inputs, step by step. Once the caller has handed its result for a step (`results`), the
        next item waits until the main thread has ended that step, so the next forward reads the new weights."""
        for step in range(self.first_step, self.max_steps):
            item = self.mailboxes[r].get(step)
            item.release()
            yield step, item
            self.stepped.wait(step)

    @contextmanager
    def threads(self, workers: Mapping[str, Callable[[], None]]) -> Iterator[None]:
        """Start the `workers` (thread name -> body); the block is the main thread's part of the run. The first
        failure anywhere, the block's included, stops every thread; when all have ended, it is raised."""
        threads = [
            threading.Thread(target=self.guarded, args=(body,), name=name, daemon=True)
            for name, body in workers.items()
        ]
        for th in threads:
            th.start()
        try:
            yield
        except Aborted:
            pass  # a worker failed first, and reports it
        except BaseException as exc:
            self.fail(exc)
        finally:
            for th in threads:
                th.join()
        if self.errors:
            raise self.errors[0]
