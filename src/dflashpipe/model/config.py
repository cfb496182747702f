"""The drafter's architecture, and its config.json in the published DFlash checkpoint format.

A DFlash checkpoint's config.json is a Qwen3 config (the drafter's decoder layers are
Qwen3 layers whatever the target's family) plus `num_target_layers` and a
`dflash_config` with the mask token id, the target layer ids and the block size.
Writing exactly that is what lets a drafter trained here be served by DFlash tools.

Readers differ in where they look, so the keys they read are written everywhere one of them
looks (same values): `block_size` and `mask_token_id` also at the top level (the reference
trainers and some engines read `config.block_size`), and the weights' dtype both as
`dtype` (transformers >= 4.56) and as `torch_dtype` (older transformers, which vLLM and SGLang
releases pin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import ModelParams
from dflashpipe.model.target_layers import check_target_layer_ids, spaced_target_layer_ids

ARCHITECTURE = "DFlashDraftModel"
"""The class name that DFlash loaders expect in `architectures`."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DFlashConfig:
    """Everything that fixes the drafter's weights' shapes and meaning (nothing about training)."""

    hidden_size: int
    """Equal to the target's: the drafter reads the target's embeddings and writes into its LM head."""
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    """The target's LM head size (the drafter has no embedding or head of its own)."""
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    mask_token: str | None = None
    """The mask token's string where training added it to the target's tokenizer (a spare embedding row, which
    the target's saved tokenizer does not name); None where the tokenizer has it, and spells it."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id = {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")

    @property
    def feature_size(self) -> int:
        """Width of the fused target features: one hidden state per chosen target layer."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def for_target(
        cls, target_config: Any, params: ModelParams, mask_token_id: int, mask_token: str | None = None
    ) -> DFlashConfig:
        """Size a drafter for a Hugging Face target config: attention and MLP shapes follow the target."""
        text = text_config(target_config)
        num_layers = text.num_hidden_layers
        ids = target_layer_ids_for(target_config, params)
        rope = getattr(text, "rope_parameters", None) or {}
        heads = text.num_attention_heads
        return cls(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=params.layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            max_position_embeddings=text.max_position_embeddings,
            vocab_size=text.vocab_size,
            num_target_layers=num_layers,
            target_layer_ids=tuple(ids),
            block_size=params.block_size,
            mask_token_id=mask_token_id,
            mask_token=mask_token,
        )

    def to_checkpoint_dict(self, dtype: str) -> dict[str, Any]:
        """config.json content: a genuine Qwen3 config dict with the DFlash keys added."""
        from transformers import Qwen3Config

        qwen3 = Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=False,
            tie_word_embeddings=False,
        ).to_dict()
        qwen3.update(
            architectures=[ARCHITECTURE],
            dtype=dtype,
            torch_dtype=dtype,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            num_target_layers=self.num_target_layers,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
                **({"mask_token": self.mask_token} if self.mask_token is not None else {}),
            },
        )
        return qwen3

    @classmethod
    def from_checkpoint_dict(cls, d: dict[str, Any], where: str = "config.json") -> DFlashConfig:
        try:
            dflash = d["dflash_config"]
            if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias", False):
                raise ValueError("only silu MLPs without attention bias are DFlash drafters")
            rope = d.get("rope_parameters") or {}
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only 'default')")
            return cls(
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d["num_key_value_heads"],
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                rms_norm_eps=float(d["rms_norm_eps"]),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                max_position_embeddings=d["max_position_embeddings"],
                vocab_size=d["vocab_size"],
                num_target_layers=d["num_target_layers"],
                target_layer_ids=tuple(dflash["target_layer_ids"]),
                block_size=int(dflash.get("block_size", d.get("block_size", 16))),
                mask_token_id=int(dflash["mask_token_id"] if "mask_token_id" in dflash else d["mask_token_id"]),
                mask_token=dflash.get("mask_token"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{where}: not a DFlash drafter config ({type(exc).__name__}: {exc})") from None


def text_config(target_config: Any) -> Any:
    """The language model's part of a Hugging Face config (a multimodal one nests it)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def target_layer_ids_for(target_config: Any, params: ModelParams) -> list[int]:
    """The target layers whose hidden states feed the drafter: `model.target_layer_ids`, or the even spacing.
    The drafter's config and the offline features (features/shards.py) both take them from here."""
    num_layers = text_config(target_config).num_hidden_layers
    if params.target_layer_ids:
        return check_target_layer_ids(params.target_layer_ids, num_layers)
    return spaced_target_layer_ids(num_layers, params.target_layer_count)
