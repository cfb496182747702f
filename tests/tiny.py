"""The tiny things the tests build, each defined once: a random-init target, the tiny drafter, and the
manifest and tokenize params of a tiny run.

Plain functions, no pytest: the fixtures in tests/conftest.py call them, and so do the scenario scripts
in tests/scenarios/, which run as processes of their own. torch and transformers are imported where
they are used, so that importing this module (as conftest does) costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dflashpipe.core.params import DataParams, ModelParams, SourceSpec, TokenizeParams, build

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflashpipe.model import DFlashConfig, DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]


def project_params(section: str) -> dict[str, Any]:
    """One section of this project's params.yaml, as YAML gives it."""
    return yaml.safe_load((ROOT / "params.yaml").read_text())[section]


# -- the target: a small random-init Llama --------------------------------------------------------

TARGET_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
}
"""The tiny target that every pipeline test runs (tests/test_target.py asserts its 6 layers). Two heads of 32:
vLLM's CPU attention has kernels for head sizes from 32 up, and the served tests serve this target."""


def target_config(vocab_size: int, **fields: Any) -> LlamaConfig:
    """The tiny target's config: TARGET_SHAPE, any field of which `fields` may change or add to."""
    from transformers import LlamaConfig

    shape = {**TARGET_SHAPE, **fields}
    return LlamaConfig(vocab_size=vocab_size, intermediate_size=2 * shape["hidden_size"], **shape)


def random_target(config: LlamaConfig, seed: int = 0, dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """A model of `config` with seeded random weights, in eval mode (float32 unless `dtype`)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype or torch.float32).eval()


def tokenizer_config(tokenizer, tie_word_embeddings: bool, **fields: Any) -> LlamaConfig:
    """The tiny shape (and `fields`) with a real tokenizer's vocabulary size and special tokens."""
    return target_config(
        len(tokenizer),
        **fields,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def write_target(out: Path, tokenizer_dir: Path) -> Path:
    """The pipeline tests' target as a real HF model directory: the tiny shape with the real tokenizer
    (its vocabulary, special tokens and chat template) and tied embeddings."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    random_target(tokenizer_config(tokenizer, tie_word_embeddings=True)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_talking_target(out: Path, tokenizer_dir: Path, **fields: Any) -> Path:
    """A tiny target whose greedy replies differ by prompt, some ending at a stop token (a frequent reply
    token made one): a model directory with the real tokenizer, for the tests of regeneration. `fields` change
    its config from the tiny shape."""
    from collections import Counter

    import torch
    from transformers import AutoTokenizer

    from dflashpipe.target.adapter import Target
    from dflashpipe.target.batching import greedy_replies
    from dflashpipe.target.chat import load_chat_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = random_target(tokenizer_config(tokenizer, tie_word_embeddings=False, **fields))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # a trained head's scale: at init's 0.02 every reply is "\n\n..."
    chat = load_chat_tokenizer(tokenizer_dir)
    prompts = [
        chat.backend.encode(
            chat.render([{"role": "user", "content": f"Question {i}: the number {i * 7919 % 1000}."}], True),
            add_special_tokens=False,
        ).ids
        for i in range(12)
    ]
    replies = greedy_replies(Target(model), prompts, 6, [tokenizer.eos_token_id])
    common = Counter(r.tokens[3] for r in replies).most_common(1)[0][0]  # ends some replies after 3 tokens
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, common]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


VOCAB, MASK_ID = 97, 96
"""The in-memory target's vocabulary (no tokenizer): its last id serves as the MASK token."""


def tiny_target(
    seed: int = 0,
    dtype: torch.dtype | None = None,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = VOCAB,
) -> LlamaForCausalLM:
    """The in-memory target of the drafter's own tests (test_model, compile_guard): another shape than
    TARGET_SHAPE because those tests rely on it: 8 layers, so that 3 spaced target layers are [1, 3, 5]
    as in the reference; hidden 32 (feature size 64); a vocabulary of VOCAB; 256 positions, rms eps 1e-5."""
    import torch

    model = random_target(
        target_config(
            vocab,
            hidden_size=hidden,
            num_hidden_layers=8,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
        ),
        seed,
        dtype,
    )
    with torch.no_grad():
        # A non-trivial final norm, so that copying it (not leaving ones) is what the tests see.
        model.model.norm.weight.uniform_(0.5, 1.5)
        # A trained LM head's scale (init's 0.02 caps every logit near 0.6, so no CE could fall far).
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def tiny_config(target: LlamaForCausalLM, layers: int = 2, block_size: int = 4, n_target: int = 3) -> DFlashConfig:
    """A drafter config for `target`, built by hand (not from ModelParams): the tests choose every shape."""
    from dflashpipe.model import DFlashConfig
    from dflashpipe.model.target_layers import spaced_target_layer_ids

    c = target.config
    return DFlashConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=c.vocab_size,
        num_target_layers=c.num_hidden_layers,
        target_layer_ids=tuple(spaced_target_layer_ids(c.num_hidden_layers, n_target)),
        block_size=block_size,
        mask_token_id=c.vocab_size - 1,
    )


def tiny_drafter(target=None, attention="sdpa", seed=1, **config_kw) -> DFlashDrafter:
    import torch

    from dflashpipe.model import DFlashDrafter, TargetHead

    target = target if target is not None else tiny_target()
    return DFlashDrafter(
        tiny_config(target, **config_kw),
        TargetHead.of(target),
        attention=attention,
        gamma=4.0,
        generator=torch.Generator().manual_seed(seed),
    )


def random_batch(drafter: DFlashDrafter, batch=2, seq_len=32, num_anchors=3, seed=0, dtype=None):
    """Random target features and tokens for `drafter`, the first 4 positions unsupervised, and anchors."""
    import torch

    from dflashpipe.model import sample_anchor_positions

    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, seq_len, drafter.config.feature_size, generator=g, dtype=dtype or torch.float32)
    input_ids = torch.randint(0, drafter.config.vocab_size - 1, (batch, seq_len), generator=g)
    loss_mask = torch.ones(batch, seq_len)
    loss_mask[:, :4] = 0  # a "prompt" that is not supervised
    anchors, valid = sample_anchor_positions(loss_mask, num_anchors, g)
    return features, input_ids, loss_mask, anchors, valid


