"""The DFlash drafter: a few non-causal Qwen3 layers that draft a whole block at once.

It owns no embedding and no LM head: block tokens go in through the target's frozen
embedding table and come out through its own final norm (started as the target's, scaled by
model.final_norm_scale: the checkpoint format carries it as `norm.weight`; trained or frozen) and the
target's frozen LM head. What it learns is how to read the target's fused hidden states
(`fc`, `hidden_norm`), which every layer sees as extra keys and values in front of the block.

Two ways in:
  - training: `drafter(features, input_ids, loss_mask, anchors, anchor_valid)` drafts
    A blocks per sequence in one pass (the DFlash mask keeps them apart) and returns
    the decay-weighted loss with per-slot accuracy;
  - speculative decoding: `encode_context` turns verified target features into cached
    keys/values (extend it as tokens are accepted), `draft_logits` drafts one block.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from dflashpipe.core.artifacts import canonical_json, write_bytes_atomic
from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.core.params import ModelParams
from dflashpipe.model.attention import Backend, build_mask, resolve_backend
from dflashpipe.model.config import DFlashConfig
from dflashpipe.model.decoder_layer import DFlashDecoderLayer, RMSNorm, Rotary
from dflashpipe.model.loss import Distill, DraftLoss, block_labels, chunked_decay_weighted_loss
from dflashpipe.model.mask import dflash_mask_mod
from dflashpipe.model.mask_token import resolve_mask_token_id

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PUBLISHED_DTYPE = torch.bfloat16
"""The published drafter's (data/drafter) weights on disk: what DFlash drafters are served in, half of fp32's size."""


@dataclass(frozen=True)
class TargetHead:
    """The target's modules that the drafter borrows. Held by reference, never saved with the drafter."""

    embed_tokens: nn.Embedding
    final_norm: nn.Module
    lm_head: nn.Module

    @classmethod
    def of(cls, target: nn.Module) -> TargetHead:
        """Borrow from a Hugging Face causal LM, freezing what is borrowed (the drafter never trains it)."""
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
        final_norm = getattr(decoder, "norm", None)
        lm_head = target.get_output_embeddings()
        if final_norm is None or lm_head is None:
            raise SourceError(f"{type(target).__name__}: the target needs a final `norm` and an LM head to draft with")
        head = cls(target.get_input_embeddings(), final_norm, lm_head)
        for module in (head.embed_tokens, head.final_norm, head.lm_head):
            module.requires_grad_(False)
        return head

    def on(self, device: torch.device) -> TargetHead:
        """This head on `device`: itself where its weights are, else a copy there (the target stays where it is)."""
        if self.embed_tokens.weight.device == torch.device(device):
            return self
        return TargetHead(*(copy.deepcopy(m).to(device) for m in (self.embed_tokens, self.final_norm, self.lm_head)))


@dataclass(frozen=True)
class StepInputs:
    """One training step's inputs, the arguments of `DFlashDrafter.forward` in its order: what warmup compiles
    (compile/warmup.py `step_inputs`, of the same shapes and dtypes), what train's drafter threads and its
    held-out measurement pass, and what bench times."""

    features: torch.Tensor
    """[B, S, n*H]: the chosen target layers' hidden states, in the drafter's `feature_dtype`."""
    input_ids: torch.Tensor
    """[B, S]."""
    loss_mask: torch.Tensor
    """[B, S]: 1 on supervised tokens."""
    anchors: torch.Tensor
    """[B, A]: each block's anchor position."""
    anchor_valid: torch.Tensor
    """[B, A]: the anchors drawn (the rest pad the row to A)."""
    document_ids: torch.Tensor
    """[B, S]: which packed document each token belongs to."""
    position_ids: torch.Tensor
    """[B, S]: each token's position in its own document."""
    target_hidden: torch.Tensor | None = None
    """When distilling: the target's final hidden states where it predicts each slot [B, A, bs-1, H]."""

    def args(self) -> tuple[torch.Tensor, ...]:
        """The forward's positional arguments: `target_hidden` only when there is one, so a drafter that does
        not distil is compiled for (and called with) exactly the seven tensors."""
        args = (
            self.features,
            self.input_ids,
            self.loss_mask,
            self.anchors,
            self.anchor_valid,
            self.document_ids,
            self.position_ids,
        )
        return args if self.target_hidden is None else (*args, self.target_hidden)

    def to(self, device: torch.device, dtype: torch.dtype) -> StepInputs:
        """On `device`, the floating tensors (features, target_hidden) in `dtype`; a tensor already there is
        kept, not copied."""
        return StepInputs(*(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in self.args()))


