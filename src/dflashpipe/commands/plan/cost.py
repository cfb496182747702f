"""What the run costs, from its inputs: its shapes, the memory each device holds, and the time.

Shapes: the run's models as the stages build them, on the meta device (the target from its config, the drafter
sized for it by the class train trains). An 8B target costs no memory here, and the FLOPs of a training row are
counted by train/flops.py, so a plan and a train run's metrics count alike.

Memory: what each worker placed on a device holds, term by term, which term overflows, and the largest row length
and micro-batch that fit. Weights, gradients and AdamW moments are exact counts. Activations are estimates from the
shapes: the tensors a drafter layer keeps for its backward, one target layer's working set (the target runs without
grad), to the tensor, not to the allocator's byte; a reserve of every device stands for the CUDA context and
fragmentation. Workers on one device add up (the CPU default puts every worker in one memory).

Time: the rows each side can handle per second, which side binds, the split of the devices that balances the two,
what moving the features between devices costs the link (or storing them, the disk), and the wall time. The model
is train's pipeline: target workers run ahead of the drafter replicas (train.prefetch), so at steady state a step
takes as long as the slower side and the faster one waits. A side's rate is its workers' peak x a calibrated MFU
(a `Calibration`, which calibration.py measures) / the FLOPs of one row; offline, the target side only reads stored
features, at the disk's rate. The optimizer step and the gradient all-reduce are not counted (SpecForge measured
1.3 ms of a ~240 ms step; on a CPU they are part of what the calibration measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dflashpipe.commands.plan.inputs import DataSize, DeviceChoice, Run
from dflashpipe.core.devices import Device
from dflashpipe.core.params import ComputeParams, ModelParams
from dflashpipe.core.threads import training_budget
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.model.attention import resolve_backend
from dflashpipe.model.config import DFlashConfig, text_config
from dflashpipe.model.loss import LOGITS_CHUNK_BYTES
from dflashpipe.target.dtype import compute_dtype
from dflashpipe.train.flops import side_flops, target_forward_flops

# -- shapes ----------------------------------------------------------------------------------------

BYTES = {"bfloat16": 2, "float32": 4}


class ShapesOnlyDrafter(DFlashDrafter):
    """The drafter's modules with no values: nothing to initialise, and no final norm to check against the
    target's (that check computes on real weights)."""

    def _init_weights(self, generator: torch.Generator | None) -> None:
        pass

    def _copy_final_norm(self, final_norm: torch.nn.Module) -> None:
        pass


@dataclass(frozen=True)
class Models:
    """The target and one drafter replica, shapes only."""

    target: torch.nn.Module
    drafter: DFlashDrafter

    @classmethod
    def build(cls, config: Any, model: ModelParams) -> Models:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            target = AutoModelForCausalLM.from_config(config)
            drafter = ShapesOnlyDrafter(
                DFlashConfig.for_target(config, model, mask_token_id=0),  # its value changes no shape
                TargetHead.of(target),
                attention="sdpa",  # a module choice made per call; the weights are the same
                final_norm=model.final_norm,  # trained or not: one of the drafter's parameters
                distill=model.distill,
            )
        return cls(target, drafter)