# -- the drafter's params, the manifest's and tokenize's in a tiny run ---------------------------

TINY_MODEL = {"layers": 1, "block_size": 4, "target_layers": 2, "num_anchors": 4, "seq_len": 64}
"""The tiny drafter's shapes: in every pipeline test's params.yaml (conftest's TINY_PROFILE) and in the
drafters that test_train and test_evaluate build outside DVC. One definition, for test_train loads the
shared run's compile artifact, whose kernels are for exactly these shapes."""


def model_params(**changes: Any) -> dict[str, Any]:
    """params.yaml's model section with the tiny shapes (and `changes`), as YAML would give it."""
    return {**project_params("model"), **TINY_MODEL, **changes}


def tiny_model_params(**changes: Any) -> ModelParams:
    return build(ModelParams, model_params(**changes), "model")


TINY_TOKENIZE = {"max_length": 256, "min_supervised_tokens": 8, "num_proc": 1}
"""Tokenize in a tiny run: short samples, supervised if 2 x the tiny block size, in this process."""


def tokenize_params(**changes: Any) -> TokenizeParams:
    """params.yaml's tokenize section in a tiny run (and `changes`)."""
    return build(TokenizeParams, {**project_params("tokenize"), **TINY_TOKENIZE, **changes}, "tokenize")


def source(
    kind: str, *, name: str | None = None, weight: float = 1.0, eval: int = 0, path: str | None = None
) -> SourceSpec:
    """One source of a manifest, named after its kind unless `name`."""
    return SourceSpec(name=name or kind, kind=kind, weight=weight, eval=eval, path=path)


def manifest_params(num_samples: int, shard_size: int, *sources: SourceSpec, on_bad_record: str = "skip") -> DataParams:
    """A manifest's params: `num_samples` in shards of `shard_size`, from `sources` (default: chitchat alone)."""
    return DataParams(
        num_samples=num_samples,
        shard_size=shard_size,
        on_bad_record=on_bad_record,
        sources=sources or (source("chitchat"),),
    )