@dataclass
class DraftContext:
    """Keys and values of the verified context, per drafter layer: [B, Hkv, C, D] each.

    Context keys depend only on the fused target features (not on the block), so they
    are computed once per verified token and reused by every later block.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class DFlashDrafter(nn.Module):
    def __init__(
        self,
        config: DFlashConfig,
        target: TargetHead,
        *,
        attention: Literal["auto", "flex", "sdpa"] = "auto",
        gamma: float | None = None,
        compile_flex: bool = True,
        generator: torch.Generator | None = None,
        final_norm: Literal["trained", "frozen"] = "frozen",
        final_norm_scale: float = 1.0,
        distill: Distill = "none",
        distill_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.config = config
        self.target = target  # a plain attribute, not a submodule: no weights of the target in our state dict
        self.attention = attention
        self.gamma = gamma
        self.distill, self.distill_weight = distill, distill_weight
        self.compile_flex = compile_flex
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self._init_weights(generator)
        self._copy_final_norm(target.final_norm)
        with torch.no_grad():
            self.norm.weight.mul_(final_norm_scale)
        self.norm.weight.requires_grad_(final_norm == "trained")

    def _init_weights(self, generator: torch.Generator | None) -> None:
        # Qwen3's initialiser (normal, std 0.02; norms at 1), reproducible from the caller's generator.
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, 0.0, 0.02, generator=generator)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def _copy_final_norm(self, final_norm: nn.Module) -> None:
        """Start `norm` as the target's final norm, after checking it is a plain RMSNorm."""
        weight = getattr(final_norm, "weight", None)
        if weight is None or weight.shape != (self.config.hidden_size,):
            raise SourceError(
                f"the target's final norm ({type(final_norm).__name__}) is not an RMSNorm of the hidden size"
            )
        with torch.no_grad():
            self.norm.weight.copy_(weight.to(self.norm.weight.dtype))
            # A Gemma-style (1 + w) norm or a LayerNorm would pass the shape test and still differ.
            probe = torch.randn(4, self.config.hidden_size, generator=torch.Generator().manual_seed(0))
            theirs = final_norm(probe.to(device=weight.device, dtype=weight.dtype)).float().cpu()
            ours = self.norm(probe.to(self.norm.weight)).float().cpu()
            if not torch.allclose(theirs, ours, rtol=1e-2, atol=1e-3):
                raise SourceError(
                    f"the target's final norm ({type(final_norm).__name__}) is not weight * x / rms(x) with "
                    f"eps {self.config.rms_norm_eps}: DFlash drafters cannot reproduce it"
                )

    def copy_target_layers(self, target_model: nn.Module) -> None:
        """Start decoder layer i as the target's decoder layer L - num_layers + i (its top layers).

        Every tensor the two share by name must match in shape (a drafter sized from the target's config
        always does; a Qwen3 target also fills q_norm/k_norm, a Llama one leaves them at 1). The context
        projection (`fc`, `hidden_norm`) has no counterpart and stays as initialised."""
        decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
        theirs = list(decoder.layers)
        n = self.config.num_layers
        if n > len(theirs):
            raise ParamsError(
                f"params.yaml: model.init = target: model.layers = {n} but the target has only {len(theirs)} layers"
            )
        for i, (ours, source) in enumerate(zip(self.layers, theirs[len(theirs) - n :], strict=True)):
            target_index = len(theirs) - n + i
            source_state = source.state_dict()
            extra = sorted(set(source_state) - set(ours.state_dict()))
            if extra:
                raise SourceError(
                    f"target decoder layer {target_index} has {extra}, which a DFlash (Qwen3) layer lacks: "
                    f"set model.init: random"
                )
            with torch.no_grad():
                for name, tensor in ours.state_dict().items():
                    if name not in source_state:
                        continue
                    if source_state[name].shape != tensor.shape:
                        raise SourceError(
                            f"target decoder layer {target_index}: {name} is {list(source_state[name].shape)}, "
                            f"drafter layer {i} needs {list(tensor.shape)}: set model.init: random"
                        )
                    tensor.copy_(source_state[name].to(tensor))

    # -- shared pieces ---------------------------------------------------------------------------

    @property
    def feature_dtype(self) -> torch.dtype:
        """The dtype of the features it reads: what the target it borrows from computes in (compute.target_dtype,
        decided once by `target.dtype.compute_dtype` when the target was loaded), read off the borrowed embedding."""
        return self.target.embed_tokens.weight.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states [B, S, n*H] -> the drafter's context stream [B, S, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The raw table, no embedding scale: what DFlash servers feed the drafter.
        return F.embedding(token_ids, self.target.embed_tokens.weight).to(self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.lm_head
        return head(hidden.to(head.weight.dtype))

    def _block_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[..., bs]: the anchor token, then MASK in every slot still to draft."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.config.block_size), self.config.mask_token_id)
        return torch.cat([anchor_ids[..., None], block[..., 1:]], dim=-1)

    def _run_layers(
        self,
        x: torch.Tensor,
        context: torch.Tensor | DraftContext,
        block_positions: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
        backend: Backend,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rotary(block_positions, x.dtype)
        if isinstance(context, torch.Tensor):
            if context_positions is None:
                context_positions = torch.arange(context.shape[1], device=x.device).expand(context.shape[0], -1)
            ctx_cos, ctx_sin = self.rotary(context_positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if isinstance(context, torch.Tensor):
                ctx_k, ctx_v = layer.self_attn.keys_values(context, ctx_cos, ctx_sin)
            else:
                ctx_k, ctx_v = context.keys[i], context.values[i]
            x = layer(x, ctx_k, ctx_v, cos, sin, mask, backend, self.compile_flex)
        return self.norm(x)

    # -- training ------------------------------------------------------------------------------

    def block_hidden(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, A, bs, H] of the A blocks of each sequence, drafted in one pass.

        A packed row (several documents) gives `document_ids` and in-document `position_ids` [B, S]: a
        block then sees only its own document's context, and every rotary position is in-document."""
        batch, seq_len = input_ids.shape
        num_anchors, bs = anchors.shape[1], self.config.block_size
        if features.shape != (batch, seq_len, self.config.feature_size) or anchors.shape[0] != batch:
            raise ValueError(
                f"features {tuple(features.shape)}, input_ids {tuple(input_ids.shape)}, "
                f"anchors {tuple(anchors.shape)}: "
                f"expected [B, S, {self.config.feature_size}], [B, S], [B, A]"
            )
        x = self.embed(self._block_ids(input_ids.gather(1, anchors)).flatten(1))  # [B, A*bs, H]
        if (document_ids is None) != (position_ids is None):
            raise ValueError("packed rows need both document_ids and position_ids, or neither")
        anchor_positions = anchors if position_ids is None else position_ids.gather(1, anchors)
        block_positions = (anchor_positions[:, :, None] + torch.arange(bs, device=anchors.device)).flatten(1)
        backend = resolve_backend(self.attention, x.device)
        q_len = num_anchors * bs
        mask_mod = dflash_mask_mod(anchors, seq_len, bs, document_ids)
        mask = build_mask(mask_mod, backend, batch, q_len, seq_len + q_len, x.device)
        hidden = self._run_layers(x, self.fuse(features), block_positions, mask, backend, position_ids)
        return hidden.view(batch, num_anchors, bs, -1)

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
    ) -> DraftLoss:
        """Training step's forward: features [B, S, n*H], ids and loss_mask [B, S], anchors and valid [B, A];
        for packed rows, document_ids and position_ids [B, S] (block_hidden); when distilling, the target's
        final (normed) hidden states [B, A, bs-1, H] where it predicts each slot's token
        (target.layers.target_features_and_predictions)."""
        if self.gamma is None:
            raise ValueError("this drafter was built without gamma: pass gamma=params.model.gamma to train it")
        hidden = self.block_hidden(features, input_ids, anchors, document_ids, position_ids)
        # Slot 0 is the given anchor: no loss, so its logits are never computed.
        slots = hidden[:, :, 1:]
        labels, weights = block_labels(
            input_ids, loss_mask, anchors, anchor_valid, self.config.block_size, self.gamma, document_ids
        )
        return chunked_decay_weighted_loss(
            slots, self.target.lm_head, labels, weights, None, target_hidden, self.distill, self.distill_weight
        )

    # -- speculative decoding ------------------------------------------------------------------

    @torch.no_grad()
    def encode_context(self, features: torch.Tensor, past: DraftContext | None = None) -> DraftContext:
        """Append verified target features [B, N, n*H] (positions past.length ..) to the context."""
        start = past.length if past is not None else 0
        context = self.fuse(features)
        positions = torch.arange(start, start + features.shape[1], device=features.device).expand(features.shape[0], -1)
        cos, sin = self.rotary(positions, context.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)
            if past is not None:
                k, v = torch.cat([past.keys[i], k], dim=2), torch.cat([past.values[i], v], dim=2)
            keys.append(k)
            values.append(v)
        return DraftContext(keys, values)

    @torch.no_grad()
    def draft_logits(self, context: DraftContext, anchor_ids: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """Logits [B, slots, V] for the first `slots` tokens after `anchor_ids` [B] (None: all bs-1), which sit at
        position context.length. The layers run the whole block (its slots attend to one another, so a slot's
        proposal is the same however many are asked for); the LM head, the widest product of a draft, runs
        only for the slots asked for."""
        bs = self.config.block_size
        x = self.embed(self._block_ids(anchor_ids))
        positions = (context.length + torch.arange(bs, device=x.device)).expand(x.shape[0], -1)
        # One block sees all the context and all of itself: no mask needed.
        hidden = self._run_layers(x, context, positions, None, resolve_backend(self.attention, x.device))
        return self.logits(hidden[:, 1 : bs if slots is None else 1 + slots])

    # -- checkpoint (the published DFlash format) ------------------------------------------------

    def save_pretrained(self, directory: Path | str, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors, the layout DFlash loaders read (no target weights).

        `dtype`: the weights' dtype on disk (config.json's `dtype`/`torch_dtype` says which), e.g.
        PUBLISHED_DTYPE for a drafter to serve; None keeps the weights exactly as they are (the
        resumable checkpoint, which must give back the very fp32 numbers it saved)."""
        from safetensors.torch import save

        directory = Path(directory)
        dtype = self.fc.weight.dtype if dtype is None else dtype
        tensors = {
            name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
            for name, t in self.state_dict().items()
        }
        write_bytes_atomic(directory / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
        config = self.config.to_checkpoint_dict(str(dtype).removeprefix("torch."))
        write_bytes_atomic(directory / CONFIG_FILE, canonical_json(config))

    @classmethod
    def from_pretrained(
        cls, directory: Path | str, target: TargetHead, *, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> DFlashDrafter:
        """Load a DFlash checkpoint (ours or published) onto the target's borrowed modules.

        `dtype`: what the drafter computes in (bf16 weights load exactly into float32); None: the
        checkpoint's own dtype (config.json's `dtype`, else `torch_dtype`, else float32)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            raw = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
            tensors = load_file(directory / WEIGHTS_FILE)
        except (OSError, ValueError) as exc:
            raise SourceError(f"{directory}: cannot read a DFlash checkpoint: {exc}") from None
        config = DFlashConfig.from_checkpoint_dict(raw, str(directory / CONFIG_FILE))
        if dtype is None:
            saved = raw.get("dtype") or raw.get("torch_dtype") or "float32"
            dtype = getattr(torch, saved, None)
            if not isinstance(dtype, torch.dtype):
                raise SourceError(f"{directory / CONFIG_FILE}: dtype {saved!r} is not a torch dtype")
        drafter = cls(config, target, **kwargs).to(dtype=dtype, device=target.embed_tokens.weight.device)
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise SourceError(f"{directory / WEIGHTS_FILE}: missing weights {missing}, unexpected weights {unexpected}")
        return drafter

    @classmethod
    def for_target(
        cls, target_model: nn.Module, tokenizer: Any, params: ModelParams, generator: torch.Generator | None = None
    ) -> DFlashDrafter:
        """A freshly initialised drafter sized for a Hugging Face target, configured by params.yaml's model."""
        embed = target_model.get_input_embeddings()
        known = len(tokenizer)
        mask_token_id = resolve_mask_token_id(tokenizer, embed.num_embeddings, params.mask_token)
        added = params.mask_token if mask_token_id >= known else None  # a spare row, named by no saved tokenizer
        config = DFlashConfig.for_target(target_model.config, params, mask_token_id, added)
        drafter = cls(
            config,
            TargetHead.of(target_model),
            attention=params.attention,
            gamma=params.gamma,
            generator=generator,
            final_norm=params.final_norm,
            final_norm_scale=params.final_norm_scale,
            distill=params.distill,
            distill_weight=params.distill_weight,
        )
        if params.init == "target":
            drafter.copy_target_layers(target_model)
        return drafter
