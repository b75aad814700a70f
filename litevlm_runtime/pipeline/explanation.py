"""What an answer was based on, computed only when asked: the view selector's choice and its
probability per camera, the token selector's score of every visual token and which were kept,
where the decoder looked while answering, and the objects the question and the answer name.

    explanation = explain(rt, trace)      # trace: what one answered query produced (QueryTrace)

Nothing here runs on a query's path: a query that is not explained pays nothing. Explaining costs
one extra decoder pass over the query's prefill rows and its answer (the decoder's own layer
forward, `CausalLM.run_layers`, with the `probe` hook every layer already has) plus the token
selector's scores recomputed over the full prompt (the same function its `select` ranks by). The
view selector remembers its selection per question, so its part is a lookup.

Where the decoder looked: for each row that chose an answer token (the prompt's last row chose the
first, each answer token's row the next), the attention probabilities `attention_probs` over every
earlier row, averaged over all query heads, over those rows and over the middle half of the layers
(`attention_layers()`: L/4 .. 3L/4 - 1, layers 3-8 of the bundled model's 12), then read at the
kept visual tokens. Why those: measured (scripts/studies/explain_layers.py, docs/explain.md) on SynthDrive
seeds the bundled model never saw, single layers disagree wildly (two of its twelve look away from
the object a question tags), so several are averaged; the band was chosen on seed 3301 by how much
more attention the tagged object's token gets than its camera's mean kept token (middle half 1.64x,
last quarter 1.09x, all layers 1.55x) and held on seed 4409 (1.41x against 1.26x for the last
quarter; but in the top 10% of its camera's tokens 38% of the time against 58%: at 24 questions a
band's lead is weak). Layer 0 is shown already, as the token selector's score. And the pass stops
after the band's last layer: a quarter of the layers is never run. Any other band can be passed
(`layers=`); for another model, measure with the script.

The numbers are attention probabilities: which visual tokens the answer rows weighted, not which
ones caused the answer (docs/explain.md: what the pictures do not prove).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from ..cameras import CAMERAS
from ..errors import InputError, LiteVLMError
from ..models.decoder import attention_probs
from ..objects import MalformedTag, ObjectRef, parse_objects
from ..stages.prompt import build_prompt
from ..stages.token_selector import PromptLayout
from ..stages.view_selector import keyword_map
from ..timing import StageTimer
from .answer import Answer
from .runtime import Runtime


def attention_layers(num_layers: int) -> tuple[int, ...]:
    """The middle half of the layers, L/4 .. 3L/4 - 1 (every layer below 4): 12 -> 3..8, 24 -> 6..17."""
    q = num_layers // 4
    return tuple(range(q, num_layers - q))


@dataclass(frozen=True)
class TokenGrid:
    """How a camera's visual tokens lie on its image: `tiles` tiles of `tile_px` x `tile_px` side by
    side (the preprocessing squashes the image to tiles*S x S, preprocess.to_tiles_uint8), each an
    `side` x `side` grid of tokens (InternViT's patches after the pixel shuffle, row-major), tile by
    tile. Token i of a camera: tile i // side^2, row (i % side^2) // side, column i % side."""

    tiles: int
    side: int
    tile_px: int

    @property
    def tokens(self) -> int:
        return self.tiles * self.side * self.side

    def boxes(self, width: int, height: int) -> np.ndarray:
        """[tokens, 4] float (x0, y0, x1, y1) of each token in a width x height image's pixels: the
        token's cell of the squashed tile grid mapped back through the resize."""
        i = np.arange(self.tokens)
        tile, cell = i // (self.side * self.side), i % (self.side * self.side)
        row, col = cell // self.side, cell % self.side
        sx = width / (self.tiles * self.side)          # image pixels per token cell, across
        sy = height / self.side
        x0 = (tile * self.side + col) * sx
        y0 = row * sy
        return np.stack([x0, y0, x0 + sx, y0 + sy], axis=1)

    def image(self, values: np.ndarray) -> np.ndarray:
        """Per-token values [tokens] -> the token grid as an image [side, tiles*side] (row-major tiles
        side by side, as they lie on the squashed image)."""
        grid = np.asarray(values).reshape(self.tiles, self.side, self.side)
        return np.concatenate(list(grid), axis=1)


@dataclass(frozen=True)
class QueryTrace:
    """What one answered query produced that its explanation reads: a snapshot the pipeline takes
    when (and only when) an explanation is asked for, since the arena's buffers are the next
    query's. Rows are those of the full prompt (every visual token present; row = position id)."""

    question: str                       # the question the images came with (its views and tokens)
    answer: str
    answer_ids: tuple[int, ...]         # the answer's tokens, end token excluded (Decoded.tokens)
    cameras: tuple[str, ...]            # the cameras the prompt holds, in its order (rig order)
    prompt_embeds: torch.Tensor         # [L, D] the full prompt's embeddings, every visual token
    layout: PromptLayout                # per view (first row, count), the question's rows, L
    keep: tuple[torch.Tensor, ...]      # per view: kept token indices [k_v], ascending
    rows: torch.Tensor                  # [n] the full-prompt row of each prefill row (its position id)
    # Frame sets the prompt holds: its views are (camera, frame) camera by camera, each camera's
    # frames oldest first (the prompt's order, pipeline.query_views); 1: one view per camera.
    frames: int = 1

    def check(self, rt: Runtime) -> None:
        """Refuse a trace that does not fit this runtime, naming what is wrong."""
        length, width = self.layout.length, rt.cfg.llm.hidden_size
        if tuple(self.prompt_embeds.shape) != (length, width):
            raise InputError(f"explanation: prompt_embeds {tuple(self.prompt_embeds.shape)}, expected "
                             f"({length}, {width}) for a prompt of {length} rows")
        if not (len(self.cameras) * self.frames == len(self.layout.spans) == len(self.keep)):
            raise InputError(f"explanation: {len(self.cameras)} cameras x {self.frames} frame sets, "
                             f"{len(self.layout.spans)} image spans, {len(self.keep)} kept-token lists: one each "
                             f"per (camera, frame set)")
        unknown = [c for c in self.cameras if c not in rt.options.cameras]
        if unknown:
            raise InputError(f"explanation: camera(s) {', '.join(unknown)} are not the rig's", camera=unknown[0])
        for cam, (_, count), kept in zip((c for c in self.cameras for _ in range(self.frames)), self.layout.spans,
                                         self.keep):
            if count != rt.tokens_per_camera or (len(kept) and (int(kept.min()) < 0 or int(kept.max()) >= count)):
                raise InputError(f"explanation: {cam}'s image span has {count} tokens (expected "
                                 f"{rt.tokens_per_camera}) or kept indices outside it", camera=cam)
        if len(self.rows) == 0 or int(self.rows.max()) >= length or bool((self.rows[1:] <= self.rows[:-1]).any()):
            raise InputError(f"explanation: prefill rows must be ascending rows of the {length}-row prompt")
        bad = [t for t in self.answer_ids if not 0 <= t < rt.cfg.llm.vocab_size]
        if bad:
            raise InputError(f"explanation: answer token {bad[0]} is outside the vocabulary ({rt.cfg.llm.vocab_size})")


    def with_answer(self, text: str, token_ids) -> "QueryTrace":
        """This prompt's trace with the answer its query produced."""
        return replace(self, answer=text, answer_ids=tuple(token_ids))


def prompt_trace(rt: Runtime, question: str, cameras, layout: PromptLayout, prefill_rows: int,
                 frames: int = 1) -> QueryTrace:
    """The trace of the query whose prompt the arena holds, taken right after its prefill
    (`Pipeline.begin` does, when the request asks for an explanation): the full prompt's embeddings
    `assemble_prompt` wrote and the positions of the `prefill_rows` rows `prefill` ran (decoding
    writes only rows after them; the next query's admission overwrites both, so a batched query
    must be taken here). The answer is added when it is known (`with_answer`)."""
    a = rt.arena
    rows = a.positions[:prefill_rows].clone()
    keep = tuple(rows[(rows >= start) & (rows < start + count)] - start for start, count in layout.spans)
    return QueryTrace(question, "", (), tuple(cameras), a.prompt_embeds[:layout.length].clone(), layout, keep, rows,
                      frames)


def trace_from_arena(rt: Runtime, answer: Answer) -> QueryTrace:
    """The trace of `answer`, read from the arena of the runtime that answered it, right after
    `Pipeline.answer` returned and before its next query (which overwrites these buffers; a batched
    runtime's next prefill may come earlier: ask with QueryRequest.explain, and the trace is taken
    after prefill, Answer.trace). Checked: the arena's ids must be this answer's prompt."""
    if answer.turn != 1:
        raise InputError("explanation: a follow-up's (turn > 1) prompt holds its conversation; not explained yet")
    a = rt.arena
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, answer.cameras, answer.question,
                          rt.tokens_per_camera)
    length = len(prompt.input_ids)
    if length > a.max_prompt or a.prompt_ids[:length].tolist() != list(prompt.input_ids):
        raise LiteVLMError("explanation: the arena no longer holds this answer's prompt (another query ran since)")
    last = (a.positions[:a.max_prompt] == length - 1).nonzero()    # the prompt's last row is always a prefill row
    if not len(last):
        raise LiteVLMError("explanation: the arena's prefill rows are not this answer's")
    layout = PromptLayout(length, list(prompt.image_spans), prompt.question_span)
    return prompt_trace(rt, answer.question, answer.cameras, layout, int(last[0]) + 1).with_answer(
        answer.text, answer.token_ids)


