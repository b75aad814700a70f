"""Latency budgets: a query may say "answer within B ms", and the pipeline decides, before it
starts, how to fit: fewer views (the view selector's highest scores first), a lower token keep
ratio, greedy decoding instead of a draft tree where that is faster (the answer is the same), a
shorter answer cap, in that order, taking only
as many steps down that ladder as the budget needs. A query that cannot fit even at the coarsest
setting gets the coarsest answer, flagged, not a timeout.

The plan rests on a per-stage cost model of this runtime, measured at warm-up (`measure`: vision
per camera, prefill over two prompt sizes, a decode step) and updated online from every answer's
own stage times:

    view_select        constant
    preprocess+vision  per camera decoded (a camera in the feature cache costs nothing)
    token_select       per camera present
    prefill            a + b * rows (rows = template + question + kept visual tokens)
    decode             ms per token (greedy steps, or EAGLE-2's realised rate) x the answer cap

The answer cap is what makes the budget hold: decode is priced at the cap, not at a typical
answer length, so an answer that runs long is cut at the cap rather than over budget.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ..decoding.greedy import step_one
from ..timing import median_ms
from .token_selector import kept_count

EMA = 0.2                     # weight of a new observation
KEEP_LADDER = (0.6, 0.4, 0.25, 0.1)
MIN_ANSWER_TOKENS = 2         # a choice or yes/no answer ("B.", "Yes.") still fits: the coarsest cap


@dataclass
class Plan:
    cameras: list[str]
    keep_ratio: float
    decoding: str                     # "eagle" | "greedy"
    max_new_tokens: int
    predicted_ms: float
    degraded: list[str] = field(default_factory=list)
    fits: bool = True
    capped: bool = False              # the cap is below the configured one (the answer may be cut)
    frames: int = 1                   # frame sets per camera (camera x time selection; 1: the newest only)


@dataclass
class StageCosts:
    """Milliseconds per unit of work, for this runtime (EMA over observations)."""

    view_select: float = 0.0
    per_camera: float = 0.0           # preprocess + vision, one camera decoded
    token_select_per_camera: float = 0.0
    prefill_base: float = 0.0
    prefill_per_row: float = 0.0
    per_token: dict[str, float] = field(default_factory=lambda: {"greedy": 0.0, "eagle": 0.0})
    answer_lengths: deque = field(default_factory=lambda: deque(maxlen=200))
    observed: int = 0

    def update(self, attr: str, value: float) -> None:
        old = getattr(self, attr)
        setattr(self, attr, value if old == 0.0 else (1 - EMA) * old + EMA * value)

    def observe(self, answer, decoded_cameras: int, decoding: str) -> None:
        """Fold one answer's stage times into the model."""
        ms = answer.stage_ms
        self.update("view_select", ms["view_select"])
        if decoded_cameras:
            self.update("per_camera", (ms["preprocess"] + ms["vision"]) / decoded_cameras)
        if answer.kept_tokens < answer.visual_tokens and answer.cameras:
            self.update("token_select_per_camera", ms["token_select"] / len(answer.cameras))
        # prefill: keep the slope from warm-up, track the level at this size (a runtime never
        # warmed up has neither: its first prefill is the level)
        predicted = self.prefill_base + self.prefill_per_row * answer.input_tokens
        if predicted > 0:
            self.prefill_base = max(0.0, self.prefill_base + EMA * (ms["prefill"] - predicted))
        else:
            self.prefill_base = ms["prefill"]
        tokens = max(1, len(answer.token_ids))
        if "answer cut" not in " ".join(answer.degraded):
            self.answer_lengths.append(tokens)
        old = self.per_token.get(decoding, 0.0)
        value = ms["decode"] / tokens
        self.per_token[decoding] = value if old == 0.0 else (1 - EMA) * old + EMA * value
        self.observed += 1

    def token_ms(self, decoding: str) -> float:
        """ms per answer token decoded as `decoding`; a mode not measured nor seen yet costs what
        the other costs (not nothing: a planner would choose it for free), 1e-3 before any."""
        return self.per_token.get(decoding) or max(self.per_token.values(), default=0.0) or 1e-3


