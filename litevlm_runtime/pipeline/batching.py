"""In-flight batching: up to `serving.max_batch` queries decoded together, one decoder pass per
step over every running query (Orca's iteration-level scheduling, on the static arena).

    batch = BatchDecoder(pipeline)
    batch.admit(images, request, ...)      every stage up to prefill, into a free KV region
    batch.step()                           one decoder pass over every running query -> finished Answers

Each query of a batch owns one KV region of the arena (`k_regions[r]`, sized once from max_batch
at start-up: `Runtime.region`) and keeps its own slots, positions, mask row, answer cap, budget
plan, temperature and generator (its QueryState; the runtime is shared, never copied). Admission is
prefill-then-join: a query arriving while
others decode runs view selection .. prefill on its own (the single-query stages, unchanged,
writing its region) and joins at the next step. Mixed steps (its prefill rows and the others'
decode rows in one pass) were measured and lose here: `litevlm bench --study batch_costs`, docs/serving.md.

A step over B queries runs the one layer forward with rows [B, D]; each row attends to its own
region only (models/decoder.py, attend_batched). A finished query (EOS or its cap) leaves at once
and its Answer is returned by that step; its region is free for the next admission.

A query running alone decodes as an unbatched one would (EAGLE-2 when the speculation policy
chooses it, else greedy single steps) until another query is waiting (`waiting()`); then it
stops after its current pass and carries on in batched greedy steps. Greedy verification is
lossless, so a greedy answer is token for token the same whichever way it was decoded. Inside a
batch the steps are greedy: `batch_speculates` compares, from the measured speculation costs and
the acceptance realised so far, what a batched greedy step yields per millisecond with what one
query's speculation does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..decoding.greedy import Decoded, Prompt, choose, greedy
from ..decoding.speculative import eagle2, speculates
from .answer import Answer
from .pipeline import Pipeline, QueryState
from .request import QueryRequest


def batch_speculates(costs, rows: int, max_depth: int) -> bool:
    """Would speculation pay against a batched greedy step of `rows` queries? The speculative
    rate one query realises (tokens per ms of its EAGLE-2 rounds so far: `costs.speed` plain
    steps' worth per step; before any round, the best a perfectly accepted chain could do)
    against one batched greedy step: `rows` tokens in verify(rows) ms. Alone (rows 1) the
    answer-level policy decides (spec_policy.py). This is the measurement behind batched steps
    being greedy (`litevlm bench --study batch_costs` prints it; docs/serving.md): trees of several queries
    in one verification pass are not built."""
    if costs is None:
        return False
    if rows <= 1:
        return True
    speculative = costs.speed / costs.step_ms if costs.rounds else costs.best_chain_rate(max_depth)[0]
    return speculative > rows / costs.verify(rows)


# The batching policy's constants (BatchPolicy).
BATCH_EMA = 0.25          # weight of the newest measurement in the running per-token costs
MIN_OBSERVED = 4          # lone decodes and batched steps seen before the costs decide
PROBE_EVERY = 8           # one at a time: every this many answers, one batch is let form again ...
PROBE_LIMIT = 64          # ... the interval doubling up to this while the probes keep losing
# The mode changes only when the costs differ by more than this fraction: beside busy processes a
# batched step cost about what its rows did alone (34-54 against 35-59 ms per token on the bundled
# model), and without it the mode flipped with every few answers.
BATCH_MARGIN = 0.1


@dataclass
class BatchPolicy:
    """Whether in-flight batching pays at the present load, measured as it runs (as the speculation
    policy measures EAGLE-2's rounds against plain steps: decoding/spec_policy.py).

    A batched step costs more than a lone one, and pays only when it costs less than its rows would
    alone: `batched_ms` is the running wall-clock cost per token of batched steps (a step's ms over
    its rows), `lone_ms` the same of a query decoding alone (greedy steps, or EAGLE-2 where the
    speculation policy chose it: per token emitted). Both are EMAs of the node's own steps, so they
    move with the load of the machine it shares: on a quiet 2-core CPU a step of 4 rows cost 1.5x
    one row (0.38 of four single steps), and there batching paid 1.35x; beside busy processes the
    same node lost to one at a time (0.59x of max_batch 1's peak rate, issue 42).

      batched         a query waiting joins the running ones at their next step (BatchDecoder)
      one_at_a_time   the running query decodes alone to its end; the next waits (max_batch 1's way)

    It starts batched. While one at a time, a batch is let form again every PROBE_EVERY answers
    (doubling up to PROBE_LIMIT while such probes keep losing) so that a load that went away is
    noticed. `why` says the figures behind the mode (/diagnostics)."""

    lone_ms: float = 0.0
    batched_ms: float = 0.0
    lone_seen: int = 0
    batched_seen: int = 0
    rows_seen: float = 0.0              # EMA of the rows of batched steps
    mode: str = "batched"
    why: str = "batched until both costs are measured"
    answers_since_probe: int = 0
    probe_every: int = PROBE_EVERY
    probing: bool = False

    def observe_lone(self, tokens: int, ms: float) -> None:
        """A query decoded `tokens` tokens alone in `ms` (wall clock)."""
        if tokens > 0 and ms > 0:
            a = BATCH_EMA if self.lone_seen else 1.0
            self.lone_ms = (1 - a) * self.lone_ms + a * ms / tokens
            self.lone_seen += 1

    def observe_batched(self, rows: int, ms: float) -> None:
        """One batched step over `rows` queries took `ms` (wall clock): a token for each."""
        if rows > 1 and ms > 0:
            a = BATCH_EMA if self.batched_seen else 1.0
            self.batched_ms = (1 - a) * self.batched_ms + a * ms / rows
            self.rows_seen = (1 - a) * self.rows_seen + a * rows
            self.batched_seen += 1

    @property
    def batching(self) -> bool:
        """Whether a waiting query may join running ones now."""
        return self.mode == "batched" or self.probing

    def answered(self) -> None:
        """An answer was published: decide again; one at a time, count toward the next probe."""
        self.probing = False
        if min(self.lone_seen, self.batched_seen) < MIN_OBSERVED:
            return
        # Within the margin the mode stays: batched while a batched token costs under 1.1x a lone one,
        # one at a time until it costs under 0.9x.
        pays = self.batched_ms < self.lone_ms * (1 + BATCH_MARGIN if self.mode == "batched" else 1 - BATCH_MARGIN)
        figures = (f"batched steps {self.batched_ms:.2f} ms per token ({self.rows_seen:.1f} rows on average) "
                   f"against {self.lone_ms:.2f} ms alone")
        if pays:
            self.mode, self.why = "batched", f"{figures}: batching pays"
            self.answers_since_probe, self.probe_every = 0, PROBE_EVERY
            return
        if self.mode == "batched":
            self.mode, self.answers_since_probe = "one_at_a_time", 0
        elif self.answers_since_probe == 0:        # the probe just made lost again: probe less often
            self.probe_every = min(2 * self.probe_every, PROBE_LIMIT)
        self.why = f"{figures}: one at a time (a batch is tried again every {self.probe_every} answers)"
        self.answers_since_probe += 1
        if self.answers_since_probe >= self.probe_every:
            self.answers_since_probe, self.probing = 0, True

    def describe(self) -> dict:
        return {"mode": self.mode, "why": self.why, "lone_ms_per_token": round(self.lone_ms, 3),
                "batched_ms_per_token": round(self.batched_ms, 3), "rows": round(self.rows_seen, 2)}


@dataclass
class Running:
    """One query of the batch after prefill."""
    q: QueryState
    region: int
    tokens: list[int]                 # the answer so far (EOS excluded); the last is not yet in the cache
    slot: int                         # its cache slot in the region
    position: int                     # its RoPE position
    decoded_as: str                   # greedy | eagle: how it decodes while alone
    on_tokens: object = None
    tag: object = None                # the caller's (the server's request)
    steps: int = 0
    rounds: list = field(default_factory=list)
    fresh: bool = True                # nothing decoded yet and the arena's prompt scratch is still its own
    accepted: float = 1.0             # tokens per pass of its unbatched decoding (EAGLE-2 > 1)
    emitted: int = 0                  # tokens already shown to on_tokens
    done: bool = False
    start_mark: object = None

    @property
    def max_new(self) -> int:
        return self.q.plan.max_new_tokens


class BatchDecoder:
    def __init__(self, pipe: Pipeline, policy: BatchPolicy | None = None):
        rt = pipe.rt
        self.pipe, self.rt = pipe, rt
        self.policy = policy if policy is not None else BatchPolicy()   # sees every step's cost
        self.engine = rt.engines.batch            # the backend's batched step (engines/base.py)
        self.capacity = rt.arena.limits.batch if self.engine is not None else 1
        self.free = list(range(self.capacity))
        self.running: list[Running] = []
        self.finished: list[tuple[Running, Answer]] = []

    @property
    def has_room(self) -> bool:
        return bool(self.free)

    def __len__(self) -> int:
        return len(self.running)

    @torch.inference_mode()
    def admit(self, images: dict, request: QueryRequest | str, frame_keys: Mapping | None = None, on_tokens=None,
              tag=None) -> Running:
        """View selection .. prefill for one query into a free region; it joins the next step.
        Raises what Pipeline.answer raises (InputError ...), the region then stays free. A query
        whose first token ends it is finished at once (in `finished`, returned by the next step)."""
        region = self.free.pop(0)
        try:
            q = self.pipe.begin(images, request, frame_keys, region=region)
        except BaseException:
            self.free.insert(0, region)
            self.free.sort()
            raise
        for other in self.running:
            other.fresh = False                # the prompt scratch (embeds) is this query's now
        prompt, plan = q.prompt, q.plan
        speculate = plan.decoding == "eagle" and speculates(self.rt)
        r = Running(q, region, [], prompt.length, prompt.next_pos, "eagle" if speculate else "greedy",
                    on_tokens, tag, start_mark=q.timer.mark())
        if prompt.first in self.rt.tok.eos_ids or plan.max_new_tokens <= 0:
            self._finish(r)
        else:
            r.tokens.append(prompt.first)
            self._emit(r)
            if len(r.tokens) >= r.max_new:
                self._finish(r)
            else:
                self.running.append(r)
        return r

    @torch.inference_mode()
    def step(self, waiting=lambda: False) -> list[tuple[Running, Answer]]:
        """One decode pass: a lone query decodes unbatched until `waiting()` says a query wants
        to join; two or more: one batched greedy step. Returns the queries finished since the
        last call, with their Answers."""
        if len(self.running) == 1:
            self._alone(self.running[0], waiting)
        elif self.running:
            self._batched()
        done, self.finished = self.finished, []
        return done

    def run(self, waiting=lambda: False) -> list[tuple[Running, Answer]]:
        """Step until every running query is finished."""
        out = []
        while self.running:
            out += self.step(waiting)
        return out + self.step(waiting)

    # ------------------------------------------------------------------ decoding
    def _alone(self, r: Running, waiting) -> None:
        """The decoder an unbatched query would run, from where `r` is, until it ends or a query
        waits. EAGLE-2 only from the prompt (its draft catches up from the prompt's features)."""
        rt = self.rt
        prefix = r.tokens[:-1]

        def on_tokens(ids):
            r.tokens = prefix + list(ids)
            self._emit(r)

        t0 = time.perf_counter()
        kind = "eagle" if r.decoded_as == "eagle" and r.fresh and not r.steps else "greedy"
        if kind == "eagle":
            out = eagle2(rt, r.q.decoding, r.q.prompt, r.max_new, on_tokens, stop=waiting)
        else:
            prompt = Prompt(length=r.slot, next_pos=r.position, first=r.tokens[-1], hidden=None,
                            input_tokens=0, kept_tokens=0)
            out = greedy(rt, r.q.decoding, prompt, r.max_new - len(prefix), on_tokens, stop=waiting)
        ms = (time.perf_counter() - t0) * 1000
        if out.resume is not None and r.q.plan.decoding == "eagle" and rt.costs is not None:
            # Stopped for a query that joins: what it decoded alone teaches the speculation policy
            # as a whole answer of that kind would (an answer that ends alone teaches at finish).
            # Under load most answers end batched, and without this a batching node's policy kept
            # learning (speculating on every other lone answer) long after a max_batch 1 node's had
            # settled: lone answers 1.3x slower where EAGLE-2 loses (docs/serving.md).
            rt.costs.observe_answer(kind, len(out.tokens), ms)
        self.policy.observe_lone(len(out.tokens) - 1, ms)      # (the first was emitted before this call)
        r.fresh = False
        r.tokens = prefix + out.tokens
        r.accepted = out.accepted
        r.steps += out.steps
        r.rounds += out.rounds
        if out.resume is None:
            self._finish(r)
        else:
            _, r.slot, r.position = out.resume

    def _batched(self) -> None:
        """One decoder pass over every running query: row b is region b (a free region inside
        the span runs a dummy row that sees only itself)."""
        a, rt = self.rt.arena, self.rt
        span = max(r.region for r in self.running) + 1
        live = max(r.slot for r in self.running)
        tokens, positions, slots = a.batch_tokens[:span], a.batch_positions[:span], a.batch_slots[:span]
        mask = a.batch_mask[:span, :live]
        mask.fill_(False)
        tokens.zero_(), positions.zero_()
        slots.fill_(a.max_len - 1)              # a free region's scratch slot (written before any read)
        for r in self.running:
            tokens[r.region], positions[r.region], slots[r.region] = r.tokens[-1], r.position, r.slot
            mask[r.region, :r.slot] = True
        t0 = time.perf_counter()
        hidden = self.engine.step(rt.lm.embed(tokens), positions, slots, mask, a.batch_eye[:span, :span])
        logits = rt.engines.head.run(hidden)
        eos, rows = rt.tok.eos_ids, len(self.running)
        for r in list(self.running):
            nxt = choose(r.q.decoding, logits[r.region:r.region + 1])
            r.steps += 1
            r.rounds.append("batched")
            r.slot, r.position, r.fresh = r.slot + 1, r.position + 1, False
            if nxt in eos:
                self._finish(r)
                continue
            r.tokens.append(nxt)
            self._emit(r)
            if len(r.tokens) >= r.max_new:
                self._finish(r)
        self.policy.observe_batched(rows, (time.perf_counter() - t0) * 1000)

    def preempt(self, r: Running) -> None:
        """Take running query `r` out of the batch unfinished (a waiting query outranks it): its
        region is free at once and its state is dropped; the caller runs its request again later,
        from its start (the same answer: greedy, or sampling from its own seed)."""
        if r.done:
            return
        r.done = True
        self.running.remove(r)
        self.free.append(r.region)
        self.free.sort()

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, r: Running) -> None:
        if r.on_tokens is not None and len(r.tokens) > r.emitted:
            r.emitted = len(r.tokens)
            r.on_tokens(list(r.tokens))

    def _finish(self, r: Running) -> None:
        if r.done:
            return
        r.done = True
        timer = r.q.timer
        timer.record("decode", r.start_mark, timer.mark())
        if r in self.running:
            self.running.remove(r)
        self.free.append(r.region)
        self.free.sort()                        # lowest regions first: the batched span stays short
        batched = any(x == "batched" for x in r.rounds)
        emitted = len(r.tokens) - 1 + int(len(r.tokens) < r.max_new)      # the EOS that ended it counts
        accepted = (emitted / r.steps if r.steps else 1.0) if batched else r.accepted
        out = Decoded(list(r.tokens), r.steps, accepted, [x for x in r.rounds if x != "batched"])
        # The speculation policy learns from answers decoded the one way only.
        ans = self.pipe.finish(r.q, out, None if batched else r.decoded_as, learn_costs=not batched)
        if batched:
            ans.batched_steps = sum(1 for x in r.rounds if x == "batched")
        self.finished.append((r, ans))