@dataclass(frozen=True)
class CameraView:
    """One camera of the rig in an explanation."""

    camera: str
    selected: bool                      # in the prompt (the view selector kept it, a budget did not drop it)
    view_score: float                   # the view selector's fused score (keyword map alone without a module)
    view_probability: float | None      # the module's sigmoid; None: no view selector ran
    keyword: float                      # the keyword map's score
    token_scores: np.ndarray | None = None   # [tokens] float32, the token selector's; None: unselected or none ran
    kept: np.ndarray | None = None           # [tokens] bool; None: unselected
    attention: np.ndarray | None = None      # [tokens] float32 answer attention; 0 where not kept; None: unselected
    # Over frame sets (Explanation.frames > 1): the fields above are the newest set's view; these the
    # older sets', oldest first (their kept tokens are those temporal token selection kept).
    past: tuple["PastView", ...] = ()


@dataclass(frozen=True)
class PastView:
    """A selected camera's view in an older frame set of the prompt."""

    kept: np.ndarray                         # [tokens] bool: changed against the newest set (stages/temporal.py)
    attention: np.ndarray                    # [tokens] float32 answer attention; 0 where not kept


@dataclass(frozen=True)
class Explanation:
    question: str
    answer: str
    views: tuple[CameraView, ...]       # every rig camera, rig order
    view_reason: str                    # the view selector's: selected | argmax | no_cue | keyword map
    grid: TokenGrid
    attention_layers: tuple[int, ...]   # decoder layers averaged
    attention_rows: int                 # rows averaged: one per answer token chosen
    visual_share: float                 # of those rows' attention, the share on visual tokens (the rest: text)
    question_objects: tuple[ObjectRef, ...]
    answer_objects: tuple[ObjectRef, ...]
    malformed: tuple[MalformedTag, ...]  # tag-like text in the question or answer that names no object
    cost_ms: dict[str, float] = field(default_factory=dict)   # per part: views, token_scores, attention
    notes: tuple[str, ...] = ()
    frames: int = 1                      # frame sets the prompt held (CameraView.past: the older ones)

    @property
    def cameras(self) -> list[str]:
        return [v.camera for v in self.views if v.selected]

    def view(self, camera: str) -> CameraView:
        for v in self.views:
            if v.camera == camera:
                return v
        raise KeyError(camera)

    def to_dict(self) -> dict:
        """JSON-ready: arrays as lists, objects as dicts."""
        def arr(a):
            return None if a is None else np.asarray(a).tolist()
        return {
            "question": self.question, "answer": self.answer, "cameras": self.cameras,
            "view_reason": self.view_reason,
            "views": [{"camera": v.camera, "selected": v.selected, "view_score": v.view_score,
                       "view_probability": v.view_probability, "keyword": v.keyword,
                       "token_scores": arr(v.token_scores), "kept": arr(v.kept), "attention": arr(v.attention),
                       "past": [{"kept": arr(p.kept), "attention": arr(p.attention)} for p in v.past]}
                      for v in self.views],
            "frames": self.frames,
            "grid": {"tiles": self.grid.tiles, "side": self.grid.side, "tile_px": self.grid.tile_px},
            "attention_layers": list(self.attention_layers), "attention_rows": self.attention_rows,
            "visual_share": self.visual_share,
            "question_objects": [o.to_dict() for o in self.question_objects],
            "answer_objects": [o.to_dict() for o in self.answer_objects],
            "malformed": [m.to_dict() for m in self.malformed],
            "cost_ms": dict(self.cost_ms), "notes": list(self.notes),
        }


