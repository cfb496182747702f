"""The one adapter every stage that runs the target goes through: `Target`, loaded from data/target/.

regenerate, features, warmup and train, evaluate all load the target with `Target.load` (bench builds its
synthetic target in `compute_dtype`), so what each of them used to repeat is written once here: the compute
dtype on a device (dflashpipe.target.dtype), the transformers 5.x differences (`cache_keyword`), the end of
turn (`stop_token_ids`), and the passes over a KV cache that decoding needs: a decoder (verify) forward, the
LM head, a decode step. The passes built on it live beside it: continuous batching of greedy replies
(dflashpipe.target.batching, regenerate's) and the hand-written decoder pass that gives the drafter's layers'
hidden states (dflashpipe.target.hidden_states, features' and train's).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from dflashpipe.core.errors import SourceError
from dflashpipe.core.kernels import rows_first
from dflashpipe.target.dtype import compute_dtype
from dflashpipe.target.weights import model_directory


def cache_keyword(module: Any) -> str:
    """The name under which `module.forward` takes its KV cache: transformers 5.24 renamed `past_key_values`
    to `cache` (the old name warns, and goes in 5.40); the earlier 5.x releases know only the old one."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End of turn: the generation config's eos ids and the tokenizer's eos token."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


def load_materialised_target(target_dir: Path | str, device: Any, dtype: torch.dtype):
    """The frozen Hugging Face model of data/target/ (safetensors only, wherever they are), computing in `dtype`."""
    from transformers import AutoModelForCausalLM

    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise SourceError(
            f"{target_dir}: no materialised target: run `dvc repro target` (or `dvc checkout {target_dir}`)"
        )
    model = AutoModelForCausalLM.from_pretrained(model_directory(target_dir), dtype=dtype, use_safetensors=True)
    model = model.to(device)
    return model.eval().requires_grad_(False)


class Target:
    """A frozen Hugging Face causal LM (Llama/Qwen3 shape, transformers 5.x) and the passes the stages run on it.

    `model` stays reachable for what borrows its modules (the drafter's embedding, norm and LM head)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        # looked up once: a decode step is short enough on the CPU for an inspect per call to show
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self._decoder_cache = cache_keyword(self.decoder)

    @classmethod
    def load(cls, target_dir: Path | str, device: Any, target_dtype: str, decoding: bool = False) -> Target:
        """data/target/ on `device`, computing as `compute.target_dtype` = `target_dtype` says there
        (target.dtype.compute_dtype: one dtype per device, for every kind of work). `decoding`:
        it only decodes (regenerate, evaluate), so its linear layers take their fast form for few rows
        (kernels.rows_first); training, warmup and features keep torch's, and so their compiled graphs."""
        model = load_materialised_target(target_dir, device, compute_dtype(device, target_dtype))
        return cls(rows_first(model) if decoding else model)

    @classmethod
    def of(cls, target: Any) -> Target:
        """`target` itself when it is a Target, else the Hugging Face model `target` wrapped."""
        return target if isinstance(target, Target) else cls(target)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in (its weights' dtype)."""
        return next(self.model.parameters()).dtype

    @property
    def config(self) -> Any:
        return self.model.config

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """End of turn, as every stage that decodes reads it (`stop_token_ids`)."""
        return stop_token_ids(self.model, tokenizer)

    def new_cache(self) -> Any:
        """An empty KV cache for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def decoder_forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The decoder (no LM head) over `ids` [1, N] after what `cache` holds, which it extends: its final normed
        hidden states [1, N, H]. A prefill reads the prompt this way, a verify step the anchor and proposals."""
        return self.decoder(ids, **{self._decoder_cache: cache}, use_cache=True).last_hidden_state

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of final normed hidden states."""
        return self.lm_head(normed)

    def decode_step(
        self,
        ids: torch.Tensor,
        cache: Any,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The decoder then the LM head over `ids` after what `cache` holds, which it extends: the logits of the
        last `logits_to_keep` positions (0: all), through the same `head` as a verify step's."""
        normed = self.decoder(
            ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{self._decoder_cache: cache},
            use_cache=True,
        ).last_hidden_state
        return self.head(normed[:, -logits_to_keep:] if logits_to_keep else normed)
