"""`dflashpipe plan`: the run on paper, checked against what was measured.

- This CPU: the plan of the embedded default (this repository's params.yaml, dvc.lock and the train metrics they
  recorded) counts train's FLOPs exactly and predicts its tokens/s and FLOP/s within the spread of its steps.
- SpecForge on 8 H200: calibrated on its published pipeline rates, the plan orders its two published splits as
  measured (1 + 7 faster than 2 + 6) and lands within FACTOR of each; the trainer's MFU alone would not.
- The shipped 8-GPU profile is the split the plan balances; the story's 5 + 3 is drafter-bound.
- Bad input: one line naming the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflashpipe.cli import app
from dflashpipe.commands.plan import PlanError, make_plan
from dflashpipe.commands.plan.calibration import SPECFORGE_QWEN3_8B
from dflashpipe.commands.plan.cost import sides, splits
from dflashpipe.core.devices import published

ROOT = Path(__file__).resolve().parents[1]
FACTOR = 1.25
"""How far from a published samples/s the plan may land (stated in docs/plan.md)."""


@pytest.fixture(scope="module")
def specforge():
    return make_plan("profiles/specforge-qwen3-8b.yaml", device="H200", target="qwen3-8b", root=ROOT)


def test_the_embedded_default_predicts_its_measured_train_within_its_spread():
    plan = make_plan(root=ROOT)  # the target's config from data/target, or from the GGUF when there is none
    check = plan.check
    assert check is not None, "the plan of params.yaml is the run dvc.lock's train recorded"
    assert check["flops_per_step"]["predicted"] == check["flops_per_step"]["measured"]
    for key in ("tokens_per_s", "flops_per_s"):
        assert check[key]["within"], (key, check[key])
    assert check["bound_by"]["predicted"] == check["bound_by"]["measured"] == "drafter"
    # every input figure says where it comes from
    for figure in (plan.calibration.target, plan.calibration.drafter, plan.calibration.read):
        assert figure.source.startswith("measured here"), figure
    assert plan.devices.drafter.source.startswith("measured here")


def test_specforge_published_splits_are_ordered_as_measured_and_land_within_the_factor(specforge):
    by_split = {(s.targets, s.drafters): s.rows_per_s for s in specforge.splits}
    assert by_split[(1, 7)] > by_split[(2, 6)]
    for split, published_rate in SPECFORGE_QWEN3_8B.splits.items():
        assert 1 / FACTOR <= by_split[split] / published_rate <= FACTOR, (split, by_split[split], published_rate)
    assert specforge.balanced.targets == 1
    assert "published: SpecForge" in specforge.calibration.drafter.source


def test_the_trainers_mfu_alone_would_order_the_splits_wrongly(specforge):
    # The reason the plan takes the trainer's rate inside the pipeline: at its MFU alone (43.5%), one capture
    # GPU could not feed seven trainers, and two + six would look faster, which SpecForge measured it is not.
    p = specforge
    alone = SPECFORGE_QWEN3_8B.trainer_mfu_alone
    cal = dataclasses.replace(p.calibration, drafter=dataclasses.replace(p.calibration.drafter, value=alone))
    target, drafter = sides(p.run, p.shapes, p.devices, cal)
    by_split = {(s.targets, s.drafters): s.rows_per_s for s in splits(p.run, target, drafter)}
    assert by_split[(2, 6)] > by_split[(1, 7)]


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_the_shipped_8_gpu_profile_is_the_split_the_plan_balances(device):
    story = make_plan("profiles/gpu8-story.yaml", device=device, target="qwen3-8b", root=ROOT)
    shipped = make_plan("profiles/gpu8.yaml", device=device, target="qwen3-8b", root=ROOT)
    assert (len(story.run.topology.target_devices), len(story.run.topology.drafter_devices)) == (5, 3)
    assert story.bound_by == "drafter"
    best = story.balanced
    assert (len(shipped.run.topology.target_devices), len(shipped.run.topology.drafter_devices)) == (
        best.targets,
        best.drafters,
    )
    assert shipped.rows_per_s == pytest.approx(best.rows_per_s)
    assert shipped.rows_per_s > 1.5 * story.rows_per_s
    # the features cross the link at a small share of it; both fit the device, with a larger row too
    assert shipped.transfer.per_device_bytes_per_s < 0.05 * published(device).link_bytes_per_s
    assert shipped.fit.seq_len > shipped.run.model.seq_len


def test_the_largest_fit_is_the_edge_of_what_fits():
    with pytest.raises(PlanError) as raised:
        make_plan("profiles/gpu8.yaml", ["model.seq_len=400000"], device="H100", target="qwen3-8b", root=ROOT)
    message = str(raised.value)
    assert "does not fit cuda:0 (H100" in message and "largest term: target attention mask" in message
    largest = int(message.rsplit("model.seq_len ", 1)[1].split()[0])
    make_plan("profiles/gpu8.yaml", [f"model.seq_len={largest}"], device="H100", target="qwen3-8b", root=ROOT)
    with pytest.raises(PlanError):
        make_plan("profiles/gpu8.yaml", [f"model.seq_len={largest + 1}"], device="H100", target="qwen3-8b", root=ROOT)


def plan_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args])
    return result.exit_code, result.output


def test_bad_input_is_one_line_naming_the_file_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cases = {
        ("profiles/gpu8.yaml", "--device", "MI300X", "--target-config", "qwen3-8b"): [
            "--device MI300X: not in the device table (known: H100-PCIe",
            "add it with --devices FILE",
        ],
        ("profiles/gpu8.yaml", "--device", "H100"): [
            "models/Qwen3-8B/config.json: not found (target.source = 'models/Qwen3-8B')",
            "--target-config",
        ],
        ("profiles/gpu8.yaml", "--device", "RTX-4090", "--target-config", "qwen3-8b"): [
            "does not fit cuda:2 (RTX-4090",
            "largest term: ",
            "the largest setting that fits: none",
        ],
        ("-S", "model.seq_le=3"): ["-S model.seq_le=3: model: unknown key(s) ['seq_le']"],
    }
    no_hidden = tmp_path / "config.json"
    no_hidden.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    cases[("--target-config", str(no_hidden))] = [f"{no_hidden}: key 'hidden_size' is missing"]
    devices = tmp_path / "devices.yaml"
    devices.write_text(yaml.safe_dump({"MI300X": {"bf16_tflops": 1307, "memory_gb": 192}}))
    cases[("profiles/gpu8.yaml", "--device", "MI300X", "--devices", str(devices), "--target-config", "qwen3-8b")] = [
        f"{devices}: MI300X: expected exactly the keys ['bf16_tflops', 'fp32_tflops', 'memory_gb', 'link_gb_s'"
    ]
    for args, needles in cases.items():
        code, output = plan_cli(*args)
        assert code == 2, (args, output)
        assert output.startswith("error: ") and output.count("\n") == 1, (args, output)
        for needle in needles:
            assert needle in output, (args, needle, output)


def test_a_device_of_ones_own_is_planned_with_its_source(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    devices = tmp_path / "devices.yaml"
    row = {"bf16_tflops": 1307, "fp32_tflops": 163, "memory_gb": 192, "link_gb_s": 448, "source": "AMD datasheet"}
    devices.write_text(yaml.safe_dump({"MI300X": row}))
    out = tmp_path / "plan.json"
    code, output = plan_cli(
        "profiles/gpu8.yaml", "--device", "MI300X", "--devices", str(devices), "--target-config", "qwen3-8b",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    assert "MI300X: bf16 1.31PFLOP/s" in output and "[AMD datasheet (" in output
    recorded = json.loads(out.read_text())
    assert recorded["devices"]["drafter"]["bf16_flops"] == 1307e12
    assert recorded["throughput"]["bound_by"] in ("target", "drafter")
    assert recorded["calibration"]["drafter"]["source"].endswith("assumed the same on MI300X")