@torch.inference_mode()
def answer_attention(lm, embeds: torch.Tensor, positions: torch.Tensor, query_rows: torch.Tensor,
                     layers: Sequence[int]) -> torch.Tensor:
    """One causal pass of the decoder `lm` (its own `run_layers`) over embeds [T, D] at positions [T]
    (ascending: row order is attention order). Returns, for each layer of `layers`, the attention
    probabilities of the rows `query_rows` [Q] over every row, averaged over the query heads:
    [len(layers), Q, T] float32 (zero right of each query row). Layers after the last of `layers`
    are not run."""
    t = embeds.shape[0]
    wanted = sorted(set(layers))
    if not wanted or wanted[0] < 0 or wanted[-1] >= len(lm.layers):
        raise InputError(f"explanation: layers {list(layers)} outside the decoder's 0..{len(lm.layers) - 1}")
    cols = torch.arange(t, device=embeds.device)
    allowed = cols[None, :] <= query_rows[:, None]                              # [Q, T] causal
    found: dict[int, torch.Tensor] = {}

    def probe(i: int, q: torch.Tensor, k: torch.Tensor) -> None:              # q [T, Hq, Dh], k [T, Hkv, Dh]
        if i in layers:
            found[i] = attention_probs(q[query_rows], k, allowed).mean(0)       # [Q, T]

    mask = cols[None, :] <= cols[:, None]
    lm.run_layers(embeds, positions, mask, layers=range(wanted[-1] + 1), probe=probe)
    return torch.stack([found[i] for i in layers])


