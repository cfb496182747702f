"""Speculative decoding: lossless on every prompt, equal to the reference, exact tau at both extremes."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.pipeline import METRICS
from dflashpipe.core.spread import Spread
from dflashpipe.evaluate import regression
from dflashpipe.evaluate.evaluation import decode_prompts
from dflashpipe.evaluate.metrics import slot_acceptance
from dflashpipe.evaluate.prompts import eval_prompts
from dflashpipe.evaluate.speculative import STEP_PARTS, DFlashProposer, speculative_generate, target_generate
from dflashpipe.model import DFlashDrafter, TargetHead, sample_anchor_positions, target_features
from dflashpipe.target.adapter import stop_token_ids
from dflashpipe.target.prefill import prefill
from tests.conftest import copy_project, run, set_params
from tests.tiny import manifest_params, source, tiny_model_params

MODEL = tiny_model_params(attention="sdpa")  # sdpa: the backend the reference's drafts are compared on
MAX_NEW = 24


def fit_to_target(
    drafter: DFlashDrafter,
    target,
    sequences: list[list[int]],
    prompt_lens: list[int],
    steps: int = 60,
    lr: float = 3e-3,
) -> None:
    """Steps on the target's own greedy continuations, so that drafts are often right and the tests below see
    partial acceptance, not only the bonus token."""
    data = []
    with torch.no_grad():
        for seq, plen in zip(sequences, prompt_lens, strict=True):
            ids = torch.tensor([seq])
            hidden = target(ids, output_hidden_states=True).hidden_states
            mask = torch.zeros_like(ids)
            mask[:, plen:] = 1
            data.append((target_features(hidden, drafter.config.target_layer_ids), ids, mask))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        features, ids, mask = data[step % len(data)]
        anchors, valid = sample_anchor_positions(mask, MODEL.num_anchors, gen)
        drafter(features, ids, mask, anchors, valid).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_target_dir):
    from dflashpipe.core.params import TargetParams
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.target.adapter import load_materialised_target
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.materialise import materialise_target

    work = tmp_path_factory.mktemp("evaluate")
    materialise_target(
        TargetParams(source=tiny_target_dir.name, dtype="float32"), work / "target", root=tiny_target_dir.parent
    )
    build_manifest(
        manifest_params(8, 8, source("chitchat", eval=6), source("humaneval", weight=0.0, eval=3)), work / "manifest"
    )
    target = load_materialised_target(work / "target", "cpu", torch.float32)
    chat = load_chat_tokenizer(work / "target")
    prompts, _ = eval_prompts(work / "manifest", chat, num_prompts=2, max_prompt_tokens=400)
    assert {p.source for p in prompts} == {"chitchat", "humaneval"} and len(prompts) >= 3
    stop = stop_token_ids(target, chat.tokenizer)
    greedy = [target_generate(target, prefill(target, p.prompt_ids), MAX_NEW, ()).tokens for p in prompts]
    drafter = DFlashDrafter.for_target(target, chat.tokenizer, MODEL, torch.Generator().manual_seed(0))
    fit_to_target(
        drafter,
        target,
        [p.prompt_ids + g for p, g in zip(prompts, greedy, strict=True)],
        [len(p.prompt_ids) for p in prompts],
    )
    # as train publishes it (bf16) and evaluate loads it on the CPU (in the float32 target's dtype)
    drafter.save_pretrained(work / "drafter", dtype=torch.bfloat16)
    drafter = DFlashDrafter.from_pretrained(
        work / "drafter", TargetHead.of(target), dtype=torch.float32, attention="sdpa"
    ).eval()
    return {"work": work, "target": target, "chat": chat, "prompts": prompts, "stop": stop, "drafter": drafter}


class ScriptedDrafter:
    """Proposes from a known continuation: the target's own greedy tokens, corrupted where `wrong(slot)` says."""

    def __init__(self, sequence: list[int], block_size: int, vocab: int, wrong=lambda slot: False) -> None:
        self.sequence, self.block_size, self.vocab, self.wrong = sequence, block_size, vocab, wrong
        self.target_layer_ids = (0,)
        self.length = 0

    def begin(self, features: torch.Tensor) -> None:
        self.length = features.shape[1]

    def draft(self, anchor: torch.Tensor, count: int) -> torch.Tensor:
        pos = self.length
        assert int(anchor) == self.sequence[pos], "the anchor must sit at position = the context length"
        wanted = (self.sequence[pos + 1 : pos + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        proposed = [(t + 1) % self.vocab if self.wrong(k) else t for k, t in enumerate(wanted, start=1)]
        return torch.tensor(proposed[:count])

    def extend(self, features: torch.Tensor) -> None:
        self.length += features.shape[1]


def test_speculative_output_is_the_target_greedy_output_on_every_prompt(tiny):
    target, stop = tiny["target"], tiny["stop"]
    proposer, accepted = DFlashProposer(tiny["drafter"]), []
    for prompt in tiny["prompts"]:
        start = prefill(target, prompt.prompt_ids, proposer.target_layer_ids)
        greedy = target_generate(target, start.fork(), MAX_NEW, stop)
        ids = torch.tensor([prompt.prompt_ids])
        hf = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop[0],
        )
        assert greedy.tokens == hf[0, ids.shape[1] :].tolist()  # our baseline is HF's greedy decoding
        ours = speculative_generate(target, proposer, start, MAX_NEW, stop)
        assert ours.tokens == greedy.tokens, prompt.sample_id
        accepted += ours.accepted
        # A half-right drafter exercises every partial acceptance length.
        sequence = prompt.prompt_ids + target_generate(target, prefill(target, prompt.prompt_ids), MAX_NEW, ()).tokens
        half = ScriptedDrafter(sequence, 4, target.config.vocab_size, wrong=lambda slot: slot == 2)
        half_run = speculative_generate(target, half, prefill(target, prompt.prompt_ids, (0,)), MAX_NEW, stop)
        assert half_run.tokens == greedy.tokens
    assert sum(accepted) > 0, "the fitted drafter should get some drafts accepted"
    print(f"fitted drafter: accepted per step {accepted}")


# the reference package's own target calls pass `past_key_values`, which transformers 5.24 warns about
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_our_tokens_equal_the_reference_dflash_generate(tiny, monkeypatch):
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate

    # return_stats times with torch.cuda.synchronize(), which a CPU-only torch refuses: give the oracle a CPU clock.
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)

    target, stop = tiny["target"], tiny["stop"]
    # the bf16 drafter's weights, computing in float32 like ours and the float32 target
    reference = DFlashDraftModel.from_pretrained(tiny["work"] / "drafter", dtype=torch.float32).eval()
    assert json.loads((tiny["work"] / "drafter" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    proposer = DFlashProposer(tiny["drafter"])
    for prompt in tiny["prompts"]:
        ids = torch.tensor([prompt.prompt_ids])
        theirs = dflash_generate(reference, target, ids, MAX_NEW, stop, temperature=0.0, return_stats=True)
        start = prefill(target, prompt.prompt_ids, proposer.target_layer_ids)
        ours = speculative_generate(target, proposer, start, MAX_NEW, stop)
        assert ours.tokens == theirs.output_ids[0, ids.shape[1] :].tolist(), prompt.sample_id
        # Same drafts too: the committed count of every step agrees, except a last partial block, which the
        # reference drafts shorter (fewer MASK slots) and we draft at full size and cut.
        full = [i for i, size in enumerate(ours.sizes) if size == 4]
        assert [ours.produced[i] for i in full] == [theirs.acceptance_lengths[i] for i in full]
        assert len(ours.produced) == len(theirs.acceptance_lengths)


@pytest.mark.parametrize("left_over", [0, 2])
def test_tau_is_exactly_1_for_a_wrong_drafter_and_the_block_size_for_an_oracle(tiny, left_over):
    target, bs, steps = tiny["target"], 4, 5
    max_new = 1 + steps * bs + left_over  # the prefill's token, then full blocks, then what is left
    prompt = tiny["prompts"][0].prompt_ids
    greedy = target_generate(target, prefill(target, prompt), max_new, ()).tokens
    vocab = target.config.vocab_size

    head_rows = []  # the target's LM head: the block's first position, the rest only if its proposal held
    hook = target.get_output_embeddings().register_forward_hook(
        lambda m, args, out: head_rows.append(out.shape[:-1].numel())
    )
    try:
        oracle = speculative_generate(
            target, ScriptedDrafter(prompt + greedy, bs, vocab), prefill(target, prompt, (0,)), max_new, ()
        )
        oracle_rows, head_rows[:] = list(head_rows), []
        wrong = speculative_generate(
            target,
            ScriptedDrafter(prompt + greedy, bs, vocab, wrong=lambda slot: True),
            prefill(target, prompt, (0,)),
            max_new,
            (),
        )
    finally:
        hook.remove()
    assert oracle_rows[1:] == [n for size in oracle.sizes for n in (1, size - 1)]  # [0]: the prefill's
    assert head_rows[1:] == [1] * len(wrong.sizes)  # every first proposal rejected: one row per step
    assert oracle.tokens == greedy
    # The last block verifies only the tokens left: both proposals accepted, no room for the bonus.
    assert oracle.accepted == [bs - 1] * steps + ([left_over] if left_over else [])
    assert oracle.tau == (steps * bs + left_over) / (steps + bool(left_over))
    assert slot_acceptance([oracle], bs) == {"1": 1.0, "2": 1.0, "3": 1.0}

    assert wrong.tokens == greedy
    assert wrong.tau == 1.0 and set(wrong.accepted) == {0} and len(wrong.produced) == max_new - 1
    assert slot_acceptance([wrong], bs) == {"1": 0.0, "2": 0.0, "3": 0.0}


@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_fewer_draft_tokens_verify_shorter_blocks_and_stay_lossless(tiny, draft_tokens):
    target, bs = tiny["target"], 4
    prompt = tiny["prompts"][0].prompt_ids
    greedy = target_generate(target, prefill(target, prompt), MAX_NEW, ()).tokens
    oracle = ScriptedDrafter(prompt + greedy, bs, target.config.vocab_size)
    run = speculative_generate(target, oracle, prefill(target, prompt, (0,)), MAX_NEW, (), draft_tokens=draft_tokens)
    assert run.tokens == greedy
    assert max(run.sizes) == draft_tokens + 1 and max(run.accepted) == draft_tokens
    assert slot_acceptance([run], draft_tokens + 1) == {str(k): 1.0 for k in range(1, draft_tokens + 1)}
    whole = speculative_generate(target, oracle, prefill(target, prompt, (0,)), MAX_NEW, ())
    assert run.tau < whole.tau  # the oracle's tau is capped at draft_tokens + 1


@pytest.mark.parametrize("draft_tokens", [1, 2, 0])
def test_the_drafter_computes_its_lm_head_only_for_the_slots_it_verifies(tiny, draft_tokens, monkeypatch):
    target, drafter, stop = tiny["target"], tiny["drafter"], tiny["stop"]
    bs = drafter.config.block_size
    heads, logits = [], drafter.logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        heads.append(hidden.shape[1])
        return logits(hidden)

    monkeypatch.setattr(drafter, "logits", counted)
    proposer, layers = DFlashProposer(drafter), drafter.config.target_layer_ids
    for prompt in tiny["prompts"]:
        greedy = target_generate(target, prefill(target, prompt.prompt_ids), MAX_NEW, stop).tokens
        heads.clear()
        run = speculative_generate(
            target, proposer, prefill(target, prompt.prompt_ids, layers), MAX_NEW, stop, draft_tokens=draft_tokens
        )
        assert run.tokens == greedy, prompt.sample_id  # lossless
        # one head per step, over the slots that step verifies: never the whole block when fewer are asked for
        assert heads == [size - 1 for size in run.sizes], (heads, run.sizes)
        assert max(heads) == (draft_tokens or bs - 1)
    # a slot's proposal does not depend on how many are asked for: the block runs whole, only the head is cut
    context = drafter.encode_context(prefill(target, tiny["prompts"][0].prompt_ids, layers).features)
    anchor = torch.tensor([tiny["prompts"][0].prompt_ids[-1]])
    full = drafter.draft_logits(context, anchor)
    for k in range(1, bs):
        part = drafter.draft_logits(context, anchor, k)
        assert torch.equal(part.argmax(-1), full[:, :k].argmax(-1)) and torch.allclose(part, full[:, :k], atol=1e-5)


def test_the_prefill_keeps_the_drafters_layers_as_hidden_states_gives_them_and_nothing_warns(tiny):
    import warnings

    target, prompt = tiny["target"], tiny["prompts"][0].prompt_ids
    last = target.config.num_hidden_layers - 1
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. transformers 5.24's on `past_key_values`
        start = prefill(target, prompt, (0, last))  # the last layer's entry is normed, as Hugging Face gives it
        run = speculative_generate(
            target,
            DFlashProposer(tiny["drafter"]),
            prefill(target, prompt, tiny["drafter"].config.target_layer_ids),
            8,
            (),
            profile=True,
        )
    assert torch.allclose(start.features, target_features(out.hidden_states, (0, last)), atol=1e-5)
    assert int(start.first_token) == int(out.logits[0, -1].argmax())
    assert (
        set(run.profile) == {*STEP_PARTS, "step"} and 0 < sum(run.profile[p] for p in STEP_PARTS) <= run.profile["step"]
    )
    with pytest.raises(ValueError, match="prefill of the drafter's layers"):
        speculative_generate(target, DFlashProposer(tiny["drafter"]), prefill(target, prompt), 8, ())


def test_eval_metrics_split_train_from_held_out_and_profile_the_step():
    from dflashpipe.evaluate.metrics import PromptResult, eval_metrics
    from dflashpipe.evaluate.prompts import HELD_OUT, TRAIN, EvalPrompt
    from dflashpipe.evaluate.speculative import Decoded

    def result(split: str, source: str, accepted: list[int], seconds: float) -> PromptResult:
        tokens = list(range(1 + sum(a + 1 for a in accepted)))
        parts = dict.fromkeys(STEP_PARTS, 0.05 * seconds)
        spec = Decoded(tokens, seconds, 0.0, accepted, [a + 1 for a in accepted], [4] * len(accepted), verified=tokens)
        spec.profile = {**parts, "draft": 0.5 * seconds, "step": seconds}
        plain = Decoded(tokens, 0.5 * (len(tokens) - 1), 0.0, verified=tokens)  # 0.5 s per decode token
        return PromptResult(EvalPrompt(f"{split}-{source}", source, [1], split), plain, spec, torch.float32)

    results = [
        result(HELD_OUT, "a", [0, 0, 1], 3.0),  # tau 4/3
        result(HELD_OUT, "a", [3, 3], 2.0),  # tau 4
        result(HELD_OUT, "b", [0, 2], 2.0),  # tau 2
        result(TRAIN, "a", [3, 1], 2.0),  # tau 3
    ]
    metrics, tables = eval_metrics(results, 4)
    # the held-out prompts alone: the mean of their taus (the paper's count), and pooled over their steps
    assert metrics["prompts"] == 3 and metrics["tau"] == round((4 / 3 + 4 + 2) / 3, 4)
    assert metrics["tau_pooled"] == round(16 / 7, 4)
    assert metrics["tau_over_prompts"] == {
        "median": 2.0,
        "q1": 1.6667,
        "q3": 3.0,
        "min": 1.3333,
        "max": 4.0,
        "prompts": 3,
    }
    assert metrics["per_source"]["b"]["tau_over_prompts"]["prompts"] == 1
    sides = metrics["train_vs_held_out"]
    assert sides["train"]["tau"] == 3.0 and sides["train"]["slot_1_acceptance"] == 1.0
    assert sides["held_out"]["slot_1_acceptance"] == round(4 / 7, 4)
    assert sides["gap"] == {"tau": round(3.0 - metrics["tau"], 4), "slot_1_acceptance": round(1 - 4 / 7, 4)}
    profile = metrics["step_profile"]
    assert profile["prompts"] == 4 and profile["share"]["draft"]["share"] == 0.5
    assert profile["share"]["other"]["share"] == 0.2  # 1 - 0.5 - 6 x 0.05
    # a step of 1 s against 0.5 s per plain decode token on every prompt
    assert profile["step_over_decode_step"] == 2.0 and profile["step_over_decode_step_spread"]["repeats"] == 4
    assert [row["split"] for row in tables["speedup_per_prompt"]] == [HELD_OUT] * 3 + [TRAIN]


def test_the_eval_split_is_checked_against_the_manifests_listing_alone(tiny, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from dflashpipe.core.errors import SourceError
    from dflashpipe.evaluate.prompts import TRAIN, read_eval_split

    manifest = tmp_path / "manifest"
    shutil.copytree(tiny["work"] / "manifest", manifest)
    shard = manifest / "train-chitchat-00000.parquet"
    assert [row["id"] for row in read_eval_split(manifest, TRAIN)] == [
        row["id"] for row in pq.read_table(shard).to_pylist()
    ]
    shard.write_bytes(b"a damaged training shard")  # read for the training-distribution prompts only
    assert read_eval_split(manifest)
    with pytest.raises(SourceError, match=r"train-chitchat-00000.parquet: does not match its sha256"):
        read_eval_split(manifest, TRAIN)
    eval_file = manifest / "eval.parquet"
    # refused by the listing, with the fix, before pyarrow reads it
    eval_file.write_bytes(eval_file.read_bytes()[:-10])
    with pytest.raises(SourceError, match=r"eval.parquet: does not match its sha256 .*`dvc checkout .*manifest`"):
        read_eval_split(manifest)


def test_growing_the_training_set_leaves_the_eval_split_as_it_was(tmp_path):
    from dflashpipe.data.manifest import build_manifest

    sources = (source("chitchat", eval=5), source("humaneval", weight=0.0, eval=3))
    small = build_manifest(manifest_params(20, 10, *sources), tmp_path / "small")
    big = build_manifest(manifest_params(40, 10, *sources), tmp_path / "big")
    assert small["eval"] == big["eval"]  # file name, row count and sha256
    for name in ("eval.parquet", "train-chitchat-00000.parquet"):  # the held-out and the training-distribution prompts
        assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "big" / name).read_bytes()


def commit_all(root, message: str) -> None:
    run(["git", "add", "-A"], root)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", message], root)


def test_the_regression_check_reads_the_baseline_through_git(tmp_path):
    assert regression.read_baseline("HEAD", tmp_path)[2].endswith("is not a git repository")
    run(["git", "init", "-q"], tmp_path)
    assert regression.read_baseline("HEAD", tmp_path) == (None, None, "no baseline: the repository has no commit yet")
    (tmp_path / "README").write_text("x")
    commit_all(tmp_path, "one")
    assert "has no metrics/eval.json" in regression.read_baseline("HEAD", tmp_path)[2]
    # a baseline from before spreads and before the bench stage: the step's figure was in eval.json
    old = {
        "tau": 2.0,
        "speedup": 1.5,
        "decode_tokens_per_s": {"speculative": 100.0},
        "train": {"tokens_per_s": 50.0},
        "train_step": {"tokens_per_s": 1000.0},
    }
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/eval.json").write_text(json.dumps(old))
    commit_all(tmp_path, "two")
    (tmp_path / "metrics/eval.json").write_text("{}")  # the workspace's copy is not what is read
    baseline, commit, note = regression.read_baseline("HEAD", tmp_path)
    # recorded before the detail file: its eval.json holds the detail's figures too, and is read for both
    assert baseline == {regression.EVAL_METRICS: old, regression.EVAL_DETAIL: old} and len(commit) == 40
    assert note == f"metrics/eval.json at HEAD ({commit[:12]})"
    with pytest.raises(DflashpipeError, match="evaluate.baseline = 'no-such-rev'.*neither a git revision"):
        regression.read_baseline("no-such-rev", tmp_path)

    new = {**old, "tau": 1.9, "decode_tokens_per_s": {"speculative": 70.0}}
    del new["train_step"]
    lean = {"tau": new["tau"]}
    current = {
        regression.EVAL_METRICS: lean,
        regression.EVAL_DETAIL: new,
        regression.BENCH_METRICS: {"tokens_per_s": 990.0},
    }
    report = regression.compare(current, baseline, "HEAD", commit, "", max_regression=0.2)
    decode = report["metrics"]["decode_tokens_per_s"]
    assert decode == {
        "old": 100.0,
        "new": 70.0,
        "change": -0.3,
        "verdict": "unmeasured",
        "repeats": {"old": None, "new": None},
        "ranges": {"old": None, "new": None},
    }
    assert report["metrics"]["tau"]["change"] == -0.05
    # the step's figure moved to bench.json; an old baseline's copy in eval.json is still compared
    assert report["metrics"]["train_step_tokens_per_s"]["old"] == 1000.0
    assert report["metrics"]["train_step_tokens_per_s"]["change"] == -0.01
    # no spread on a side: today's threshold rule alone decides, and the line says so
    assert report["regressions"] == report["throughput_regressions"] == ["decode_tokens_per_s"]
    (line,) = regression.regression_lines(report)
    assert "THROUGHPUT REGRESSION: decode_tokens_per_s 100 -> 70 (-30.0%)" in line
    assert "unmeasured (threshold rule only: a side has no spread of 2+ repeats" in line
    regression.check(report, fail=False)
    with pytest.raises(regression.RegressionError, match="decode_tokens_per_s fell more than evaluate.max_regression"):
        regression.check(report, fail=True)


def figures(decode: Spread, train: Spread, step: Spread) -> dict:
    """The metrics files of a run whose throughput figures carry these spreads."""
    return {
        regression.EVAL_METRICS: {"tau": 2.0, "speedup": 1.5},
        regression.EVAL_DETAIL: {
            "decode_tokens_per_s": decode.record("speculative"),
            "train": train.record("tokens_per_s"),
        },
        regression.BENCH_METRICS: step.record("tokens_per_s"),
    }


def test_a_drop_within_the_spread_is_noise_and_beyond_it_a_regression():
    base = figures(Spread.of([90, 100, 110]), Spread.of([45, 50, 55]), Spread.of([900, 1000, 1100, 1050, 950]))
    # decode -30% but the ranges overlap (a busy machine); the step -40% with ranges apart; train -10%, apart
    run_now = figures(Spread.of([60, 70, 95]), Spread.of([40, 44, 44.5]), Spread.of([580, 600, 620, 610, 590]))
    report = regression.compare(run_now, base, "HEAD", "c" * 40, "", max_regression=0.2)
    m = report["metrics"]
    assert m["decode_tokens_per_s"]["verdict"] == "noise" and m["decode_tokens_per_s"]["change"] == -0.3
    assert m["train_step_tokens_per_s"]["verdict"] == "change"
    assert m["train_step_tokens_per_s"]["repeats"] == {"old": 5, "new": 5}
    assert m["train_step_tokens_per_s"]["ranges"] == {"old": [900.0, 1100.0], "new": [580.0, 620.0]}
    # a change, but within max_regression: not a regression
    assert m["train_tokens_per_s"]["verdict"] == "change" and m["train_tokens_per_s"]["change"] == -0.12
    assert report["regressions"] == report["throughput_regressions"] == ["train_step_tokens_per_s"]
    assert report["within_noise"] == ["decode_tokens_per_s"]
    loud, quiet = regression.regression_lines(report)
    assert loud.startswith("!!! THROUGHPUT REGRESSION: train_step_tokens_per_s 1000 -> 600 (-40.0%)")
    assert "ranges 900..1100 (5 repeats) and 580..620 (5 repeats) do not overlap" in loud
    assert quiet.startswith("noise, not a regression: decode_tokens_per_s 100 -> 70 (-30.0%)")
    assert "ranges 90..110 (3 repeats) and 60..95 (3 repeats) overlap" in quiet
    # the same drop measured once on one side: the spreads cannot decide, the threshold does
    single = figures(Spread.of([70]), Spread.of([50]), Spread.of([1000, 1000]))
    report = regression.compare(single, base, "HEAD", "c" * 40, "", max_regression=0.2)
    assert report["metrics"]["decode_tokens_per_s"]["verdict"] == "unmeasured"
    assert report["metrics"]["decode_tokens_per_s"]["repeats"] == {"old": 3, "new": 1}
    assert report["regressions"] == ["decode_tokens_per_s"] and report["within_noise"] == []


def test_a_rate_that_fell_as_much_as_its_control_is_the_machine_not_a_regression():
    from dflashpipe.core.spread import Busy

    def step(samples: list[float], control_ms: float) -> dict:
        busy = Busy(10.0, 10.0, 2, 0.5, (control_ms, control_ms))
        return {regression.BENCH_METRICS: Spread.of(samples).record("tokens_per_s", busy=busy)}

    base = step([900, 1000, 1100, 1050, 950], 5.0)
    # -40% with ranges apart, and the control beside it 1.7x slower: the machine, not a regression
    report = regression.compare(step([580, 600, 620, 610, 590], 8.5), base, "HEAD", "c" * 40, "", 0.2)
    m = report["metrics"]["train_step_tokens_per_s"]
    assert (m["verdict"], m["controls_ms"]) == ("machine", {"old": 5.0, "new": 8.5})
    assert report["regressions"] == [] and report["within_noise"] == ["train_step_tokens_per_s"]
    (line,) = regression.regression_lines(report)
    assert line.startswith("machine, not a regression: train_step_tokens_per_s 1000 -> 600 (-40.0%)")
    assert line.endswith("the control beside them moved as much as that (5 ms -> 8.5 ms)")
    regression.check(report, fail=True)  # the stage does not fail on the machine's move
    # the same drop with a steady control: a regression, and the control is named in the evidence
    report = regression.compare(step([580, 600, 620, 610, 590], 5.1), base, "HEAD", "c" * 40, "", 0.2)
    assert report["throughput_regressions"] == ["train_step_tokens_per_s"]
    assert "the control beside them moved less than that (5 ms -> 5.1 ms)" in regression.regression_lines(report)[0]


def test_decode_rates_are_per_prompt_with_their_spread():
    from dflashpipe.evaluate.metrics import decode_rates
    from dflashpipe.evaluate.speculative import Decoded

    runs = [Decoded(list(range(11)), 2.0, 0.1), Decoded(list(range(5)), 1.0, 0.1), Decoded([7], 0.5, 0.1)]
    rates = decode_rates(runs)  # 10/2 and 4/1 tokens/s; a prompt with no decode token is no sample
    assert (rates.median, rates.low, rates.high, rates.repeats) == (4.5, 4.0, 5.0, 2)


def test_dvc_repro_evaluate_writes_metrics_that_dvc_shows(pipeline_run, tmp_path):
    out = (pipeline_run.parent / "repro.log").read_text()
    assert "Running stage 'evaluate'" in out and "baseline: no baseline" in out
    dvc_project = copy_project(pipeline_run, tmp_path / "project")  # its run is committed as HEAD
    metrics = json.loads((dvc_project / METRICS / "detail" / "eval.json").read_text())
    assert metrics["lossless"] is True and metrics["tau"] >= 1.0 and metrics["train"]["tokens_per_s"] > 0
    contract = metrics["contract"]  # float32: every prompt exact and equal to plain greedy decoding
    assert contract["departures"] == [] and contract["exact"] == contract["equal_to_plain"] == contract["prompts"] > 0
    assert "train_step" not in metrics  # the bench stage times the step now (tests/test_bench.py)
    # judged in the numerics it learnt in, and train's parity held before its first step
    trained = read_record_at(dvc_project / METRICS / "train" / "metrics.json")
    assert metrics["setup"]["numerics"] == "as trained" and trained["target_dtype"] == metrics["setup"]["target_dtype"]
    assert trained["parity"]["passed"] and trained["parity"]["labels_checked"] > 0
    for path in ("target", "speculative"):
        decode = Spread.read(metrics["decode_tokens_per_s"], path)
        assert decode is not None and decode.repeats >= 2, metrics["decode_tokens_per_s"]
    train = Spread.read(metrics["train"], "tokens_per_s")  # the steady steps of train's run
    assert train is not None and train.repeats >= 2
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], dvc_project).stdout)
    assert "tau" in json.dumps(shown) and "metrics/eval.json" in json.dumps(shown)
    for table in ("tau_per_source", "tau_per_benchmark", "slot_acceptance", "speedup_per_prompt"):
        assert json.loads((dvc_project / METRICS / "eval" / f"{table}.json").read_text())

    set_params(dvc_project, evaluate__max_new_tokens=10)
    again = run(["dvc", "repro", "evaluate"], dvc_project).stdout
    assert "Stage 'train' didn't change, skipping" in again and "Running stage 'evaluate'" in again
    report = read_record_at(dvc_project / METRICS / "eval_regression.json")
    assert report["verdict"] in ("passed", "regressed") and report["worst"] in report["metrics"]
    assert report["baseline"] == "HEAD" and len(report["commit"]) == 40
    assert set(report["metrics"]) == set(regression.HEADLINE) and report["metrics"]["tau"]["old"] == metrics["tau"]
    for name in ("decode_tokens_per_s", "train_tokens_per_s", "train_step_tokens_per_s"):
        figure = report["metrics"][name]  # both sides measured with repeats: the spreads (and controls) decide
        assert figure["verdict"] != "unmeasured" and min(figure["repeats"].values()) >= 2, (name, figure)


