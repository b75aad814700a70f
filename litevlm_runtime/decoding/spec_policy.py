"""The device cost model for speculation: which draft tree pays on this device, per round.

EAGLE-2 trees are free on a memory-bound GPU (verifying 60 rows costs about one row) and expensive
on a compute-bound CPU (60 rows cost many steps); a shallow decoder makes every draft level
expensive relative to a target step. So nothing is fixed: at warm-up `measure_costs` times, on
the actual device and backend,

    verify(T)    one target pass over T rows (decoder step + LM head), T in VERIFY_SIZES
    draft level  one draft step over k frontier rows (draft layer + LM head + top-k)
    pending(r)   the draft over the r pairs accepted since its last call

and per round the policy maximises expected tokens per millisecond. The expected number of
accepted tokens of a tree is 1 (the bonus) plus the sum over its nodes of the probability that
the node lies on the accepted path, which EAGLE-2 estimates by the node's cumulative draft
probability (its draft confidence); a running calibration factor (realised / predicted accepted
tokens) corrects it online. Decisions:

  expand     draft another level only if the best tree after it is expected to be faster
  total      verify the T best nodes that maximise (1 + c * sum p) / (draft ms + verify(T + 1))
  answers    speculate in an answer at all, by the realised decode time per token of whole answers
             with and without speculation (every cost included: the draft's catch-up over the
             prompt, plain steps before and between rounds, bookkeeping), kept across answers. The
             first answers alternate to measure both; then answers speculate while that is
             faster, else decode greedily with a probing answer now and then (every PROBE_EVERY
             answers, doubling up to PROBE_LIMIT while probes keep losing). Rounds alone cannot
             decide this: on a short answer the catch-up, paid once, is what loses (measured on
             the bundled model's LiteVLM prompts: rounds at 1.3 tokens per plain step, answers
             1.9x slower in the median)
  draft_now  draft at all: the draft's first call catches up on the whole prompt, a cost paid
             once per answer that a short answer never earns back, so an answer starts with plain
             steps until they have cost as much as the catch-up would (ski rental: never worse
             than twice the better choice in hindsight); after rounds whose expected rate lost to
             a plain step, back off (plain steps for 1, 2, 4 .. 16 tokens, then probe again); and
             never draft when even a perfectly accepted chain cannot beat a plain step here

Every estimate includes the round's own work outside the two models (tree bookkeeping, host
reads), measured online from the rounds' wall time. Greedy output is token-identical whatever the
policy chooses (verification is lossless).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..timing import median_ms

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
PENDING_SIZES = (1, 2, 4, 8)
MAX_BACKOFF = 16
CALIBRATION_BOUNDS = (0.05, 2.0)
PROBE_EVERY = 8          # while speculation loses, one answer in this many still speculates ...
PROBE_LIMIT = 64         # ... the interval doubling up to this while the probes keep losing
MIN_ANSWERS = 3          # answers of each kind (greedy, speculative) before their speeds decide
ANSWER_EMA = 0.2


def interpolate(table: dict[int, float], x: float) -> float:
    """Piecewise-linear in the measured sizes; linear extrapolation past the last two."""
    xs = sorted(table)
    if x <= xs[0] or len(xs) == 1:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return table[hi] + (table[hi] - table[lo]) * (x - hi) / (hi - lo)


@dataclass
class DeviceCosts:
    """Milliseconds measured on this device and backend, and the running acceptance statistics
    shared by every answer of one runtime."""

    verify_ms: dict[int, float]          # target pass over T rows -> ms
    draft_level_ms: float                # one draft level over top-k rows -> ms
    pending_ms: dict[int, float]         # draft over r pending pairs -> ms
    calibration: float = 1.0             # realised / predicted accepted tokens (EMA)
    overhead_ms: float = 0.0             # a round's wall time beyond the models' (EMA, measured online)
    speed: float = 1.0                   # realised tokens/ms of rounds over a plain step's (EMA)
    rounds: int = 0
    # Whole answers, per kind ("greedy", "eagle"): EMAs of decode ms and of tokens, and counts.
    answer_ms: dict = field(default_factory=lambda: {"greedy": 0.0, "eagle": 0.0})
    answer_tokens: dict = field(default_factory=lambda: {"greedy": 0.0, "eagle": 0.0})
    answers: dict = field(default_factory=lambda: {"greedy": 0, "eagle": 0})
    answers_since_probe: int = 0
    probe_every: int = PROBE_EVERY
    source: str = "measured"

    @property
    def step_ms(self) -> float:
        return self.verify_ms[min(self.verify_ms)]

    def carry_over(self, other: "DeviceCosts") -> None:
        """Keep the statistics learned online when the tables are measured again."""
        if other is not None and other.rounds:
            self.calibration, self.overhead_ms, self.speed, self.rounds = (
                other.calibration, other.overhead_ms, other.speed, other.rounds)
        if other is not None and any(other.answers.values()):
            self.answer_ms, self.answer_tokens, self.answers = (
                dict(other.answer_ms), dict(other.answer_tokens), dict(other.answers))
            self.answers_since_probe, self.probe_every = other.answers_since_probe, other.probe_every

    def verify(self, rows: int) -> float:
        return interpolate(self.verify_ms, rows)

    def pending(self, rows: int) -> float:
        return interpolate(self.pending_ms, rows)

    def best_chain_rate(self, max_depth: int) -> tuple[float, int]:
        """Tokens per ms of a perfectly accepted chain of depth d (the best any tree of that
        depth could do), maximised over d; (rate, d)."""
        best = (0.0, 0)
        for d in range(1, max_depth + 1):
            ms = self.pending(d) + (d - 1) * self.draft_level_ms + self.verify(d + 1) + self.overhead_ms
            best = max(best, ((d + 1) / ms, d))
        return best

    def speculation_can_pay(self, max_depth: int) -> bool:
        return self.best_chain_rate(max_depth)[0] > 1.0 / self.step_ms

    def observe_answer(self, kind: str, tokens: int, ms: float) -> None:
        """One answer's decode stage: `tokens` emitted in `ms` (wall clock), kind greedy|eagle."""
        a = ANSWER_EMA if self.answers[kind] else 1.0
        self.answer_ms[kind] = (1 - a) * self.answer_ms[kind] + a * ms
        self.answer_tokens[kind] = (1 - a) * self.answer_tokens[kind] + a * tokens
        self.answers[kind] += 1

    def answer_speed(self) -> float | None:
        """Greedy's decode ms per token over speculation's, whole answers (> 1: speculation is
        faster); None until both kinds have MIN_ANSWERS."""
        if min(self.answers.values()) < MIN_ANSWERS:
            return None
        per_token = {k: self.answer_ms[k] / max(self.answer_tokens[k], 1e-9) for k in self.answers}
        return per_token["greedy"] / max(per_token["eagle"], 1e-9)

    def speculate_this_answer(self, max_depth: int) -> bool:
        """EAGLE-2 for the next answer? Not where even a perfect chain loses to a plain step;
        while learning, every other answer; then while whole speculative answers are faster
        per token than greedy ones, else only a probe now and then (the acceptance of other
        questions may differ)."""
        if not self.speculation_can_pay(max_depth):
            return False
        speed = self.answer_speed()
        if speed is None:
            return self.answers["eagle"] <= self.answers["greedy"]
        if speed >= 1.0:
            self.answers_since_probe, self.probe_every = 0, PROBE_EVERY
            return True
        self.answers_since_probe += 1
        if self.answers_since_probe >= self.probe_every:
            self.answers_since_probe = 0
            self.probe_every = min(2 * self.probe_every, PROBE_LIMIT)
            return True
        return False

    def policy(self, tree) -> "TreePolicyState":
        return TreePolicyState(self, tree.total, tree.depth, tree.topk, adaptive=tree.policy.value == "adaptive")

    def table(self) -> list[list]:
        """Rows for `litevlm bench`: what each measured shape costs, relative to a plain step."""
        rows = [[f"verify {t} rows", ms, ms / self.step_ms] for t, ms in sorted(self.verify_ms.items())]
        rows += [[f"draft pending {r}", ms, ms / self.step_ms] for r, ms in sorted(self.pending_ms.items())]
        rows.append(["draft level (top-k rows)", self.draft_level_ms, self.draft_level_ms / self.step_ms])
        return rows