def explain(rt: Runtime, trace: QueryTrace, layers: Sequence[int] | None = None) -> Explanation:
    """The explanation of one answered query (see the module's docstring); `layers`: the decoder
    layers whose attention is averaged (default attention_layers())."""
    trace.check(rt)
    timer = StageTimer(rt.device)
    layers = tuple(layers) if layers is not None else attention_layers(len(rt.lm.layers))
    with timer("views"):
        if rt.view_selector is not None:
            selection = rt.view_selector.explain(trace.question)
            scores, probability, keyword, reason = (selection.scores, selection.module, selection.keyword,
                                                    selection.reason)
        else:
            keyword = scores = keyword_map(trace.question)
            probability, reason = None, "keyword map (no view selector)"
    with timer("token_scores"):
        token_scores = _token_scores(rt, trace)
    with timer("attention"):
        attention, rows, share = _answer_attention(rt, trace, layers)
    cost = timer.milliseconds()

    grid = TokenGrid(rt.options.tiles_per_camera, _side(rt), rt.cfg.force_image_size)
    views = []
    for cam in CAMERAS:
        if cam not in rt.options.cameras:
            continue
        common = dict(camera=cam, view_score=float(scores.get(cam, 0.0)), keyword=float(keyword.get(cam, 0.0)),
                      view_probability=None if probability is None else float(probability[cam]))
        if cam not in trace.cameras:
            views.append(CameraView(selected=False, **common))
            continue
        first = trace.cameras.index(cam) * trace.frames      # its views: first .. first + frames - 1, newest last

        def kept_mask(view: int) -> np.ndarray:
            kept = np.zeros(grid.tokens, dtype=bool)
            kept[trace.keep[view].cpu().numpy()] = True
            return kept
        i = first + trace.frames - 1
        past = tuple(PastView(kept_mask(v), attention[v]) for v in range(first, i))
        views.append(CameraView(selected=True, token_scores=None if token_scores is None else token_scores[i],
                                kept=kept_mask(i), attention=attention[i], past=past, **common))
    question = parse_objects(trace.question, rt.options.cameras)
    answer = parse_objects(trace.answer, rt.options.cameras)
    notes = ("FastV ran in the query: this pass attends over every prefill row in every layer",) \
        if rt.fastv is not None else ()
    return Explanation(trace.question, trace.answer, tuple(views), reason, grid, layers, rows, share,
                       question.objects, answer.objects, question.malformed + answer.malformed, cost, notes,
                       trace.frames)