def test_a_drafter_judged_in_other_numerics_than_it_learnt_in_is_said():
    from dflashpipe.evaluate.evaluation import AS_TRAINED, numerics_note

    assert numerics_note("float32", "float32") == AS_TRAINED
    split = numerics_note("bfloat16", "float32")
    assert split == "trained in bfloat16, judged in float32: not the numerics it learnt in"
    assert numerics_note(None, "float32").startswith("trained in an unrecorded dtype")


def test_a_proposal_accepted_too_many_fails_evaluate_naming_prompt_position_and_tokens(tiny, tmp_path, monkeypatch):
    """The planted bug: the acceptance rule takes one proposal more than the target verified. Every emitted token
    is checked against its own verify forward's argmax, so the stage fails, whatever the numerics."""
    from dflashpipe.core.artifacts import write_file_listing
    from dflashpipe.core.params import ComputeParams, EvaluateParams
    from dflashpipe.evaluate import evaluation, speculative
    from dflashpipe.evaluate.lossless import ContractError

    honest = speculative.accepted_proposals
    monkeypatch.setattr(
        speculative, "accepted_proposals", lambda wanted, verified: min(honest(wanted, verified) + 1, len(wanted))
    )
    (tmp_path / "train.json").write_text(json.dumps({"tokens_per_s": 1.0, "compile": {}}))
    inputs = evaluation.EvaluateInputs(
        evaluate=EvaluateParams(
            num_prompts=1, max_new_tokens=12, max_prompt_tokens=400, baseline="none", max_regression=0.2
        ),
        compute=ComputeParams(target_dtype="float32"),
    )
    work, drafter_dir = tiny["work"], tmp_path / "drafter"
    # an untrained drafter, so that steps reject proposals (the fitted one drafts these prompts whole)
    seed = torch.Generator().manual_seed(1)
    untrained = DFlashDrafter.for_target(tiny["target"], tiny["chat"].tokenizer, MODEL, seed)
    untrained.save_pretrained(drafter_dir, dtype=torch.bfloat16)
    write_file_listing(drafter_dir)  # as train publishes it: evaluate checks the listing first
    with pytest.raises(ContractError) as failed:
        evaluation.evaluate_drafter(
            inputs, drafter_dir, work / "target", work / "manifest", tmp_path / "train.json",
            tmp_path / "bench.json", tmp_path / "metrics", root=tmp_path,
        )  # fmt: skip
    message = str(failed.value)
    assert "not the verify forward's argmax" in message and "left plain greedy decoding at position" in message
    assert "prompt " in message and "instead of" in message and "margin" in message, message
    contract = json.loads((tmp_path / "metrics" / "detail" / "eval.json").read_text())["contract"]
    assert contract["bugs"] == contract["prompts"] and all(d["not_verified_at"] for d in contract["departures"])


