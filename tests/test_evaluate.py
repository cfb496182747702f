"""Speculative decoding: lossless on every prompt, equal to the reference, exact tau at both extremes."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dflashpipe.errors import DflashpipeError
from dflashpipe.evaluate import regression
from dflashpipe.evaluate.evaluation import stop_token_ids
from dflashpipe.evaluate.metrics import slot_acceptance
from dflashpipe.evaluate.prompts import eval_prompts
from dflashpipe.evaluate.speculative import DFlashProposer, prefill, speculative_generate, target_generate
from dflashpipe.model import DFlashDrafter, TargetHead, sample_anchor_positions, target_features
from dflashpipe.pipeline import METRICS
from tests.conftest import copy_project, run, set_params
from tests.tiny import manifest_params, source, tiny_model_params

MODEL = tiny_model_params(attention="sdpa")  # sdpa: the backend the reference's drafts are compared on
MAX_NEW = 24


def fit_to_target(drafter: DFlashDrafter, target, sequences: list[list[int]], prompt_lens: list[int]) -> None:
    """A few hundred steps on the target's own greedy continuations, so that drafts are often right
    and the tests below see partial acceptance, not only the bonus token."""
    data = []
    with torch.no_grad():
        for seq, plen in zip(sequences, prompt_lens, strict=True):
            ids = torch.tensor([seq])
            hidden = target(ids, output_hidden_states=True).hidden_states
            mask = torch.zeros_like(ids)
            mask[:, plen:] = 1
            data.append((target_features(hidden, drafter.config.target_layer_ids), ids, mask))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        features, ids, mask = data[step % len(data)]
        anchors, valid = sample_anchor_positions(mask, MODEL.num_anchors, gen)
        drafter(features, ids, mask, anchors, valid).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_target_dir):
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.params import TargetParams
    from dflashpipe.target import load_materialised_target, materialise_target
    from dflashpipe.tokens.chat import load_chat_tokenizer

    work = tmp_path_factory.mktemp("evaluate")
    materialise_target(
        TargetParams(source=tiny_target_dir.name, dtype="float32"), work / "target", root=tiny_target_dir.parent
    )
    build_manifest(
        manifest_params(8, 8, source("chitchat", eval=6), source("humaneval", weight=0.0, eval=3)), work / "manifest"
    )
    target = load_materialised_target(work / "target", "cpu")
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

    def draft(self, anchor: torch.Tensor) -> torch.Tensor:
        pos = self.length
        assert int(anchor) == self.sequence[pos], "the anchor must sit at position = the context length"
        wanted = (self.sequence[pos + 1 : pos + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        return torch.tensor([(t + 1) % self.vocab if self.wrong(k) else t for k, t in enumerate(wanted, start=1)])

    def extend(self, features: torch.Tensor) -> None:
        self.length += features.shape[1]


def test_speculative_output_is_the_target_greedy_output_on_every_prompt(tiny):
    target, stop = tiny["target"], tiny["stop"]
    proposer, accepted = DFlashProposer(tiny["drafter"]), []
    for prompt in tiny["prompts"]:
        start = prefill(target, prompt.prompt_ids)
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
        half_run = speculative_generate(target, half, prefill(target, prompt.prompt_ids), MAX_NEW, stop)
        assert half_run.tokens == greedy.tokens
    assert sum(accepted) > 0, "the fitted drafter should get some drafts accepted"
    print(f"fitted drafter: accepted per step {accepted}")


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
        ours = speculative_generate(target, proposer, prefill(target, prompt.prompt_ids), MAX_NEW, stop)
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

    oracle = speculative_generate(
        target, ScriptedDrafter(prompt + greedy, bs, vocab), prefill(target, prompt), max_new, ()
    )
    assert oracle.tokens == greedy
    # The last block verifies only the tokens left: both proposals accepted, no room for the bonus.
    assert oracle.accepted == [bs - 1] * steps + ([left_over] if left_over else [])
    assert oracle.tau == (steps * bs + left_over) / (steps + bool(left_over))
    assert slot_acceptance([oracle], bs) == {"1": 1.0, "2": 1.0, "3": 1.0}

    wrong = speculative_generate(
        target,
        ScriptedDrafter(prompt + greedy, bs, vocab, wrong=lambda slot: True),
        prefill(target, prompt),
        max_new,
        (),
    )
    assert wrong.tokens == greedy
    assert wrong.tau == 1.0 and set(wrong.accepted) == {0} and len(wrong.produced) == max_new - 1
    assert slot_acceptance([wrong], bs) == {"1": 0.0, "2": 0.0, "3": 0.0}


def test_the_timed_train_step_loads_warmups_artifact_only_under_warmups_key(tiny, tmp_path, monkeypatch):
    import dflashpipe.compile.warmup
    from dflashpipe.compile.artifact import BUILT_FOR, built_for
    from dflashpipe.evaluate.evaluation import measure_train_step
    from dflashpipe.params import CompileParams
    from dflashpipe.pipeline import StageKey
    from tests.test_compile import stand_in_artifact

    # What is under test is which kernels the step is pointed at, not compiling them (minutes on a CPU).
    monkeypatch.setattr(dflashpipe.compile.warmup, "compiled_step", lambda drafter: drafter)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the step points inductor at its scratch
        monkeypatch.setenv(name, "")
    built = StageKey("warmup", {"dep:src/dflashpipe/model/layers.py": "1", "param:params.yaml:model.seq_len": "64"})
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(built)})
    compile = CompileParams(enabled=True, micro_batch=1, guard="error")

    def source(key):
        step = measure_train_step(
            tiny["work"] / "drafter", tiny["target"], MODEL, compile, artifact, tmp_path / "scratch", key
        )
        return step["compile_source"]

    assert source(built) == "artifact"
    edited = StageKey("warmup", {**built.inputs, "dep:src/dflashpipe/model/layers.py": "2"})
    assert source(edited) == (
        f"cold compile: {artifact} was built for other inputs "
        f"(src/dflashpipe/model/layers.py changed): `dvc repro warmup` rebuilds it"
    )
    assert source(None).startswith(f"cold compile: {artifact}: no warmup stage key to check it against")


def test_the_eval_split_is_checked_against_the_manifests_listing_alone(tiny, tmp_path):
    import shutil

    from dflashpipe.errors import SourceError
    from dflashpipe.evaluate.prompts import read_eval_split

    manifest = tmp_path / "manifest"
    shutil.copytree(tiny["work"] / "manifest", manifest)
    shard = next(p for p in manifest.rglob("*.parquet") if p.name != "eval.parquet")
    shard.write_bytes(b"a damaged training shard")  # not evaluate's input: no reason to refuse
    assert read_eval_split(manifest)
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
    assert (tmp_path / "small/eval.parquet").read_bytes() == (tmp_path / "big/eval.parquet").read_bytes()


def test_the_regression_check_reads_the_baseline_through_git(tmp_path):
    assert regression.read_baseline("HEAD", tmp_path)[2].endswith("is not a git repository")
    run(["git", "init", "-q"], tmp_path)
    assert regression.read_baseline("HEAD", tmp_path) == (None, None, "no baseline: the repository has no commit yet")
    (tmp_path / "README").write_text("x")
    run(["git", "add", "-A"], tmp_path)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "one"], tmp_path)
    assert "has no metrics/eval.json" in regression.read_baseline("HEAD", tmp_path)[2]
    old = {
        "tau": 2.0,
        "speedup": 1.5,
        "decode_tokens_per_s": {"speculative": 100.0},
        "train": {"tokens_per_s": 50.0},
        "train_step": {"tokens_per_s": 1000.0},
    }
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/eval.json").write_text(json.dumps(old))
    run(["git", "add", "-A"], tmp_path)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "two"], tmp_path)
    (tmp_path / "metrics/eval.json").write_text("{}")  # the workspace's copy is not what is read
    baseline, commit, _ = regression.read_baseline("HEAD", tmp_path)
    assert baseline == old and len(commit) == 40
    with pytest.raises(DflashpipeError, match="evaluate.baseline = 'no-such-rev'.*neither a git revision"):
        regression.read_baseline("no-such-rev", tmp_path)

    new = {**old, "tau": 1.9, "decode_tokens_per_s": {"speculative": 70.0}}
    report = regression.compare(new, baseline, "HEAD", commit, "", max_regression=0.2)
    assert report["metrics"]["decode_tokens_per_s"] == {"old": 100.0, "new": 70.0, "change": -0.3}
    assert report["metrics"]["tau"]["change"] == -0.05
    assert report["regressions"] == report["throughput_regressions"] == ["decode_tokens_per_s"]
    assert "THROUGHPUT REGRESSION: decode_tokens_per_s 100 -> 70 (-30.0%)" in regression.regression_lines(report)[0]
    regression.check(report, fail=False)
    with pytest.raises(regression.RegressionError, match="decode_tokens_per_s fell more than evaluate.max_regression"):
        regression.check(report, fail=True)


def test_dvc_repro_evaluate_writes_metrics_that_dvc_shows(pipeline_run, tmp_path):
    out = (pipeline_run.parent / "repro.log").read_text()
    assert "Running stage 'evaluate'" in out and "baseline: no baseline" in out
    dvc_project = copy_project(pipeline_run, tmp_path / "project")  # its run is committed as HEAD
    metrics = json.loads((dvc_project / METRICS / "eval.json").read_text())
    assert metrics["lossless"] is True and metrics["tau"] >= 1.0 and metrics["train"]["tokens_per_s"] > 0
    assert {p["source"] for p in metrics["mismatched_prompts"]} == set()
    # the isolated train step ran warmup's kernels, compiled from nothing while it was timed
    step = metrics["train_step"]
    assert step["compiled"] and step["compile_source"] == "artifact" and step["graphs_compiled_while_timed"] == 0
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], dvc_project).stdout)
    assert "tau" in json.dumps(shown) and "metrics/eval.json" in json.dumps(shown)
    for table in ("tau_per_source", "slot_acceptance", "speedup_per_prompt"):
        assert json.loads((dvc_project / METRICS / "eval" / f"{table}.json").read_text())

    set_params(dvc_project, evaluate__max_new_tokens=10)
    again = run(["dvc", "repro", "evaluate"], dvc_project).stdout
    assert "Stage 'train' didn't change, skipping" in again and "Running stage 'evaluate'" in again
    report = json.loads((dvc_project / METRICS / "eval_regression.json").read_text())
    assert report["baseline"] == "HEAD" and len(report["commit"]) == 40
    assert set(report["metrics"]) == set(regression.HEADLINE) and report["metrics"]["tau"]["old"] == metrics["tau"]
