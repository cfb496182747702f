"""One run of the overfit proof: prepare the memorised data, train in segments, decode after each.

Training runs in segments (one per entry of `steps`, each resuming the last one's checkpoint, at a constant
learning rate after warmup), and after each the drafter is decoded: tau and per-slot acceptance on the prompts
it memorised, against supervised tokens seen.

The data must fit one training row (`memorised_lengths`): each step trains one row, so data spread over two rows is
trained on half as often and memorised at half the speed, a slower proof with nothing wrong in the trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.params import (
    CompileParams,
    ComputeParams,
    DataParams,
    ModelParams,
    SourceSpec,
    TokenizeParams,
    TopologyParams,
    TrainParams,
)
from dflashpipe.core.params.sections import ProofParams, RegenerateParams

ALIGNED = "aligned"
MEMORISED = 0.8
"""Of the block size: the tau a drafter that memorised its prompts reaches (a miss costs a whole block)."""
GAP = 0.25
"""Training-block acceptance minus decode tau beyond which trainer and decoder disagree (aligned: ~0)."""


@dataclass(frozen=True)
class ProofRun:
    """What one proof trains and decodes; the drafter is `model` (params.yaml's, with the proof's row length and
    anchors), the target computes as `compute` says."""

    model: ModelParams
    compute: ComputeParams
    samples: int = 4
    """Conversations memorised (chitchat, the manifest's first `samples`)."""
    max_new_tokens: int = 64
    """Longest regenerated reply, and the tokens decoded per prompt: the whole reply is drafted."""
    seq_len: int = 512
    num_anchors: int = 256
    lr: float = 2e-3
    seed: int = 0
    template_kwargs: dict = field(default_factory=dict)
    """target.chat_template_kwargs: the proof renders its chats as the pipeline does."""

    @classmethod
    def of(
        cls, proof: ProofParams, model: ModelParams, compute: ComputeParams, template_kwargs: dict | None = None
    ) -> ProofRun:
        """The run params.yaml's `proof` section describes, on the drafter `model` describes."""
        return cls(
            model=model,
            compute=compute,
            template_kwargs=dict(template_kwargs or {}),
            samples=proof.samples,
            max_new_tokens=proof.max_new_tokens,
            seq_len=proof.seq_len,
            num_anchors=proof.num_anchors,
            lr=proof.lr,
        )

    def model_params(self) -> ModelParams:
        return replace(self.model, seq_len=self.seq_len, num_anchors=self.num_anchors)

    def train_params(self, max_steps: int) -> TrainParams:
        # Constant after warmup (min_lr_ratio 1): a run resumed at every checkpoint is one run.
        return TrainParams(
            max_steps=max_steps,
            lr=self.lr,
            warmup_steps=10,
            min_lr_ratio=1.0,
            weight_decay=0.0,
            grad_clip=1.0,
            seed=self.seed,
            checkpoint_every=max_steps,
            prefetch=2,
            heldout_sequences=0,  # memorisation: every sequence is trained on, and then decoded
        )

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


@dataclass(frozen=True)
class Checkpoint:
    """The drafter after `steps` steps, decoded on the prompts it memorised. The decoding figures are the
    `exact` prompts' (those whose greedy reply is the trained one, token for token); `tau_all` counts all."""

    steps: int
    supervised_tokens: int
    final_loss: float
    train_slot_accuracy: dict[str, float]
    train_acceptance: float
    """Simulated tau on the training blocks over the last tenth of steps (metrics.json acceptance_length)."""
    prompts: int
    exact_prompts: int
    tau_all: float
    tau: float
    tau_over_prompts: dict
    slot_acceptance: dict[str, float]
    lossless: bool
    train_s: float
    decode_s: float
    lengths: list[int] = field(default_factory=list)
    """The memorised sequences' token counts (they fill one training row)."""

    def verdict(self, block_size: int) -> str:
        """`aligned` when decoding drafts what training memorised: tau at least MEMORISED of the block, and no
        more than GAP below the acceptance the trainer measured on its own blocks; else what failed."""
        failed = []
        if self.tau < MEMORISED * block_size:
            failed.append(f"tau {self.tau:.2f} < {MEMORISED} x block {block_size}")
        if self.train_acceptance - self.tau > GAP:
            failed.append(
                f"decode tau {self.tau:.2f} is {self.train_acceptance - self.tau:.2f} below training's "
                f"{self.train_acceptance:.2f}"
            )
        return ALIGNED if not failed else "; ".join(failed)


def prepare(run: ProofRun, target_dir: Path, work: Path) -> None:
    """The manifest, the target's own replies and their tokens under `work`."""
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.regenerate.run import regenerate_manifest
    from dflashpipe.tokens.run import tokenize_manifest

    source = SourceSpec(name="chitchat", kind="chitchat", weight=1.0, eval=0, path=None)
    data = DataParams(num_samples=run.samples, shard_size=run.samples, on_bad_record="skip", sources=(source,))
    build_manifest(data, work / "manifest")
    # a turn is answered only when its prompt and reply fit one training row: what cannot be packed is not memorised.
    # One prompt at a time, as the proof decodes them: in bfloat16 a reply decoded beside others can be another reply.
    regenerate = RegenerateParams(
        enabled=True,
        max_new_tokens=run.max_new_tokens,
        max_prompt_tokens=run.seq_len - run.max_new_tokens,
        batch_size=1,
        devices=("cpu",),
    )
    regenerate_manifest(
        regenerate,
        work / "manifest",
        target_dir,
        work / "regenerated",
        target_dtype=run.compute.target_dtype,
        template_kwargs=run.template_kwargs,
    )
    tokenize = TokenizeParams(
        max_length=2048, truncation="turn", assistant_turns="all", min_supervised_tokens=2, num_proc=1
    )
    tokenize_manifest(tokenize, work / "regenerated", target_dir, work / "tokens", template_kwargs=run.template_kwargs)
    # The replies are the target's in this numerics, so their lengths are too (a bfloat16 target answered a turn
    # that float32's did not): the longest conversation loses its last turns until all of them fit one row.
    while sum(lengths := _token_lengths(work / "tokens")) > run.seq_len:
        tokenize = replace(tokenize, max_length=max(lengths) - 1)
        tokenize_manifest(
            tokenize, work / "regenerated", target_dir, work / "tokens", template_kwargs=run.template_kwargs
        )


def _token_lengths(tokens: Path) -> list[int]:
    from dflashpipe.tokens.shards import load_tokens

    if not json.loads((tokens / "summary.json").read_text()).get("samples_out"):
        return []
    return [int(n) for n in load_tokens(tokens).lengths]


class ProofDataError(DflashpipeError):
    """The proof has no data to judge a trainer by: its target answered none of its conversations, or what it
    answered does not fit one training row."""


def memorised_lengths(run: ProofRun, data: Path) -> list[int]:
    """The memorised sequences' token counts, refused (ProofDataError) when there are none or they do not fit one
    training row: each step trains one row, so data spread over two rows is trained on half as often and memorised
    at half the speed, a slower proof with nothing wrong in the trainer."""
    tokens = data / "tokens"
    if not json.loads((tokens / "summary.json").read_text()).get("samples_out"):
        counts = json.loads((data / "regenerated" / "summary.json").read_text())["counts"]
        why = {k: v for group in ("skipped_turns", "dropped_samples") for k, v in counts[group].items() if v}
        raise ProofDataError(
            f"{data / 'regenerated'}: the target answered none of the proof's {run.samples} conversations "
            f"with a reply to train on ({', '.join(f'{k} {v}' for k, v in why.items()) or 'no replies'})"
        )
    lengths = _token_lengths(tokens)
    if sum(lengths) > run.seq_len:
        raise ProofDataError(
            f"{tokens}: the proof's {len(lengths)} memorised sequences hold {sum(lengths)} tokens "
            f"({', '.join(map(str, lengths))}), more than one training row of seq_len {run.seq_len}: each step would "
            f"train on part of them; raise the proof's seq_len to at least {sum(lengths)} or lower its samples"
        )
    return lengths


def code_key(root: Path, *stages: str) -> dict[str, str]:
    """What dvc.yaml lists for `stages` (their code, params and fingerprint keys), less their data deps: the
    proof makes its own data, which its directory's key covers. A change that would rerun those stages never
    lets the proof reuse what it made before."""
    from dflashpipe.core.pipeline import stage_key, stage_spec

    inputs = {}
    for name in stages:
        data = [dep for dep in stage_spec(name, root).deps if dep.startswith("data/")]
        inputs |= {f"{name}:{k}": v for k, v in stage_key(name, root, without_deps=data).inputs.items()}
    return inputs


def prepared_data(run: ProofRun, target_dir: Path, work: Path, root: Path) -> Path:
    """`work/data-<key>`, prepared unless it already is: the key is what the data depends on (the samples, the
    reply length, the row length that bounds the prompts, the target's dtype and files, and what dvc.yaml lists
    for the stages that make it), so a changed target, setting or stage never finds the old data, nor resumes an
    arm trained on it."""
    from dflashpipe.core.artifacts import canonical_json, file_sha256
    from dflashpipe.target.weights import weights_sha256

    files = {name: file_sha256(target_dir / name) for name in ("config.json", "tokenizer.json")}
    files |= weights_sha256(target_dir)
    stages = code_key(root, "manifest", "regenerate", "tokenize")
    inputs = {
        "samples": run.samples,
        "max_new_tokens": run.max_new_tokens,
        "seq_len": run.seq_len,
        "target_dtype": run.compute.target_dtype,
        "template_kwargs": run.template_kwargs,
        **files,
        **stages,
    }
    data = work / f"data-{hashlib.sha256(canonical_json(inputs)).hexdigest()[:16]}"
    if not (data / "tokens" / "files.json").is_file():
        prepare(run, target_dir, data)
    return data


def train(run: ProofRun, target_dir: Path, tokens_dir: Path, out: Path, steps: int, root: Path) -> dict:
    """Train to `steps` steps with the train stage's own function, resuming `out`'s last checkpoint."""
    from dflashpipe.core.pipeline import StageKey
    from dflashpipe.train.stage import TrainPaths, train_drafter
    from dflashpipe.train.state import TrainInputs

    inputs = TrainInputs(
        model=run.model_params(),
        compile=CompileParams(enabled=False, micro_batch=1, guard="error"),
        topology=TopologyParams(target_devices=("cpu",), drafter_devices=("cpu",), allow_shared_devices=True),
        train=run.train_params(steps),
        compute=run.compute,
    )
    # The run's settings (not its length: each segment resumes the one before it) and what dvc.yaml lists for
    # train (its code, params.yaml's train and model keys, the kernel environment).
    key = StageKey("train", {"proof:run": run.key(), **code_key(root, "train")})
    paths = TrainPaths(tokens_dir, target_dir, out / "compile", out / "drafter", out / "state", out / "metrics")
    return train_drafter(inputs, paths, key, None)


def memorised_replies(data) -> list[tuple[list[int], list[int]]]:
    """Each training row's last reply (its last supervised run, end of turn included) and the ids before it, as the
    row holds them: the proof decodes after exactly the context it trained that reply in, never a rendering of it."""
    out = []
    for i in range(len(data)):
        ids, mask = data.sequence(i)
        supervised = np.flatnonzero(mask)
        if not supervised.size:
            continue
        end = start = int(supervised[-1]) + 1
        while start > 0 and mask[start - 1]:
            start -= 1
        out.append((ids[:start].tolist(), ids[start:end].tolist()))
    return out


def decode(run: ProofRun, target_dir: Path, drafter_dir: Path, tokens_dir: Path) -> dict:
    """The evaluate stage's decoding and metrics on the memorised rows' last replies (memorised_replies), and the
    same figures on the `exact` prompts alone: those whose greedy reply is token for token the trained one."""
    from dflashpipe.core.kernels import rows_first
    from dflashpipe.evaluate.evaluation import decode_prompts
    from dflashpipe.evaluate.metrics import eval_metrics
    from dflashpipe.evaluate.prompts import HELD_OUT, EvalPrompt
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.tokens.shards import load_tokens

    # as evaluate decodes: the dtype it trained in, with the decoding form of the linear layers
    target = Target.load(target_dir, "cpu", run.compute.target_dtype, decoding=True)
    chat = load_chat_tokenizer(target_dir, run.template_kwargs)
    stop = frozenset(target.stop_token_ids(chat.tokenizer))
    head = TargetHead.of(target.model)
    drafter = rows_first(DFlashDrafter.from_pretrained(drafter_dir, head, dtype=target.dtype, attention="sdpa").eval())
    replies = memorised_replies(load_tokens(tokens_dir))
    # eval_metrics' headline figures are the held-out split's: here the memorised prompts stand in that place.
    prompts = [EvalPrompt(f"row-{i}", "proof", context, HELD_OUT) for i, (context, _) in enumerate(replies)]
    results = decode_prompts(target, drafter, prompts, run.max_new_tokens, sorted(stop))
    trained = {p.sample_id: reply for p, (_, reply) in zip(prompts, replies, strict=True)}
    exact = [r for r in results if _is_prefix(r.target.tokens, trained[r.prompt.sample_id], stop)]
    block_size = drafter.config.block_size
    return {"all": eval_metrics(results, block_size)[0], "exact": eval_metrics(exact, block_size)[0]}


def _is_prefix(decoded: list[int], trained: list[int], stop: frozenset[int]) -> bool:
    """The decoded reply (cut at max_new_tokens) is how the trained reply begins; a final stop token matches
    whatever end of turn the template wrote there."""
    if decoded and decoded[-1] in stop:
        decoded = decoded[:-1]
    return bool(decoded) and trained[: len(decoded)] == decoded


def memorise(
    run: ProofRun, target_dir: Path, work: Path, steps: list[int], root: Path, arm: str = ALIGNED
) -> list[Checkpoint]:
    """Train to each of `steps` in turn and decode after each. The data is prepared once per data key
    (prepared_data) and shared by every arm; each arm trains beside it, in `work/data-<key>/<arm>`, a misaligned
    one under its patch (proof.misalign), which breaks training alone: decoding stays the evaluate stage's."""
    from dflashpipe.proof.misalign import trained_misaligned

    data = prepared_data(run, target_dir, work, root)
    lengths = memorised_lengths(run, data)
    out = data / arm
    checkpoints = []
    for count in steps:
        began = time.perf_counter()
        with trained_misaligned(arm) if arm != ALIGNED else contextlib.nullcontext():
            metrics = train(run, target_dir, data / "tokens", out, count, root)
        trained = time.perf_counter()
        decoded = decode(run, target_dir, out / "drafter", data / "tokens")
        checkpoints.append(
            Checkpoint(
                steps=count,
                supervised_tokens=metrics["supervised_tokens"],
                final_loss=metrics["final_loss"],
                train_slot_accuracy=metrics["slot_accuracy"],
                train_acceptance=metrics["acceptance_length"]["last"],
                prompts=decoded["all"]["prompts"],
                exact_prompts=decoded["exact"]["prompts"],
                tau_all=decoded["all"]["tau"],
                tau=decoded["exact"]["tau"],
                tau_over_prompts=decoded["exact"]["tau_over_prompts"],
                slot_acceptance=decoded["exact"]["slot_acceptance"],
                lossless=decoded["all"]["lossless"],
                train_s=round(trained - began, 1),
                decode_s=round(time.perf_counter() - trained, 1),
                lengths=lengths,
            )
        )
        print(f"proof[{arm}]: " + json.dumps(asdict(checkpoints[-1])), flush=True)
    return checkpoints