def test_bfloat16_decoding_is_exact_and_any_divergence_from_plain_greedy_is_a_near_tie(tiny):
    """The target in bfloat16, as CUDA serves it: the verify forward (a block) and a decode step (one row) round
    differently, so the two outputs may part at a near-tie; every token must still be its verify forward's argmax,
    and every parting must be numerics by the contract's measure."""
    from dflashpipe.evaluate.lossless import NUMERICS
    from dflashpipe.evaluate.metrics import PromptResult, eval_metrics
    from dflashpipe.target.adapter import Target

    target = copy.deepcopy(tiny["target"]).to(torch.bfloat16)  # the fixture's float32 target stays as it is
    drafter = DFlashDrafter.from_pretrained(
        tiny["work"] / "drafter", TargetHead.of(target), dtype=torch.bfloat16, attention="sdpa"
    ).eval()
    # speedup divides by the fastest plain decoding this CPU has, float32 (target.dtype), never by a slower one
    fastest = Target(tiny["target"])
    results = decode_prompts(target, drafter, tiny["prompts"], MAX_NEW, tiny["stop"], fastest=fastest)
    assert all(isinstance(r, PromptResult) and r.dtype == torch.bfloat16 for r in results)
    assert all(r.baseline is r.fastest and r.fastest_dtype == torch.float32 for r in results)
    assert eval_metrics(results, 4)[0]["baseline"] == {"decoding": "plain greedy, one sequence", "dtype": "float32"}
    assert all(not r.violations for r in results)
    departed = [r.divergence for r in results if r.divergence is not None]
    assert all(d.verdict == NUMERICS and d.margin <= d.tolerance for d in departed), departed
    print(f"bfloat16: {len(departed)} of {len(results)} prompts left plain greedy decoding, all at a near-tie")