@dataclass
class TreePolicyState:
    """One answer's decisions over a DeviceCosts (its statistics are updated in place)."""

    costs: DeviceCosts
    max_total: int
    max_depth: int
    topk: int
    adaptive: bool = True
    backoff: int = 0                  # plain steps left before drafting again
    next_backoff: int = 1
    spent_ms: float = 0.0             # draft cost of the round so far (model, not wall clock)
    profile: list = field(default_factory=list)   # the root's children's probabilities, best first
    chosen: list = field(default_factory=list)

    # ------------------------------------------------------------------ decisions
    def start(self, prompt_rows: int) -> None:
        """A new answer over a prompt of `prompt_rows`: plain steps first for as long as they
        cost less than the draft's catch-up over the prompt (ski rental)."""
        if self.adaptive:
            self.backoff = math.ceil(self.costs.pending(prompt_rows) / self.costs.step_ms)

    def draft_now(self) -> bool:
        if not self.adaptive:
            return True
        if not self.costs.speculation_can_pay(self.max_depth):
            return False
        if self.backoff > 0:
            self.backoff -= 1
            return False
        return True

    def expected_rate(self, probs_desc: list[float], extra_ms: float = 0.0) -> tuple[float, int]:
        """max over T of (1 + c * sum of the T best node probabilities) / (drafting + verify(T + 1)):
        (rate in tokens per ms, T). Plain floats: a few dozen candidates."""
        c, base = self.costs.calibration, self.spent_ms + extra_ms + self.costs.overhead_ms
        best, mass = (0.0, 1), 0.0
        for t, p in enumerate(probs_desc[:self.max_total], start=1):
            mass += p
            best = max(best, ((1.0 + c * mass) / (base + self.costs.verify(t + 1)), t))
        return best

    def expand(self, scores: torch.Tensor, frontier_scores: torch.Tensor, level: int) -> bool:
        """Draft level `level + 1`? `scores`: cumulative log-probabilities of every candidate so far,
        `frontier_scores`: those of the nodes that would be expanded."""
        if not self.adaptive:
            return True
        probs = sorted(scores.float().exp().tolist(), reverse=True)
        if level == 1:
            self.profile = probs[:self.topk]             # the root's children, best first
        now, _ = self.expected_rate(probs)
        # The next level adds each frontier node's top-k children; their cumulative probabilities
        # are estimated as the frontier node's times the root's children's profile (a draft's
        # confidence pattern repeats down the tree more than it varies).
        guess = [f * c for f in frontier_scores.float().exp().tolist() for c in self.profile]
        after, _ = self.expected_rate(sorted(probs + guess, reverse=True), self.costs.draft_level_ms)
        go = after > now
        if go:
            self.spent_ms += self.costs.draft_level_ms
        return go

    def choose_total(self, scores: torch.Tensor, limit: int) -> int:
        """How many of the candidates (besides the root) to verify."""
        n = min(limit, int(scores.shape[0]))
        if not self.adaptive:
            return n
        _, total = self.expected_rate(sorted(scores.float().exp().tolist(), reverse=True)[:n])
        return total

    # ------------------------------------------------------------------ statistics
    def observe_pending(self, rows: int, seconds: float) -> None:
        # A round's draft starts with the pairs accepted since the last draft call; the first
        # round's catch-up over the whole prompt is paid once per answer, not per round, so the
        # per-round rate counts what a steady round pays.
        self.spent_ms = self.costs.pending(min(rows, self.max_depth + 1))

    def observe_draft(self, rows: int, seconds: float) -> None:
        pass   # wall-clock noise per level is larger than the effect; the warm-up table stands

    def observe_step(self, seconds: float) -> None:
        pass

    def observe_round(self, tree, accepted: int, verify_seconds: float, round_seconds: float) -> None:
        c = self.costs
        predicted = float(tree.scores[1:].float().exp().sum())
        if predicted > 1e-6:
            ratio = min(max(accepted / predicted, CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1])
            c.calibration = 0.9 * c.calibration + 0.1 * ratio
        t = len(tree)
        if round_seconds > 0:
            modelled = self.spent_ms + c.verify(t)
            c.overhead_ms = 0.8 * c.overhead_ms + 0.2 * max(0.0, round_seconds * 1000.0 - modelled)
            c.speed = 0.8 * c.speed + 0.2 * ((accepted + 1) / (round_seconds * 1000.0)) * c.step_ms
        c.rounds += 1
        # Did this round's shape (under the updated calibration) beat a plain step? If not, back off.
        expected = (1.0 + c.calibration * predicted) / (self.spent_ms + c.verify(t) + c.overhead_ms)
        self.chosen.append((int(tree.depths.max()), t))
        if self.adaptive and expected < 1.0 / c.step_ms:
            self.backoff, self.next_backoff = self.next_backoff, min(2 * self.next_backoff, MAX_BACKOFF)
        else:
            self.next_backoff = 1


