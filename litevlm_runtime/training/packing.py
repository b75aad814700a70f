"""Packing QA into one forward: the QA of one frame share their prompt as a prefix tree, trees go
side by side under one boolean attention mask, and the loss is taken over answer tokens only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.internvl import InternVL
from .vision_labels import VisionProbe
from .vlm_data import Encoded


@dataclass
class PackedBatch:
    ids: torch.Tensor            # [T] token ids (<IMG_CONTEXT> where visual tokens go)
    positions: torch.Tensor      # [T] RoPE positions, as each sample would have them alone
    mask: torch.Tensor           # [T, T] bool, True = may attend
    visual_rows: torch.Tensor    # [V] rows receiving visual tokens, ordered group, camera, token
    target_rows: torch.Tensor    # [N] rows whose next token is an answer token (or <|im_end|>)
    targets: torch.Tensor        # [N] those next tokens
    weights: torch.Tensor        # [N] loss weight of each target (1, or 1/answer length per sample)
    frames: list                 # each group's key, frame index or (frame, cameras) (order of the visual tokens)
    samples: int                 # QA count

    def to(self, device: torch.device) -> "PackedBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedBatch(move(self.ids), move(self.positions), move(self.mask), move(self.visual_rows),
                           move(self.target_rows), move(self.targets), move(self.weights), self.frames, self.samples)


def common_prefix_len(seqs: list[list[int]]) -> int:
    # Vectorised: prompts are hundreds of tokens and packing runs on the CPU ahead of every step
    # (a token-by-token loop here was most of a GPU step's time).
    n = min(len(s) for s in seqs)
    first = np.asarray(seqs[0][:n])
    for s in seqs[1:]:
        differ = np.flatnonzero(first[:n] != np.asarray(s[:n]))
        if differ.size:
            n = int(differ[0])
    return n


def pack(groups: list[tuple[int, list[Encoded]]], per_sample: bool = False) -> PackedBatch:
    """groups: (frame index, encoded QA of that frame). One prefix tree per group.

    per_sample: weight each target by 1/(its answer's length), so that every QA counts the same
    in the loss (a one-token "Yes." as much as a 40-token description) instead of every token."""
    ids: list[int] = []
    pos: list[int] = []
    visual_rows: list[int] = []
    target_rows: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    blocks: list[tuple[int, int, list[int]]] = []
    for _, items in groups:
        # Each branch keeps at least its last prompt token: its logits predict the first answer token.
        shared = min(common_prefix_len([e.prompt for e in items]), min(len(e.prompt) for e in items) - 1)
        off = len(ids)
        for start, count in items[0].spans:
            if start + count > shared:
                raise ValueError("visual tokens must lie in the shared prefix")
            visual_rows.extend(range(off + start, off + start + count))
        ids += items[0].prompt[:shared]
        pos += range(shared)
        lengths = []
        for e in items:
            branch = e.prompt[shared:] + e.answer
            base = len(ids)
            first = len(e.prompt) - shared - 1          # branch index of the last prompt token
            for j in range(first, len(branch) - 1):
                target_rows.append(base + j)
                targets.append(branch[j + 1])
                weights.append(1.0 / len(e.answer) if per_sample else 1.0)
            ids += branch
            pos += range(shared, shared + len(branch))
            lengths.append(len(branch))
        blocks.append((off, shared, lengths))
    t = len(ids)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for off, shared, lengths in blocks:
        mask[off:off + shared, off:off + shared] = torch.ones(shared, shared, dtype=torch.bool).tril()
        b = off + shared
        for n in lengths:
            mask[b:b + n, off:off + shared] = True
            mask[b:b + n, b:b + n] = torch.ones(n, n, dtype=torch.bool).tril()
            b += n
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return PackedBatch(
        as_long(ids),
        as_long(pos),
        mask,
        as_long(visual_rows),
        as_long(target_rows),
        as_long(targets),
        torch.tensor(weights, dtype=torch.float64),
        [f for f, _ in groups],
        sum(len(items) for _, items in groups),
    )


def split_into_sequences(
    groups: list[tuple[int, list[Encoded]]], max_tokens: int
) -> list[list[tuple[int, list[Encoded]]]]:
    """Consecutive groups packed greedily into sequences of at most max_tokens (a group longer than
    that is split into several groups of the same frame)."""
    pieces = []                   # (frame, QA, the length pack() gives them)
    for frame, items in groups:
        # The packed length, kept up to date as QA join the group: the shared prefix once, plus
        # each branch (prompt beyond the prefix, answer) = all prompts and answers - (k-1) * shared.
        part: list[Encoded] = []
        shared = whole = 0
        for e in items:
            if part:
                s = min(shared, common_prefix_len([part[0].prompt, e.prompt]), len(e.prompt) - 1)
                if whole + len(e.prompt) + len(e.answer) - len(part) * s > max_tokens:
                    pieces.append((frame, part, whole - (len(part) - 1) * shared))
                    part = []
                else:
                    shared = s
            if not part:
                shared = len(e.prompt) - 1
                whole = 0
            part.append(e)
            whole += len(e.prompt) + len(e.answer)
        pieces.append((frame, part, whole - (len(part) - 1) * shared))
    sequences, current, used = [], [], 0
    for frame, items, n in pieces:
        if current and used + n > max_tokens:
            sequences.append(current)
            current, used = [], 0
        current.append((frame, items))
        used += n
    if current:
        sequences.append(current)
    return sequences


class PackedLoss(nn.Module):
    """Weighted sum of the answer-token cross-entropies of a packed batch (the module DDP wraps),
    plus, with a vision probe, `probe_weight` times the summed per-token label loss of the
    visual tokens (`vision_labels.py`)."""

    def __init__(self, model: InternVL, probe: VisionProbe | None = None, probe_weight: float = 0.0):
        super().__init__()
        self.model = model
        self.probe = probe
        self.probe_weight = probe_weight

    def forward(
        self, pixels: torch.Tensor, batch: PackedBatch, visual_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        lm = self.model.language_model
        visual = self.model.encode_images(pixels)                     # [tiles, tokens_per_tile, D]
        aux = 0.0
        if self.probe is not None and visual_labels is not None:
            flat = visual.reshape(-1, visual.shape[-1])
            aux = self.probe_weight * self.probe(flat, visual_labels) / visual.shape[1]   # per tile
            self.last_probe_loss = aux.detach()        # a tensor: no device sync per sequence
        embeds = lm.embed(batch.ids)
        embeds = embeds.index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]).to(embeds.dtype))
        hidden, _, _ = lm(embeds, batch.positions, batch.mask)      # no cache: the packed trees on their own
        logits = lm.head(hidden[batch.target_rows])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # fp16/bf16 -> fp32, fp64 stays
        ce = F.cross_entropy(logits, batch.targets, reduction="none")
        return (ce * batch.weights.to(ce.dtype)).sum() + aux
