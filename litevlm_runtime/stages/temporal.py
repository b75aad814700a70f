"""Temporal token selection: a K-frame question's older frame sets keep only the visual tokens that
changed against the newest set, so that K frames cost far less than K x the tokens.

Most of what a camera sees does not change in half a second: sky, road surface, buildings, a car
standing still while the ego stands too. Each visual token of an older frame is compared with the
token at the same position (same camera, same tile cell) of the newest frame set, on the cached
visual features both already have (the vision stage's output, what the decoder reads):

    distance = ||older - newest|| / ||newest||        (per token; L2 over the feature dimension)

and kept when the distance reaches `temporal.change_threshold`. A dropped token's information is
the newest frame's token at that position, which the prompt holds; the decoder is told that by its
absence (kept tokens keep their original position ids, as token selection's do), and the bundled
model is trained with the same rule applied to the same features (training/packing.py), so that a
prompt without unchanged tokens is what it learned on. The newest frame set's own tokens are the
token selector's to choose (token_selector.py), as in a single-frame question.

The survey of efficient LVLM inference lists this temporal redundancy first for video; unlike a
pixel difference it needs no extra pass (the features are the cache's) and it is measured in the
space the decoder reads.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def token_change(older: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
    """Per token, the relative L2 distance of an older frame's visual features to the newest
    frame's at the same position. older, newest: [..., tokens, D] -> [..., tokens] float32."""
    older, newest = older.float(), newest.float()
    return (older - newest).norm(dim=-1) / newest.norm(dim=-1).clamp_min(EPS)


def changed_tokens(older: torch.Tensor, newest: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (ascending) of the tokens of `older` [tokens, D] that changed against `newest`
    [tokens, D] by at least `threshold`; every token at threshold 0."""
    if threshold <= 0:
        return torch.arange(older.shape[0], device=older.device)
    return (token_change(older, newest) >= threshold).nonzero().flatten()
