"""Memory per device: what each worker placed on it holds, term by term, which term overflows, and the largest
row length and micro-batch that fit.

Weights, gradients and AdamW moments are exact counts. Activations are estimates from the shapes: the tensors a
drafter layer keeps for its backward, one target layer's working set (the target runs without grad), to the
tensor, not to the allocator's byte; a reserve of every device stands for the CUDA context and fragmentation.
Workers on one device add up (the CPU default puts every worker in one memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflashpipe.commands.plan.inputs import Run
from dflashpipe.commands.plan.model import BYTES, Shapes
from dflashpipe.core.devices import Device
from dflashpipe.model.loss import LOGITS_CHUNK_BYTES

RESERVE = 0.10
"""Assumed: the share of a device's memory that training cannot use (CUDA context, allocator fragmentation)."""
FLEX_BLOCK = 128
"""flex_attention's block: its BlockMask holds int32 indices per (query block, key block)."""


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float


@dataclass(frozen=True)
class DeviceMemory:
    """One device of the topology and what the workers on it hold."""

    device: str
    """As the topology names it: cuda:5, cpu."""
    kind: Device
    roles: tuple[str, ...]
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def usable(self) -> float:
        return self.kind.memory_bytes * (1 - RESERVE)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


def target_terms(sh: Shapes, run: Run, seq_len: int, micro_batch: int) -> list[Term]:
    """A target worker: its whole model, and for online features one layer's working set for the rows of an item,
    the tapped layers' states (collected, then concatenated) and the packed rows' explicit attention mask."""
    b = BYTES[sh.target_dtype]
    terms = [Term("target weights", sh.target_params * b)]
    if run.features.mode == "online":
        tokens = micro_batch * seq_len
        width = 2 * sh.hidden + (2 * sh.heads + 2 * sh.kv_heads) * sh.head_dim + 3 * sh.intermediate
        terms += [
            Term("target activations (one layer, no grad)", tokens * width * b),
            Term("tapped hidden states", 2 * tokens * sh.tapped * sh.hidden * b),
            Term("target attention mask (packed rows)", micro_batch * seq_len**2 * b),
        ]
    return terms


def drafter_terms(sh: Shapes, run: Run, seq_len: int, micro_batch: int, borrows_head: bool) -> list[Term]:
    """A drafter replica: fp32 weights, gradients (and the averaged flat bucket), AdamW's two moments, the borrowed
    head unless its device holds the first target, the features in flight, the activations kept for the backward,
    attention and its mask (dense for sdpa; flex's block mask built with H=None), and the loss's logits chunks."""
    a, f = BYTES[sh.drafter_dtype], BYTES[sh.target_dtype]
    p = sh.drafter_params
    queries = run.model.num_anchors * run.model.block_size
    keys = seq_len + queries
    per_query = 4 * sh.hidden + 2 * sh.heads * sh.head_dim + 2 * sh.kv_heads * sh.head_dim + 4 * sh.intermediate
    per_context = (sh.tapped + 2) * sh.hidden + sh.drafter_layers * 2 * sh.kv_heads * sh.head_dim
    activations = micro_batch * (queries * sh.drafter_layers * per_query + seq_len * per_context) * a
    if sh.attention == "sdpa":
        attention = Term(
            "attention weights (sdpa keeps them)", micro_batch * sh.heads * queries * keys * 4 * sh.drafter_layers
        )
        mask = Term("DFlash mask (dense, sdpa)", micro_batch * queries * keys)
    else:
        attention = Term("attention log-sum-exp (flex)", micro_batch * sh.heads * queries * 4 * sh.drafter_layers)
        blocks = math.ceil(queries / FLEX_BLOCK) * math.ceil(keys / FLEX_BLOCK)
        mask = Term("DFlash block mask (flex, H=None)", micro_batch * blocks * 4 * 4)
    slots = micro_batch * run.model.num_anchors * (run.model.block_size - 1)
    chunk = min(LOGITS_CHUNK_BYTES, slots * sh.vocab * 4)
    terms = [
        Term("drafter weights (fp32)", p * 4),
        Term("gradients and their averaged bucket", p * 4 * 2),
        Term("AdamW moments", p * 4 * 2),
        Term("features in flight", (run.train.prefetch + 1) * micro_batch * seq_len * sh.tapped * sh.hidden * f),
        Term("drafter activations", activations),
        attention,
        mask,
        Term("loss logits chunks (compiled: ~4)", 4 * chunk),
    ]
    if borrows_head:
        terms.insert(3, Term("borrowed embedding and LM head", sh.head_params * f))
    return terms


def device_memory(
    sh: Shapes, run: Run, target: Device, drafter: Device, seq_len: int | None = None, micro_batch: int | None = None
) -> list[DeviceMemory]:
    """Every distinct device of the topology, with the terms of the workers placed on it."""
    seq_len = seq_len or run.model.seq_len
    micro_batch = micro_batch or run.compile.micro_batch
    topology = run.topology
    first_target = topology.target_devices[0]
    placed: dict[str, tuple[list[str], list[Term]]] = {}
    for name in topology.target_devices:
        roles, terms = placed.setdefault(name, ([], []))
        roles.append("target")
        terms += target_terms(sh, run, seq_len, micro_batch)
    for name in topology.drafter_devices:
        roles, terms = placed.setdefault(name, ([], []))
        roles.append("drafter")
        terms += drafter_terms(sh, run, seq_len, micro_batch, borrows_head=name != first_target)
    kinds = {name: target for name in topology.target_devices} | {name: drafter for name in topology.drafter_devices}
    return [DeviceMemory(name, kinds[name], tuple(roles), _merged(terms)) for name, (roles, terms) in placed.items()]


def _merged(terms: list[Term]) -> tuple[Term, ...]:
    """Terms of one name added up (two replicas on one CPU hold two sets of weights)."""
    totals: dict[str, float] = {}
    for t in terms:
        totals[t.name] = totals.get(t.name, 0.0) + t.bytes
    return tuple(Term(name, total) for name, total in totals.items())


@dataclass(frozen=True)
class Fit:
    """The largest settings that fit every device, each with the other setting as configured."""

    seq_len: int | None
    """The largest model.seq_len at the configured compile.micro_batch (None: not even the shortest row)."""
    micro_batch: int | None
    """The largest compile.micro_batch at the configured model.seq_len (None: not even one row)."""


def largest_fit(sh: Shapes, run: Run, target: Device, drafter: Device) -> Fit:
    def fits(seq_len: int, micro_batch: int) -> bool:
        return all(d.fits for d in device_memory(sh, run, target, drafter, seq_len, micro_batch))

    shortest = run.model.block_size + 1
    return Fit(
        _largest(lambda s: fits(s, run.compile.micro_batch), shortest, 1_048_576),
        _largest(lambda m: fits(run.model.seq_len, m), 1, 4096),
    )


def _largest(ok, low: int, high: int) -> int | None:
    """The largest n in [low, high] with ok(n), for an ok that holds up to some n and not beyond."""
    if not ok(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if ok(middle) else (low, middle - 1)
    return low