def test_decoding_shows_its_progress_on_stderr(tiny, capsys):
    results = decode_prompts(tiny["target"], tiny["drafter"], tiny["prompts"], MAX_NEW, tiny["stop"])
    err = capsys.readouterr().err
    assert len(results) == len(tiny["prompts"])
    assert "evaluate: 100%" in err and f"{len(tiny['prompts'])}/{len(tiny['prompts'])}" in err, err
    assert "speculative" in err and "tok/s" in err, err  # the rates so far


def test_a_second_turn_is_asked_after_the_targets_own_reply_and_a_long_turn_is_skipped(tiny, capsys):
    """MT-Bench's way: turn 2 is rendered after the target's own (plain greedy) reply to turn 1, each turn one
    request; a turn over evaluate.max_prompt_tokens is skipped, named on stderr, and takes its later turns with it."""
    from dflashpipe.evaluate.benchmarks import BenchmarkPrompt
    from dflashpipe.evaluate.evaluation import Decoding, decode_benchmarks, request_records
    from dflashpipe.evaluate.prompts import BENCHMARK, render_prompt
    from dflashpipe.target.adapter import Target

    chat, long = tiny["chat"], "word " * 300
    decoding = Decoding(Target.of(tiny["target"]), DFlashProposer(tiny["drafter"]), 12, tiny["stop"])
    items = [
        BenchmarkPrompt("mt", "81", "mt.jsonl:1", ("Say hello.", "Now say it twice.")),
        BenchmarkPrompt("mt", "82", "mt.jsonl:2", (long, "Short.")),
        BenchmarkPrompt("mt", "83", "mt.jsonl:3", ("Hi.", long)),
    ]
    results, skipped = decode_benchmarks(decoding, chat, items, max_prompt_tokens=200)
    assert [(r.prompt.sample_id, r.prompt.turn) for r in results] == [("81", 1), ("81", 2), ("83", 1)]
    assert skipped == {"mt": {"earlier_turn_skipped": 1, "longer_than_max_prompt_tokens": 2}}
    err = capsys.readouterr().err
    assert "mt.jsonl:2 turn 1 (mt)" in err and "and its 1 later turn(s)" in err and "mt.jsonl:3 turn 2 (mt)" in err
    first, second = results[0], results[1]
    reply = chat.tokenizer.decode(first.target.tokens, skip_special_tokens=True)
    user = [{"role": "user", "content": "Say hello."}, {"role": "user", "content": "Now say it twice."}]
    assert first.prompt.prompt_ids == render_prompt(chat, user[:1])
    assert second.prompt.prompt_ids == render_prompt(chat, [user[0], {"role": "assistant", "content": reply}, user[1]])
    assert reply and second.prompt.prompt_ids != render_prompt(
        chat, [user[0], {"role": "assistant", "content": ""}, user[1]]
    )
    records = request_records(results)
    assert [(r.benchmark, r.id, r.turn, r.split) for r in records] == [
        ("mt", "81", 1, BENCHMARK),
        ("mt", "81", 2, BENCHMARK),
        ("mt", "83", 1, BENCHMARK),
    ]
    assert list(records[1].prompt_ids) == second.prompt.prompt_ids