@dataclass(frozen=True)
class Shapes:
    """What memory and time are computed from: parameter counts, widths and one training row's FLOPs."""

    target_params: int
    """Every weight of the target: a target worker loads it whole."""
    head_params: int
    """The embedding, final norm and LM head that every drafter device borrows from the target."""
    drafter_params: int
    """The drafter's trained weights (fp32, each with a gradient and two AdamW moments)."""
    target_flops: int
    """One row of `model.seq_len` tokens through the target (train's FLOP convention)."""
    drafter_flops: int
    """One row's drafter forward and backward."""
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tapped: int
    """Target layers whose hidden states feed the drafter."""
    drafter_layers: int
    target_dtype: str
    """What the target computes in on its devices (compute.target_dtype): the features' dtype too."""
    drafter_dtype: str
    """What the drafter's matmuls run in: bf16 autocast on CUDA, float32 on a CPU."""
    attention: str
    """The drafter's attention backend on its devices (model.attention)."""

    @classmethod
    def of(
        cls, models: Models, model: ModelParams, compute: ComputeParams, target_device: str, drafter_device: str
    ) -> Shapes:
        text = text_config(models.target.config)
        config = models.drafter.config
        head = TargetHead.of(models.target)
        borrowed = {id(p): p for m in (head.embed_tokens, head.final_norm, head.lm_head) for p in m.parameters()}
        target_flops, drafter_flops = side_flops(model, models.drafter, models.target)
        drafter_type = torch.device(drafter_device).type
        return cls(
            target_params=sum(p.numel() for p in models.target.parameters()),
            head_params=sum(p.numel() for p in borrowed.values()),  # a tied head is the embedding: once
            drafter_params=sum(p.numel() for p in models.drafter.parameters() if p.requires_grad),
            target_flops=target_flops,
            drafter_flops=drafter_flops,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab=text.vocab_size,
            tapped=len(config.target_layer_ids),
            drafter_layers=config.num_layers,
            target_dtype=planned_target_dtype(target_device, compute.target_dtype),
            drafter_dtype="bfloat16" if drafter_type == "cuda" else "float32",
            attention=resolve_backend(model.attention, torch.device(drafter_device)),
        )


def planned_target_dtype(device: str, choice: str) -> str:
    """The dtype the target will compute its batched work in on a planned device. A plan is made on any machine
    for devices it may not have, so a GPU's is not probed here: every GPU in devices.PUBLISHED computes bfloat16
    (Ampere or later), which is what `auto` resolves to there; a CPU is this machine, resolved as a stage would."""
    if torch.device(device).type == "cuda":
        return "float32" if choice == "float32" else "bfloat16"
    return str(compute_dtype(device, choice)).removeprefix("torch.")


def whole_forward_flops(models: Models, seq_len: int) -> int:
    """One row through every decoder layer of the target (a serving engine's prefill runs them all)."""
    return target_forward_flops(models.target, (text_config(models.target.config).num_hidden_layers - 1,), seq_len)


def feature_bytes_per_token(sh: Shapes, model: ModelParams) -> float:
    """What a target hands a drafter per token of a row (and what the features stage stores): the tapped layers'
    hidden states, and when distilling the target's final hidden state at each drafted slot."""
    per_token = sh.tapped * sh.hidden * BYTES[sh.target_dtype]
    if model.distill != "none":
        per_token += model.num_anchors * (model.block_size - 1) * sh.hidden * BYTES[sh.target_dtype] / model.seq_len
    return per_token


# -- memory ---------------------------------------------------------------------------------------


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


# -- time -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


@dataclass(frozen=True)
class Calibration:
    """What each side runs at (calibration.py finds it: measured here, or published), every figure with its source."""

    target: Figure
    """MFU of the target's forward on the target devices' kind."""
    drafter: Figure
    """MFU of the drafter's forward and backward on the drafter devices' kind."""
    read: Figure
    """Bytes/s at which stored (offline) features are read, per node."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Side:
    name: str
    workers: int
    rows_per_s: float
    """The whole side's rate, if the other side never kept it waiting."""
    per_worker: float | None
    """One worker's rate; None where the workers share one resource (offline: the disk)."""
    how: str


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    rows_per_s: float
    bound_by: str


def worker_peaks(run: Run, sh: Shapes, devices: DeviceChoice) -> dict[str, float]:
    """Each role's peak for one worker: a GPU's own, or its share of this CPU's cores (dflashpipe.core.threads)."""
    budget = training_budget(run.topology.target_devices, run.topology.drafter_devices)
    peaks = {}
    for role, device, dtype in (
        ("target", devices.target, sh.target_dtype),
        ("drafter", devices.drafter, sh.drafter_dtype),
    ):
        share = budget.threads[role] / budget.cores if device.name == "cpu" else 1.0
        peaks[role] = device.peak(dtype) * share
    return peaks