def _side(rt: Runtime) -> int:
    side = int(round(rt.cfg.tokens_per_tile ** 0.5))
    if side * side != rt.cfg.tokens_per_tile:
        raise InputError(f"explanation: {rt.cfg.tokens_per_tile} tokens per tile are not a square grid")
    return side


def _token_scores(rt: Runtime, trace: QueryTrace) -> list[np.ndarray] | None:
    """Per view, the token selector's score of every visual token [tokens] (the function its
    `select` ranks by, over the same full prompt and the same views: the newest frame set's, which
    it ranked; None for an older set's view, whose tokens temporal selection kept), or None where
    no selector ran."""
    if rt.token_selector is None:
        return None
    embeds = trace.prompt_embeds.to(rt.device, rt.dtype)
    positions = torch.arange(trace.layout.length, device=rt.device)
    ranked = [i for i in range(len(trace.layout.spans)) if i % trace.frames == trace.frames - 1]
    spans = [trace.layout.spans[i] for i in ranked]
    visual_rows = torch.cat([torch.arange(s, s + c, device=rt.device) for s, c in spans])
    with torch.inference_mode():
        score = rt.token_selector.scores(embeds, positions, trace.layout.question, visual_rows)
    out: list = [None] * len(trace.layout.spans)
    for i, part in zip(ranked, score.split([c for _, c in spans])):
        out[i] = part.float().cpu().numpy()
    return out


def _answer_attention(rt: Runtime, trace: QueryTrace,
                      layers: tuple[int, ...]) -> tuple[list[np.ndarray], int, float]:
    """Per view [tokens] the answer rows' mean attention (0 at dropped tokens), the number of
    rows averaged, and their attention's share on visual tokens."""
    rows = trace.rows.to(rt.device)
    n, length = len(rows), trace.layout.length
    fed = list(trace.answer_ids[:-1])                       # the last answer token chose nothing kept
    with torch.inference_mode():
        ids = torch.tensor(fed, dtype=torch.long, device=rt.device)
        embeds = torch.cat([trace.prompt_embeds.to(rt.device, rt.dtype)[rows], rt.lm.embed(ids)])
        positions = torch.cat([rows, length + torch.arange(len(fed), device=rt.device)])
        query = torch.arange(n - 1, n + len(fed), device=rt.device)    # each chose one answer token
        probs = answer_attention(rt.lm, embeds, positions, query, layers).mean((0, 1)).cpu()   # [n + len(fed)]
    at_row = torch.zeros(length)
    at_row[trace.rows.cpu()] = probs[:n]                   # full-prompt row -> its attention
    per_camera, visual = [], 0.0
    for (start, count), kept in zip(trace.layout.spans, trace.keep):
        values = torch.zeros(count)
        values[kept.cpu()] = at_row[start + kept.cpu()]
        visual += float(values.sum())
        per_camera.append(values.numpy())
    return per_camera, len(query), visual
