"""Decoding's read of a prompt: the target's cache after it, its first token, and the drafter's features of it.

The one definition of what decoding hands the drafter from the target (evaluate's loop, the served check's
reference, and train's parity check, which compares it with what training hands the drafter)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflashpipe.core.spread import clock
from dflashpipe.target.adapter import Target


@contextmanager
def layer_capture(target, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """{layer id: that decoder layer's output in the latest forward}, filled by forward hooks on the
    chosen layers only, so no other layer's hidden states are kept. Layer i is what Hugging Face returns
    as hidden_states[i + 1] (dflashpipe.model.target_features), which for the last layer is normed: its
    entry is then the decoder's output, which the caller reads from the forward's last_hidden_state."""
    decoder = target.get_decoder()
    captured: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, output) -> None:
            captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    last = len(decoder.layers) - 1
    handles = [decoder.layers[i].register_forward_hook(keep(i)) for i in layer_ids if i != last]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def captured_features(
    captured: dict[int, torch.Tensor], layer_ids: Sequence[int], normed: torch.Tensor, count: int
) -> torch.Tensor:
    """The drafter's features [1, count, n*H] of the forward's first `count` positions; `normed` is its
    last_hidden_state (the last layer's entry, when the drafter reads it)."""
    return torch.cat([captured.get(i, normed)[:, :count] for i in layer_ids], dim=-1)


@dataclass
class Prefill:
    """The target after reading the prompt: its cache, its first token, the drafter's features of the prompt."""

    prompt_len: int
    cache: object
    first_token: torch.Tensor
    first_logits: torch.Tensor
    """[vocab]: the row the first token is the argmax of (both decoders' row 0)."""
    features: torch.Tensor
    """[1, P, n*H]: the outputs of the drafter's target layers (dflashpipe.model.target_features)."""
    seconds: float

    def fork(self) -> Prefill:
        """An independent copy, so two decoders can start from one prefill."""
        return Prefill(
            self.prompt_len, copy.deepcopy(self.cache), self.first_token, self.first_logits, self.features, self.seconds
        )


@torch.no_grad()
def prefill(target: Target | torch.nn.Module, prompt_ids: Sequence[int], layer_ids: Sequence[int] = ()) -> Prefill:
    """Read the prompt into a fresh cache: the first greedy token, and the features of `layer_ids`.
    `target`: a Target, or a Hugging Face model to run as one (here and in the decoders below)."""
    target = Target.of(target)
    device, layer_ids = target.device, list(layer_ids)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    began = clock(device)
    cache = target.new_cache()
    with layer_capture(target.model, layer_ids) as captured:
        normed = target.decoder_forward(ids, cache)
    row = target.head(normed[:, -1])[0]
    features = captured_features(captured, layer_ids, normed, ids.shape[1]) if layer_ids else normed[:, :0]
    return Prefill(ids.shape[1], cache, row.argmax(-1), row, features, clock(device) - began)
