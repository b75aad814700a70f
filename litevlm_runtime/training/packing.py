"""Packing QA into one forward: the QA of one frame share their prompt as a prefix tree, trees go
side by side under one boolean attention mask, and the loss is taken over answer tokens only.

A prompt over several frame sets is trained as the pipeline will run it: an older frame set's
visual token that did not change against the newest set's at the same camera and position
(stages/temporal.py) is not there. With a trainable vision side it is masked out of every row's
attention, decided on the visual features of this forward; with a frozen one (`--freeze-vision`:
the features are known before the step) its row is left out of the packed sequence altogether
(`pack(dropped=)`), which also saves its compute. Both give the logits of dropping it before
prefill at inference: kept tokens keep their positions in all three."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.internvl import InternVL
from ..stages.temporal import token_change
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
    frames: list                 # each group's key (vlm_data.group_of; the order of the visual tokens)
    samples: int                 # QA count
    # Older frame sets' visual rows and the newest set's row at the same camera and position, pairwise
    # ([M] each; empty without frame sets over time): what temporal token selection compares.
    older_rows: torch.Tensor = None
    newest_rows: torch.Tensor = None
    # [V] for each visual row, its token among the batch's tiles' tokens (flattened, tile order):
    # rows left out (pack(dropped=)) make it other than 0..V-1
    visual_index: torch.Tensor = None

    def to(self, device: torch.device) -> "PackedBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedBatch(move(self.ids), move(self.positions), move(self.mask), move(self.visual_rows),
                           move(self.target_rows), move(self.targets), move(self.weights), self.frames, self.samples,
                           move(self.older_rows), move(self.newest_rows), move(self.visual_index))


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


def pack(groups: list[tuple[int, list[Encoded]]], per_sample: bool = False,
         dropped: list[set[int]] | None = None) -> PackedBatch:
    """groups: (frame index, encoded QA of that frame). One prefix tree per group.

    per_sample: weight each target by 1/(its answer's length), so that every QA counts the same
    in the loss (a one-token "Yes." as much as a 40-token description) instead of every token.
    dropped: per group, the prompt rows (visual tokens of older frame sets) left out of the
    sequence; the rows kept keep their positions (temporal token selection decided before the step)."""
    ids: list[int] = []
    pos: list[int] = []
    visual_rows: list[int] = []
    visual_index: list[int] = []
    target_rows: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    blocks: list[tuple[int, int, list[int]]] = []
    older_rows: list[int] = []
    newest_rows: list[int] = []
    tokens_before = 0                       # visual tokens of the groups before (the tiles' flat order)
    for g, (_, items) in enumerate(groups):
        # Each branch keeps at least its last prompt token: its logits predict the first answer token.
        shared = min(common_prefix_len([e.prompt for e in items]), min(len(e.prompt) for e in items) - 1)
        gone = dropped[g] if dropped is not None else set()
        kept = [i for i in range(shared) if i not in gone]
        row_of = {i: r for r, i in enumerate(kept)}
        off = len(ids)
        for start, count in items[0].spans:
            if start + count > shared:
                raise ValueError("visual tokens must lie in the shared prefix")
            for i in range(start, start + count):
                if i in row_of:
                    visual_rows.append(off + row_of[i])
                    visual_index.append(tokens_before + i - start)
            tokens_before += count
        k = items[0].frames                 # spans: camera by camera, each camera's frame sets oldest first
        for c in range(0, len(items[0].spans), k) if dropped is None else ():    # (the mask's pairs)
            newest_start, count = items[0].spans[c + k - 1]
            for start, _ in items[0].spans[c:c + k - 1]:
                older_rows.extend(range(off + start, off + start + count))
                newest_rows.extend(range(off + newest_start, off + newest_start + count))
        ids += [items[0].prompt[i] for i in kept]
        pos += kept
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
        blocks.append((off, len(kept), lengths))
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
        as_long(older_rows),
        as_long(newest_rows),
        as_long(visual_index),
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
    visual tokens (`vision_labels.py`). `change_threshold`: temporal token selection's
    (temporal.change_threshold), applied to prompts over several frame sets; 0 keeps every token."""

    def __init__(self, model: InternVL, probe: VisionProbe | None = None, probe_weight: float = 0.0,
                 change_threshold: float = 0.0, frozen_vision: bool = False):
        super().__init__()
        self.model = model
        self.probe = probe
        self.probe_weight = probe_weight
        self.change_threshold = change_threshold
        self.frozen_vision = frozen_vision        # inputs are the vision tower's cached output, not pixels
        self.last_dropped = 0

    def forward(self, pixels: torch.Tensor, batch: PackedBatch, visual_labels: torch.Tensor | None = None,
                probe_tiles: torch.Tensor | None = None,
                motion: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """pixels [tiles, 3, S, S] in the batch's view order (frozen_vision: the frozen vision side's
        visual tokens [tiles, tokens_per_tile, D], vlm_data.VisionFeatureCache);
        visual_labels [labelled tiles' tokens, labels] for the tiles `probe_tiles` [labelled tiles]
        (None: every tile); motion: (the tiles that are a camera's newest set in a prompt over frame
        sets [M], their cells' flow [M, tokens, features]) for the model's motion network, whose output
        is added to those tiles' visual tokens after the probe read them (as the pipeline adds it)."""
        lm = self.model.language_model
        # [tiles, tokens_per_tile, D]: the frozen vision side's cached output, or the tower on the pixels
        visual = pixels if self.frozen_vision else self.model.encode_images(pixels)
        aux = 0.0
        if self.probe is not None and visual_labels is not None:
            labelled = visual if probe_tiles is None else visual[probe_tiles]
            flat = labelled.reshape(-1, visual.shape[-1])
            aux = self.probe_weight * self.probe(flat, visual_labels) / visual.shape[1]   # per tile
            self.last_probe_loss = aux.detach()        # a tensor: no device sync per sequence
        if motion is not None and self.model.motion is not None:
            tiles, flow = motion
            visual = visual.index_add(0, tiles, self.model.motion(flow).to(visual.dtype))
        embeds = lm.embed(batch.ids)
        flat = visual.reshape(-1, visual.shape[-1])
        if batch.visual_index is not None and batch.visual_index.numel() != flat.shape[0]:
            flat = flat[batch.visual_index]               # (rows left out of the sequence: pack(dropped=))
        embeds = embeds.index_copy(0, batch.visual_rows, flat.to(embeds.dtype))
        hidden, _, _ = lm(embeds, batch.positions, self.temporal_mask(batch, embeds))   # the packed trees alone

        logits = lm.head(hidden[batch.target_rows])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # fp16/bf16 -> fp32, fp64 stays
        ce = F.cross_entropy(logits, batch.targets, reduction="none")
        return (ce * batch.weights.to(ce.dtype)).sum() + aux

    def temporal_mask(self, batch: PackedBatch, embeds: torch.Tensor) -> torch.Tensor:
        """The batch's mask with every older frame set's unchanged visual row hidden from all rows
        (it still sees itself: no row attends to nothing)."""
        if batch.older_rows is None or not batch.older_rows.numel() or self.change_threshold <= 0:
            return batch.mask
        with torch.no_grad():
            change = token_change(embeds[batch.older_rows], embeds[batch.newest_rows])
            dropped = batch.older_rows[change < self.change_threshold]
        self.last_dropped = int(dropped.numel())
        mask = batch.mask.clone()
        mask[:, dropped] = False
        mask[dropped, dropped] = True
        return mask