def test_evaluate_writes_the_lean_metrics_the_detail_and_every_request_it_decoded(tiny, tmp_path):
    from dflashpipe.core.artifacts import write_file_listing
    from dflashpipe.core.params import ComputeParams, EvaluateParams
    from dflashpipe.evaluate import evaluation
    from dflashpipe.evaluate.benchmarks import BenchmarkPrompt

    (tmp_path / "train.json").write_text(json.dumps({"tokens_per_s": 1.0, "compile": {}}))
    inputs = evaluation.EvaluateInputs(
        evaluate=EvaluateParams(
            num_prompts=1, max_new_tokens=8, max_prompt_tokens=400, baseline="none", max_regression=0.2
        ),
        compute=ComputeParams(target_dtype="float32"),
        benchmarks=[BenchmarkPrompt("mt", "81", "mt.jsonl:1", ("Say hello.", "Again."))],
        benchmark_skipped={"mt": {"no_prompt_field": 1}},
    )
    work, drafter_dir = tiny["work"], tmp_path / "drafter"
    tiny["drafter"].save_pretrained(drafter_dir, dtype=torch.bfloat16)
    write_file_listing(drafter_dir)
    detail = evaluation.evaluate_drafter(
        inputs, drafter_dir, work / "target", work / "manifest", tmp_path / "train.json",
        tmp_path / "bench.json", tmp_path / "metrics", root=tmp_path, prompts_out=tmp_path / "eval" / "prompts.json",
    )  # fmt: skip
    lean = json.loads((tmp_path / "metrics" / "eval.json").read_text())
    assert set(lean) == {"tau", "tau_pooled", "speedup", "floor_tau", "lossless", "benchmarks"}
    assert set(lean["benchmarks"]) == {"held_out", "mt"} and lean["tau"] == lean["benchmarks"]["held_out"]["tau"]
    assert json.loads((tmp_path / "metrics" / "detail" / "eval.json").read_text()) == json.loads(json.dumps(detail))
    row = detail["benchmarks"]["mt"]
    assert row["requests"] == 2 and row["thinking"] == "template default" and row["max_new_tokens"] == 8
    assert row["skipped"] == {"no_prompt_field": 1} and "tau" in detail["definitions"]
    decoded = json.loads((tmp_path / "eval" / "prompts.json").read_text())["prompts"]
    splits = [(p["split"], p["benchmark"], p["turn"]) for p in decoded]
    held = detail["prompts"]
    assert splits[:held] == [("held_out", "held_out", 1)] * held and splits[-2:] == [
        ("benchmark", "mt", 1),
        ("benchmark", "mt", 2),
    ]
    assert all(p["prompt_ids"] and all(isinstance(t, int) for t in p["prompt_ids"]) for p in decoded)
    assert (tmp_path / "metrics" / "eval" / "tau_per_benchmark.png").is_file()