# ---------------------------------------------------------------------- measurement
@torch.inference_mode()
def measure_costs(rt, context: int | None = None, repeats: int = 5) -> DeviceCosts:
    """Time the target's verification of T rows, one draft level and the draft over pending
    pairs on this runtime's device and backend, with `context` earlier cache rows (default: half
    the longest prompt). Uses scratch slots after the context; leaves no state a query reads."""
    a, e = rt.arena, rt.engines
    tree = rt.options.decoding.eagle
    context = min(context or a.max_prompt // 2, a.max_len - max(VERIFY_SIZES) - 1)
    d = rt.cfg.llm.hidden_size
    x = torch.zeros(max(VERIFY_SIZES + PENDING_SIZES + (tree.topk,)), d, dtype=rt.dtype, device=rt.device)
    sizes = [t for t in VERIFY_SIZES if t <= a.limits.tree_tokens]

    def verify(t):
        def run():
            a.positions[context:context + t] = context
            hidden = e.decoder.step(x[:t], a.positions[context:context + t], a.slots[context:context + t],
                                    a.all_visible(t, context), a.causal_mask(t))
            e.head.run(hidden).argmax(-1)
        return run

    verify_ms = {t: median_ms(verify(t), repeats, rt.device) for t in sizes}
    if e.draft is None:
        return DeviceCosts(verify_ms, math.inf, {r: math.inf for r in PENDING_SIZES})

    def draft(rows, topk=False):
        def run():
            hidden = e.draft.step(x[:rows], x[:rows], a.positions[context:context + rows],
                                  a.slots[context:context + rows], a.all_visible(rows, context), a.causal_mask(rows))
            lp = torch.log_softmax(e.head.run(hidden).float(), dim=-1)
            if topk:
                lp.topk(tree.topk, dim=-1)
        return run

    pending_ms = {r: median_ms(draft(r), repeats, rt.device) for r in PENDING_SIZES}
    level_ms = median_ms(draft(tree.topk, topk=True), repeats, rt.device)
    return DeviceCosts(verify_ms, level_ms, pending_ms)
