"""Which target layers feed the drafter, and how their hidden states become its context features."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflashpipe.core.errors import ParamsError


def spaced_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spaced evenly from layer 1 to layer L-3 (one layer: the middle one).

    The ends are left out as published: layer 0 is still close to the embeddings and the
    last layers already specialise in the target's own next token.
    """
    if count == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    if last - first + 1 < count:
        raise ParamsError(
            f"params.yaml: model.target_layers = {count}: the target has {num_target_layers} layers, "
            f"so at most {max(last - first + 1, 1)} distinct layers fit between layer 1 and L-3"
        )
    # Python's round (half to even) as in the published drafters, so the ids agree with theirs.
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


def check_target_layer_ids(ids: Sequence[int], num_target_layers: int) -> list[int]:
    ids = list(ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_target_layers:
        raise ParamsError(
            f"params.yaml: model.target_layer_ids = {ids}: the target has {num_target_layers} layers: "
            f"give distinct increasing ids from 0 to {num_target_layers - 1}"
        )
    return ids


def target_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers: [B, S, len(ids) * H].

    `hidden_states` is what a Hugging Face model returns with output_hidden_states=True:
    entry 0 is the embedding output, so decoder layer i's output is entry i + 1.
    """
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)
