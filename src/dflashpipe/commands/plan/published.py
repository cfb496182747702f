"""Published facts a plan is calibrated and checked against, each with its source: targets' configs (so a model
need not be downloaded to be planned for) and SpecForge's measured disaggregated DFlash training run.

Facts, not code: the numbers are the publications' own; what is derived from them (an MFU in this project's FLOP
convention) is derived in dflashpipe.commands.plan.calibration, in the open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TARGET_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3-8b": (
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
        },
        "Qwen/Qwen3-8B config.json, https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
    ),
}
"""Shipped target configs by name (`dflashpipe plan --target-config qwen3-8b`): the architecture keys of the
published config.json, which is all a plan reads of a target."""


@dataclass(frozen=True)
class PublishedRun:
    """A measured drafter-training run on real GPUs, as its authors published it."""

    source: str
    device: str
    """The GPU it ran on (a row of dflashpipe.core.devices)."""
    target: str
    """Its target's config (a key of TARGET_CONFIGS)."""
    drafter_layers: int
    block_size: int
    num_anchors: int
    tokens_per_sample: int
    """The samples' mean length: what the capture server prefilled per sample."""
    capture_tokens_per_s: float
    """What one capture (target) GPU supplied, in prefill tokens/s, while the run was supply-bound."""
    trainer_samples_per_s: float
    """What one trainer (drafter) GPU consumed inside the running pipeline."""
    trainer_mfu_alone: float
    """The trainer's MFU measured on one GPU alone, no data path (the authors' own FLOP count)."""
    splits: dict[tuple[int, int], float]
    """(capture GPUs, trainer GPUs) -> samples/s of the whole run."""


SPECFORGE_QWEN3_8B = PublishedRun(
    source=(
        "SpecForge examples/disagg/PERF_FINDINGS.md (sgl-project/SpecForge, PR #661: "
        "https://github.com/sgl-project/SpecForge/pull/661), 1x8 H200, samples over >= 390 s"
    ),
    device="H200",
    target="qwen3-8b",
    drafter_layers=5,
    block_size=16,
    num_anchors=256,
    tokens_per_sample=550,
    capture_tokens_per_s=27_000,
    trainer_samples_per_s=7.0,
    trainer_mfu_alone=0.435,
    splits={(1, 7): 50.1, (2, 6): 39.0},
)
"""SpecForge's disaggregated DFlash-family training of a ~1.1B draft for Qwen3-8B on 8 H200s."""