class BudgetPlanner:
    def __init__(self, rt):
        self.rt = rt
        self.costs = StageCosts()

    # ------------------------------------------------------------------ measurement
    @torch.inference_mode()
    def measure(self, repeats: int = 3) -> None:
        """Warm-up measurements on this device and backend: vision of one and of every camera,
        prefill over a short and a long prompt, one decode step."""

        rt, a = self.rt, self.rt.arena

        def ms(fn) -> float:
            return median_ms(fn, repeats, rt.device)

        tiles = rt.options.tiles_per_camera
        cams = len(rt.options.cameras)
        one = ms(lambda: rt.engines.vision.run(a.pixels[:tiles]))
        every = ms(lambda: rt.engines.vision.run(a.pixels[:tiles * cams]))
        self.costs.per_camera = max(one, every / cams)
        longest = min(a.max_prompt, max(getattr(rt.engines.decoder, "prefill_sizes", ()) or (a.max_prompt,)))
        rows = (max(16, longest // 4), longest)        # within the engines' largest prompt bucket
        d = rt.cfg.llm.hidden_size
        x = torch.zeros(rows[1], d, dtype=rt.dtype, device=rt.device)
        times = [ms(lambda n=n: rt.engines.decoder.prefill(x[:n], a.slots[:n], a.causal_mask(n))) for n in rows]
        self.costs.prefill_per_row = max(0.0, (times[1] - times[0]) / (rows[1] - rows[0]))
        self.costs.prefill_base = max(0.0, times[0] - self.costs.prefill_per_row * rows[0])
        step = ms(lambda: rt.engines.head.run(step_one(rt, 0, rows[0], rows[0])))
        self.costs.per_token = {"greedy": step, "eagle": step}

    # ------------------------------------------------------------------ planning
    def predict(self, cameras: int, decoded: int, rows: int, keep_ratio: float, decoding: str, cap: int,
                selects_views: bool = True) -> float:
        """`selects_views`: False for a follow-up, which runs no view selection."""
        c = self.costs
        select = c.token_select_per_camera * cameras if keep_ratio < 1.0 else 0.0
        per_token = c.token_ms(decoding)
        return (c.view_select * selects_views + c.per_camera * decoded + select + c.prefill_base
                + c.prefill_per_row * rows + per_token * cap)

    def plan(self, budget_ms: float, ranked: list[str], cached: set[str], keep_ratio: float, decoding: str,
             max_new: int, text_rows: int, fixed_views: bool = False) -> Plan:
        """The least degraded plan predicted to fit `budget_ms`. `ranked`: the selected cameras,
        the view selector's highest score first; `text_rows`: prompt rows besides visual tokens.

        Each step down the ladder (one view fewer, ..., then a lower keep ratio) buys decode time;
        the first step that affords a typical answer (this runtime's recent answer lengths, 75th
        percentile) under the cap is taken, with the cap at what the budget affords; where none
        does, the coarsest step with the cap cut to fit. `fixed_views` (a follow-up question: its
        conversation's views and visual tokens, no selection run): the ladder is that one step,
        and `text_rows` are all the rows its prefill runs; only the answer cap can give."""

        tpc = self.rt.tokens_per_camera
        target = min(max_new, self.typical_answer_tokens())

        def fixed(cams, r, mode):
            if fixed_views:
                return self.predict(len(cams), 0, text_rows, 1.0, mode, 0, selects_views=False)
            rows = text_rows + len(cams) * (kept_count(tpc, r) if r < 1.0 else tpc)
            return self.predict(len(cams), len([c for c in cams if c not in cached]), rows, r, mode, 0)

        per_token = self.costs.token_ms

        steps = [(ranked[:n], keep_ratio) for n in range(len(ranked), 0, -1)]
        steps += [(ranked[:1], r) for r in KEEP_LADDER if r < keep_ratio]
        if fixed_views:
            steps = steps[:1]
        for cams, r in steps:
            mode = min({decoding, "greedy"}, key=per_token)          # greedy when it is the faster here
            affordable = math.floor((budget_ms - fixed(cams, r, mode)) / per_token(mode))
            if affordable >= target or (cams, r) == steps[-1]:
                cap = max(MIN_ANSWER_TOKENS, min(max_new, affordable))
                degraded = []
                if len(cams) < len(ranked):
                    degraded.append(f"views {len(ranked)}->{len(cams)}")
                if r < keep_ratio:
                    degraded.append(f"tokens {keep_ratio:g}->{r:g}")
                # (greedy in place of a draft tree where it is the faster is not listed: the answer
                # is token for token the same)
                predicted = fixed(cams, r, mode) + per_token(mode) * min(cap, target)
                plan = Plan(list(cams), r, mode, cap, predicted, degraded,
                            fits=fixed(cams, r, mode) + per_token(mode) * MIN_ANSWER_TOKENS <= budget_ms)
                plan.capped = cap < max_new
                return plan
        raise AssertionError("unreachable: the last step always returns")

    def typical_answer_tokens(self) -> int:
        lengths = sorted(self.costs.answer_lengths)
        return lengths[int(0.75 * (len(lengths) - 1))] if lengths else MIN_ANSWER_TOKENS