def sides(run: Run, sh: Shapes, devices: DeviceChoice, cal: Calibration) -> tuple[Side, Side]:
    peaks = worker_peaks(run, sh, devices)
    n_t, n_d = len(run.topology.target_devices), len(run.topology.drafter_devices)
    if run.features.mode == "offline":
        bytes_per_row = run.model.seq_len * feature_bytes_per_token(sh, run.model)
        target = Side(
            "target",
            n_t,
            cal.read.value / bytes_per_row,
            None,
            f"reads stored features at {cal.read.value / 1e9:.3g} GB/s, {bytes_per_row / 1e6:.3g} MB a row",
        )
    else:
        each = peaks["target"] * cal.target.value / sh.target_flops
        target = Side(
            "target", n_t, n_t * each, each, _how(n_t, devices.target.name, cal.target.value, sh.target_flops)
        )
    each = peaks["drafter"] * cal.drafter.value / sh.drafter_flops
    drafter = Side(
        "drafter", n_d, n_d * each, each, _how(n_d, devices.drafter.name, cal.drafter.value, sh.drafter_flops)
    )
    return target, drafter


def _how(workers: int, device: str, mfu: float, flops: int) -> str:
    return f"{workers} x {device} at MFU {mfu:.3g}, {flops / 1e12:.3g} TFLOP a row"


def bound(target: Side, drafter: Side) -> str:
    return "target" if target.rows_per_s <= drafter.rows_per_s else "drafter"


def splits(run: Run, target: Side, drafter: Side) -> list[Split]:
    """Every split of the topology's devices between the two sides, when they are distinct GPUs of one kind (on
    a CPU the workers share cores, not devices): what each gives, online per target worker, offline by the disk."""
    topology = run.topology
    names = [*topology.target_devices, *topology.drafter_devices]
    if any(not n.startswith("cuda") for n in names) or len(set(names)) != len(names) or drafter.per_worker is None:
        return []
    result = []
    for k in range(1, len(names)):
        supply = k * target.per_worker if target.per_worker is not None else target.rows_per_s
        demand = (len(names) - k) * drafter.per_worker
        result.append(Split(k, len(names) - k, min(supply, demand), "target" if supply <= demand else "drafter"))
    return result


def balanced(found: list[Split]) -> Split | None:
    """The fastest split (the fewer target devices on a tie)."""
    return max(found, key=lambda s: (s.rows_per_s, -s.targets)) if found else None


@dataclass(frozen=True)
class Transfer:
    """Online: the features' traffic against the link; offline: their disk, and the read rate training needs."""

    bytes_per_token: float
    bytes_per_s: float
    per_device_bytes_per_s: float
    """The busiest device's share: a target device sending, or a drafter device receiving."""
    link_bytes_per_s: float | None
    offline_bytes: float | None


def transfer(run: Run, sh: Shapes, devices: DeviceChoice, tokens_per_s: float, data: DataSize) -> Transfer:
    per_token = feature_bytes_per_token(sh, run.model)
    total = per_token * tokens_per_s
    n_t, n_d = len(run.topology.target_devices), len(run.topology.drafter_devices)
    stored = data.samples * min(data.tokens_per_sample, run.model.seq_len) * per_token
    return Transfer(
        per_token,
        total,
        total / min(n_t, n_d),
        devices.drafter.link_bytes_per_s,
        stored,
    )


@dataclass(frozen=True)
class Wall:
    steps: int
    """train.max_steps, or the steps train.epochs takes at `epoch_rows` a pass (train derives the exact count
    from the tokenized data)."""
    rows: int
    """Rows those steps train (every replica's micro-batch each step)."""
    seconds: float
    epoch_rows: float
    """Rows in one pass over the data, packed (the mean sample, cut to model.seq_len)."""

    @property
    def epochs(self) -> float:
        return self.rows / self.epoch_rows if self.epoch_rows else 0.0


def wall(run: Run, rows_per_s: float, data: DataSize) -> Wall:
    per_step = len(run.topology.drafter_devices) * run.compile.micro_batch
    epoch_rows = data.samples * min(data.tokens_per_sample, run.model.seq_len) / run.model.seq_len
    steps = run.train.max_steps or math.ceil(run.train.epochs * epoch_rows / per_step)
    return Wall(steps, steps * per_step, steps * per_step / rows_per_s, epoch_rows)
