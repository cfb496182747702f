"""The stand-ins a rehearsal runs on: a small target of the profile's architecture, and text for sources it lacks.

The target keeps what decides the pipeline's shapes and code paths: the architecture (model_type, so the same
transformers class), the number of layers (so the drafter reads the same target layer ids: [1, 9, 17, 25, 33]
of Qwen3-8B's 36), an untied head where the published one is untied, the rope and norm settings. It shrinks
what only sets the cost: the hidden size, the heads, the MLP. Its weights are random and seeded, so its
replies are noise of the full length: every stage runs at its full sequence shapes.

Its tokenizer is the shipped SmolLM2's (ChatML, as Qwen3's is), with a chat template of Qwen3's form that reads
`enable_thinking`, so a profile's template arguments are exercised where Qwen3's would be: the real tokenizer
is not on the machine when a rehearsal runs (no hub), and its 152K vocabulary would only cost time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
"""ChatML with Qwen3's switch: `enable_thinking=False` closes an empty think block after the generation prompt
(the model answers without reasoning); left unset, the reply may open one itself."""

SCALED_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
"""What shrinks: the widths. Two heads of 32, because vLLM's CPU attention has kernels for head sizes from 32
up and the served check serves this target."""


SPARE_ROWS_MULTIPLE = 128
"""The embedding table is the tokenizer's length rounded up past it to this multiple."""


def standin_config(published: dict[str, Any], tokenizer: Any, max_length: int) -> dict[str, Any]:
    """The published config.json's keys with the widths scaled down and the stand-in tokenizer's vocabulary."""
    return {
        **published,
        **SCALED_SHAPE,
        # spare embedding rows past the tokenizer, as Qwen3's 151,936 past its 151,669: a mask token can be added
        "vocab_size": -(-(len(tokenizer) + 1) // SPARE_ROWS_MULTIPLE) * SPARE_ROWS_MULTIPLE,
        "max_position_embeddings": max(int(published.get("max_position_embeddings", 0)), max_length),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def write_standin_target(
    published: dict[str, Any], tokenizer_source: str, out: Path, dtype: str, max_length: int, root: Path
) -> dict[str, Any]:
    """A Hugging Face directory at `out`: the scaled config with seeded random weights in `dtype`, and the
    tokenizer of `tokenizer_source` (a target.source, e.g. the shipped SmolLM2) with THINKING_TEMPLATE."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflashpipe.target.materialise import resolve_source

    src = resolve_source(tokenizer_source, root)
    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(src.directory, local_files_only=True, **kwargs)
    tokenizer.chat_template = THINKING_TEMPLATE
    values = standin_config(published, tokenizer, max_length)
    config = AutoConfig.for_model(**values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return values


def write_standin_source(out: Path, samples: int, skip: int = 0) -> int:
    """`samples` conversations of the shipped ShareGPT text (after the first `skip`, so that two sources hold
    different ones) as OpenAI-style jsonl at `out`, for a user source the rehearsal does not have; the count."""
    from dflashpipe.data.sources import read_sharegpt

    out.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for record in read_sharegpt():
        if record.conversation and any(turn["role"] == "assistant" for turn in record.conversation):
            if skip:
                skip -= 1
                continue
            lines.append(json.dumps({"messages": record.conversation}, ensure_ascii=False))
        if len(lines) == samples:
            break
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)
