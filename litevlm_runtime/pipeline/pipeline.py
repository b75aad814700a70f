"""The LiteVLM pipeline for one query, top to bottom (`Pipeline.answer`):

    view select -> preprocess -> vision -> token select -> prefill -> decode

Each stage is a function of the runtime context (runtime.py: model, tokenizer, arena, engines,
device, built once) that reads and writes arena buffers, is timed, and is reported in the Answer.
Which modules run is the resolved configuration's business (options.py): by default the LiteVLM
pipeline, with every module the model folder carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..decoding.greedy import Prompt, QueryDecoding, choose, greedy
from ..decoding.spec_policy import measure_costs
from ..decoding.speculative import eagle2, speculates
from ..engines.base import KVRegion
from ..errors import InputError, LiteVLMError
from ..options import DecodingMode, PipelineOptions
from ..stages.budget import Plan
from ..stages.preprocess import load_image, to_tiles_uint8
from ..stages.prompt import build_prompt, prompt_digest
from ..stages.token_selector import PromptLayout
from ..stages.view_selector import keyword_map
from ..timing import StageTimer
from .answer import Answer, object_fields
from .conversation import Turn
from .explanation import QueryTrace, prompt_trace
from .request import QueryRequest
from .runtime import Runtime, build_runtime


@dataclass
class QueryState:
    """One query's own state, from its first stage to its Answer: the request it answers, its
    decoding state (KV region, sampling generator, constraint matcher), the conversation turn it
    continues, and what each stage left for the next. The runtime is shared and never copied."""
    request: QueryRequest
    decoding: QueryDecoding
    timer: StageTimer
    frame_keys: Mapping | None                 # camera -> what identifies its image (visual reuse, follow-ups)
    max_new: int                               # the answer cap before any budget cut
    budget_ms: float
    turn: Turn | None = None                   # the answered turn it continues (a follow-up)
    history: tuple = ()                        # the earlier turns of its conversation, (question, answer) oldest first
    plan: Plan | None = None
    reused: list[str] = field(default_factory=list)   # cameras whose visual features came from the feature cache
    encoded: int = 0  # cameras the vision stage ran for
    keep: list | None = None  # per camera, the visual tokens kept (its conversation's first question chose them)
    prompt: Prompt | None = None
    prompt_sha256: str = ""                    # of the full prompt's ids (stages/prompt.py prompt_digest)
    rows: list | None = None                   # (token id, position) of its prefill rows, when it is to be kept
    trace: QueryTrace | None = None            # what its explanation reads, when its request asks for one

    @property
    def region(self) -> KVRegion:
        return self.decoding.region


class Pipeline:
    def __init__(self, rt: Runtime):
        self.rt = rt

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: PipelineOptions | None = None) -> "Pipeline":
        return cls(build_runtime(model_dir, options))

    @classmethod
    def from_model(cls, model, tokenizer, options: PipelineOptions | None = None, **kwargs) -> "Pipeline":
        return cls(Runtime.from_model(model, tokenizer, options or PipelineOptions(), **kwargs))

    @property
    def options(self) -> PipelineOptions:
        return self.rt.options

    @property
    def name(self) -> str:
        return self.rt.name

    # ---------------------------------------------------------------- the query, top to bottom
    @torch.inference_mode()
    def answer(self, images: dict, request: QueryRequest | str, *, frame_keys: Mapping | None = None,
               on_tokens=None, decoder=None) -> Answer:
        """One query (request.py; a plain question is the request of its text). `frame_keys`
        (camera -> what identifies its image, e.g. the frame's stamp) lets later questions about
        the same frames reuse their visual features and follow up on its answer; `on_tokens(ids so
        far)` sees the answer as it is decoded; `decoder` (decoding.greedy, speculative.eagle2)
        overrides the configured decoding for this call.

        Conversations (conversation.py): `request.history`, the (question, answer) turns asked
        earlier about these images, makes the query their next turn, computed from scratch;
        `request.keep_turn` keeps the answered query under its id, and a later request with
        `follow_up_of` that id (with the same images and frame keys) continues that conversation,
        reusing its KV and its first question's views and visual tokens. Both give the prompt
        upstream's `chat(history=)` builds."""
        q = self.begin(images, request, frame_keys)
        rt, plan = self.rt, q.plan
        with q.timer("decode"):
            speculate = decoder is None and plan.decoding == "eagle" and speculates(rt)
            decode = decoder or (eagle2 if speculate else greedy)
            out = decode(rt, q.decoding, q.prompt, plan.max_new_tokens, on_tokens)
        return self.finish(q, out, ("eagle" if speculate else "greedy") if decoder is None else None)

    def begin(self, images: dict, request: QueryRequest | str, frame_keys: Mapping | None = None,
              region: int = 0) -> QueryState:
        """Every stage of one query up to and including prefill (the first answer token chosen):
        what `answer` decodes from, and what the batch scheduler (batching.py) admits. `region`:
        the arena's KV region prefill writes (the batch decoder gives each query its own)."""
        rt = self.rt
        q = start_query(rt, QueryRequest.of(request).checked(rt), frame_keys, region)
        turn, timer = q.turn, q.timer
        first = q.history[0][0] if q.history else q.request.question     # the question the images came with

        with timer("view_select"):
            if turn is None:
                cameras = select_views(rt, first)
                q.plan = plan_query(rt, first, cameras, frame_keys, q.budget_ms, q.max_new)  # fewer/less if over budget
            else:
                q.plan = plan_follow_up(rt, turn, q.request.question, q.budget_ms, q.max_new)   # its conversation's
        plan = q.plan
        check_images(images, plan.cameras)
        in_kv = plan.cameras if turn is not None and rt.fastv is None else []   # their rows come with the turn's KV
        cached = cached_visual(rt, [c for c in plan.cameras if c not in in_kv], frame_keys)  # from earlier queries
        todo = [c for c in plan.cameras if c not in cached and c not in in_kv]
        skipped = bool(in_kv) and not todo              # a follow-up: no vision at all (reported 0 ms)
        with timer("preprocess", idle=skipped):
            pixels = preprocess(rt, images, todo)
        with timer("vision", idle=skipped):
            visual = encode(rt, pixels, todo, cached, plan.cameras, frame_keys)   # per camera [tokens, D] or None
        with timer("token_select"):
            if turn is None:      # the first question's own prompt: what its visual tokens are ranked against
                layout = assemble_prompt(rt, plan.cameras, first, visual)
                q.keep = select_tokens(rt, layout, plan.keep_ratio)   # per camera: kept token indices
            else:
                q.keep = turn.keep  # the conversation's (its first question chose them)
            if q.history:         # the whole conversation, as upstream builds it
                layout = assemble_prompt(rt, plan.cameras, q.request.question, visual, q.history)
        with timer("prefill"):
            q.prompt = prefill(rt, q.region, layout, q.keep, turn, q.decoding)
        followable = q.request.keep_turn and rt.conversations.keeps(
            len(q.history) + 1
        )  # (at max_turns: none may follow)
        q.rows = prompt_rows(rt, q.prompt.length) if followable else None
        q.prompt_sha256 = prompt_digest(rt.arena.prompt_ids[:layout.length].tolist())    # what assemble_prompt wrote
        if q.request.explain and not q.history:        # (a conversation's prompt is not explained yet)
            q.trace = prompt_trace(rt, first, plan.cameras, layout, q.prompt.length)   # before the arena is reused
        q.reused = [c for c in plan.cameras if c in cached or c in in_kv]
        q.encoded = len(todo)
        return q

    def finish(self, q: QueryState, out, decoded_as: str | None, learn_costs: bool = True) -> Answer:
        """The Answer of a decoded query; `decoded_as` (greedy | eagle, None: a decoder the caller
        chose) teaches the speculation policy from whole answers; `learn_costs` False: the
        latency-budget planner does not learn from it (a batched answer's decode stage spans
        other queries' work)."""
        rt, plan, prompt, max_new = self.rt, q.plan, q.prompt, q.max_new
        stage_ms = q.timer.milliseconds()  # (one device sync, after the last stage)
        if (
            decoded_as is not None and plan.decoding == "eagle" and rt.costs is not None
        ):  # the policy learns from whole answers of both kinds
            rt.costs.observe_answer(decoded_as, len(out.tokens), stage_ms["decode"])
        if plan.capped and len(out.tokens) >= plan.max_new_tokens:      # the budget's cap cut the answer
            plan.degraded.append(f"answer cut at {plan.max_new_tokens} tokens (cap {max_new})")
        constraint = q.decoding.constraint
        if constraint is not None and not constraint.complete:
            plan.degraded.append(f"constrained answer incomplete: cut at {len(out.tokens)} tokens "
                                 f"({constraint.what} not finished)")

        text = rt.tok.decode(out.tokens).strip()
        ans = Answer(
            question=q.request.question,
            text=text,
            token_ids=out.tokens,
            stage_ms=stage_ms,
            cameras=list(plan.cameras),
            visual_tokens=len(plan.cameras) * rt.tokens_per_camera,
            kept_tokens=prompt.kept_tokens,
            input_tokens=prompt.input_tokens,
            decode_steps=out.steps,
            accepted_length=out.accepted,
            pipeline=rt.options.label(),
            reused_cameras=list(q.reused),
            degraded=list(plan.degraded),
            budget_ms=q.budget_ms,
            turn=len(q.history) + 1,
            reused_tokens=prompt.reused,
            prompt_sha256=q.prompt_sha256,
            **object_fields(q.request.question, text, rt.options.cameras),
            extra={"rounds": out.rounds} if out.rounds else {},
            trace=q.trace.with_answer(text, out.tokens) if q.trace is not None else None,
        )
        if learn_costs and not prompt.reused:          # (a follow-up's prefill is not the planner's model of one)
            rt.planner.costs.observe(ans, q.encoded, plan.decoding)
        if q.request.keep_turn:
            keep_turn(rt, q, out.tokens, ans.text)
        return ans

    def warm_up(self, images: dict | None = None) -> Answer:
        """One synthetic query (black frames), then the speculation cost table measured on this
        device and backend at that prompt length (speculative.py uses it per round)."""
        rt = self.rt
        images = images or {c: np.zeros((448, 448, 3), dtype=np.uint8) for c in rt.options.cameras}
        ans = self.answer(images, "warm-up: describe the scene.")
        rt.planner.measure()                          # the latency-budget planner's stage costs
        if rt.options.decoding.mode == DecodingMode.EAGLE:
            learned = rt.costs                        # what the warm-up answer's rounds measured online
            rt.costs = measure_costs(rt, context=ans.input_tokens)
            rt.costs.carry_over(learned)
        return ans

    @torch.inference_mode()
    def prefetch(self, images, frame_keys, stop=lambda: False) -> list[str]:
        """Encode into the feature cache, one camera at a time, every camera of this frame set
        not there yet (the node does this when it is idle after a query, so that the frame set's
        later questions find every view encoded); `stop()` is checked between cameras (a query
        arrived). Returns the cameras encoded. A camera whose image fails is left for a query to
        report."""
        rt = self.rt
        if rt.features is None:
            return []
        done = []
        for cam in rt.options.cameras:
            if stop():
                break
            if cam not in images or cam not in frame_keys or (cam, frame_keys[cam]) in rt.features.index:
                continue
            try:
                encode(rt, preprocess(rt, images, [cam]), [cam], {}, [cam], frame_keys)
            except InputError:
                continue
            done.append(cam)
        return done

    @torch.inference_mode()
    def reference_inputs(self, images: dict, question: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [1, T] with `<IMG_CONTEXT>` placeholders, pixels [tiles, 3, S, S]) of the query
        as this pipeline would see it, for feeding a reference implementation the same inputs."""
        rt = self.rt
        cameras = sorted(select_views(rt, question), key=list(rt.options.cameras).index)
        ids, _ = prompt_ids(rt, cameras, question)
        return torch.tensor([ids]), preprocess(rt, images, cameras).clone()


# ---------------------------------------------------------------- stages
def start_query(rt: Runtime, request: QueryRequest, frame_keys: Mapping | None, region: int) -> QueryState:
    """A checked request's per-query state: its KV region, its own generator (the same query,
    the same draws: seeded with its seed or decoding.seed), its constraint's matcher, the turn
    it follows (looked up again: it may have expired since the request was checked), its caps."""
    options = rt.options
    temperature = request.temperature or options.decoding.temperature
    sampler = torch.Generator(device="cpu").manual_seed(request.seed or options.decoding.seed) if temperature > 0 \
        else None
    decoding = QueryDecoding(rt.region(region), temperature, sampler,
                             request.grammar.start() if request.grammar is not None else None)
    turn = rt.conversations.follow(request.follow_up_of, frame_keys) if request.follow_up_of else None
    max_new = min(request.max_new_tokens or options.max_new_tokens, rt.arena.limits.new_tokens)
    budget = request.budget_ms or options.serving.latency_budget_ms
    return QueryState(request, decoding, StageTimer(rt.device), frame_keys, max_new, float(budget), turn,
                      turn.history if turn is not None else request.history)


def check_images(images, cameras: list[str]) -> None:
    missing = [c for c in cameras if c not in images]
    if missing:
        raise InputError(f"no image for camera(s) {', '.join(missing)}", camera=missing[0])


def select_views(rt: Runtime, question: str) -> list[str]:
    """The cameras the question needs, most needed first (the view selector's scores, or the
    keyword map's where there is none; rig order among equals): what a latency budget drops last."""

    rig = list(rt.options.cameras)
    if rt.view_selector is None:
        chosen, scores = rig, keyword_map(question)
    else:
        selection = rt.view_selector.explain(question)
        chosen, scores = [c for c in selection.cameras if c in rig] or rig, selection.scores
    return sorted(chosen, key=lambda c: (-scores.get(c, 0.0), rig.index(c)))


def plan_query(rt: Runtime, question: str, cameras: list[str], frame_keys: dict | None, budget_ms: float,
               max_new: int) -> Plan:
    """What this query runs: the configured pipeline, or (with a budget) the least degraded plan
    predicted to fit it (budget.py). `cameras`: the selection, most needed first; the plan's
    cameras come back in rig order (the prompt's)."""
    configured = "eagle" if rt.options.decoding.mode == DecodingMode.EAGLE else "greedy"
    keep = rt.options.tokens.keep_ratio if rt.token_selector is not None else 1.0
    rig = list(rt.options.cameras)
    if not budget_ms:
        return Plan(sorted(cameras, key=rig.index), keep, configured, max_new, 0.0)
    cached = {c for c in cameras if rt.features is not None and frame_keys and c in frame_keys
              and (c, frame_keys[c]) in rt.features.index}
    text_rows = len(prompt_ids(rt, cameras, question)[0]) - len(cameras) * rt.tokens_per_camera
    plan = rt.planner.plan(budget_ms, list(cameras), cached, keep, configured, max_new, text_rows)
    plan.cameras.sort(key=rig.index)
    if not plan.fits:
        plan.degraded.append(f"budget {budget_ms:g} ms cannot be met (coarsest plan: {plan.predicted_ms:.0f} ms)")
    return plan


def plan_follow_up(rt: Runtime, turn: Turn, question: str, budget_ms: float, max_new: int) -> Plan:
    """A follow-up's plan: its conversation's views and kept tokens (its first question chose
    them), decoded with plain steps (EAGLE-2's draft cache is not kept with a conversation, and
    greedy EAGLE-2 answers are these token for token). A latency budget can only cut the answer:
    prefill is predicted over the rows that follow the turn's KV."""
    plan = Plan(list(turn.cameras), turn.keep_ratio, "greedy", max_new, 0.0)
    if budget_ms:
        ids, spans = prompt_ids(rt, plan.cameras, question, turn.history)
        rows = len(ids) - sum(count - len(k) for (_, count), k in zip(spans, turn.keep)) - len(turn.rows)
        plan = rt.planner.plan(budget_ms, plan.cameras, set(plan.cameras), plan.keep_ratio, "greedy", max_new,
                               max(1, rows), fixed_views=True)
        if not plan.fits:
            plan.degraded.append(f"budget {budget_ms:g} ms cannot be met (coarsest plan: {plan.predicted_ms:.0f} ms)")
    return plan


def cached_visual(rt: Runtime, cameras: list[str], frame_keys: dict | None) -> dict:
    if rt.features is None or not frame_keys:
        return {}
    found = {c: rt.features.get(c, frame_keys[c]) for c in cameras if c in frame_keys}
    return {c: v for c, v in found.items() if v is not None}


def preprocess(rt: Runtime, images: dict, cameras: list[str]) -> torch.Tensor:
    a, tpc, s = rt.arena, rt.options.tiles_per_camera, rt.cfg.force_image_size
    limits = rt.options.images
    for i, cam in enumerate(cameras):
        if images[cam] is None:
            raise InputError(f"no image for camera(s) {cam}", camera=cam)
        img = load_image(images[cam], cam, (s * tpc, s), limits.max_pixels, limits.jpeg_draft)
        to_tiles_uint8(img, s, tpc, a.pixels_u8[i * tpc:(i + 1) * tpc])
    n = len(cameras) * tpc
    return rt.normalize(a.pixels_u8[:n], a.pixels[:n])


def encode(rt: Runtime, pixels: torch.Tensor, todo: list[str] | None = None, cached: dict | None = None,
           cameras: list[str] | None = None, frame_keys: dict | None = None) -> list[torch.Tensor | None]:
    """Visual tokens per camera of `cameras` [tokens_per_camera, D]: the cameras in `todo` through
    the vision engine (their tiles in `pixels`, and into the feature cache when it has a key for
    them), the others from `cached`; None for a camera in neither (a follow-up's: its rows are in
    the KV it continues)."""
    todo = list(todo) if todo is not None else list(rt.options.cameras)[:pixels.shape[0] // rt.options.tiles_per_camera]
    cameras, cached = cameras or todo, cached or {}
    out = rt.arena.visual[:pixels.shape[0]]
    if todo:
        out.copy_(rt.engines.vision.run(pixels))
    fresh = dict(zip(todo, out.view(len(todo), rt.tokens_per_camera, rt.cfg.llm.hidden_size)))
    if rt.features is not None and frame_keys:
        fresh = {c: rt.features.put(c, frame_keys[c], v) if c in frame_keys else v for c, v in fresh.items()}
    return [cached[c] if c in cached else fresh.get(c) for c in cameras]


def prompt_ids(rt: Runtime, cameras: list[str], question: str, history=()) -> tuple[list[int], list[tuple[int, int]]]:
    """The full prompt's token ids with `<IMG_CONTEXT>` placeholders, and each camera's (start, count)."""
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera,
                          history)
    return list(prompt.input_ids), list(prompt.image_spans)


def assemble_prompt(rt: Runtime, cameras: list[str], question: str, visual, history=()) -> PromptLayout:
    """Write the full prompt, [template, <img> every visual token </img> per camera, question]
    (with `history`: the conversation it continues), as ids + embeddings into the arena once: the
    token selector reads it, prefill gathers the kept rows from it. Row index = original position
    id. A camera whose `visual` is None keeps its rows unwritten (a follow-up's: they are in the KV)."""
    a = rt.arena
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera,
                          history)
    n = len(prompt.input_ids)
    if n > a.max_prompt:      # (only a conversation can be: the arena holds serving.max_turns whole turns)
        raise InputError(f"the conversation's prompt has {n} rows; the arena holds {a.max_prompt} (sized by "
                         "max_question_tokens, max_new_tokens and serving.max_turns)", about="question")
    a.prompt_ids[:n].copy_(torch.tensor(prompt.input_ids, dtype=torch.long, device=rt.device))
    embeds = a.prompt_embeds[:n]
    rt.lm.embed.lookup(a.prompt_ids[:n], embeds)
    for cam_index, (start, count) in enumerate(prompt.image_spans):
        if visual[cam_index] is not None:
            embeds[start:start + count] = visual[cam_index]
    return PromptLayout(n, list(prompt.image_spans), prompt.question_span)


def select_tokens(rt: Runtime, layout: PromptLayout, keep_ratio: float | None = None) -> list[torch.Tensor]:
    """Per camera, the indices of the visual tokens to keep (ascending)."""
    a = rt.arena
    keep_ratio = rt.options.tokens.keep_ratio if keep_ratio is None else keep_ratio
    if rt.token_selector is None or keep_ratio >= 1.0:
        return [a.slots[:count] for _, count in layout.spans]
    n = layout.length
    return rt.token_selector.select(a.prompt_embeds[:n], a.slots[:n], layout, keep_ratio, rt.options.tokens.scope)


def prefill(rt: Runtime, region: KVRegion, layout: PromptLayout, keep: list[torch.Tensor], turn: Turn | None = None,
            decoding: QueryDecoding | None = None) -> Prompt:
    """Gather [template, <img> kept visual </img> per camera, question] from the assembled full
    prompt into the arena, run the decoder over it, and choose the first answer token. A
    follow-up (`turn`: the answered turn it continues) takes the KV of the rows it begins with
    from that turn's slot and runs the decoder over the rest only (conversation.py); any other
    query takes the KV of the prompt prefix every query shares, where the engine can run the rest
    in one call (prefix.py).

    Kept visual tokens keep their original position ids: a row's position is its index in the
    full prompt, as if every visual token were present. The prompt's KV goes to `region`; the first
    token is chosen under `decoding` (the query's sampling and constraint; default argmax).
    """
    a = rt.arena
    rows = a.kept_rows                    # full-prompt row of each prefill row
    n = cursor = 0
    visual_ranges = []                    # (first prefill row, count) of each camera's kept tokens
    for (start, count), k in zip(layout.spans, keep):
        m = start - cursor
        rows[n:n + m] = a.slots[cursor:start]
        n += m
        rows[n:n + len(k)] = k + start
        visual_ranges.append((n, len(k)))
        n += len(k)
        cursor = start + count
    m = layout.length - cursor
    rows[n:n + m] = a.slots[cursor:layout.length]
    n += m
    rows = rows[:n]
    torch.index_select(a.prompt_ids[:layout.length], 0, rows, out=a.token_ids[:n])
    torch.index_select(a.prompt_embeds[:layout.length], 0, rows, out=a.embeds[:n])
    a.positions[:n].copy_(rows)
    embeds, positions, mask = a.embeds[:n], a.positions[:n], a.causal_mask(n)
    kept = sum(c for _, c in visual_ranges)
    input_tokens = n
    reused = shared = 0
    if rt.fastv is not None:              # (FastV's per-layer pruning is one prompt's: no KV is reused)
        visual_rows = torch.cat([a.slots[s:s + c] for s, c in visual_ranges])
        hidden, fastv_rows, kept = rt.fastv.prune(embeds, positions, mask, visual_rows)
        input_tokens = len(fastv_rows)   # rows the layers >= K see
    elif turn is not None:
        reused = rt.conversations.restore(turn, prompt_rows(rt, n), region.k, region.v)
        if visual_ranges and reused < sum(visual_ranges[-1]):   # (the follow-up wrote no visual rows)
            raise LiteVLMError(f"follow-up: only {reused} rows of the turn it follows match its prompt, fewer than "
                               f"its {sum(visual_ranges[-1])} rows up to the last visual token")
        hidden = extend(rt, region, embeds[reused:], positions[reused:], reused)
        input_tokens = n - reused
    elif rt.prefix is not None and region.decoder.extends_prompt and (     # (engines may be rebound: calibration)
            shared := rt.prefix.restore(a.token_ids[:n], visual_ranges[0][0] if visual_ranges else n, region.k,
                                        region.v)):
        rest = region.decoder.prefill_after(embeds[shared:], positions[shared:], a.slots[shared:n],
                                            a.all_visible(n - shared, shared), a.causal_mask(n - shared))
        hidden = torch.cat([rt.prefix.hidden[:shared], rest])       # every row's: EAGLE-2's draft reads them
    else:
        hidden = region.decoder.prefill(embeds, positions, mask)
    first = choose(decoding or QueryDecoding(region), rt.engines.head.run(hidden[-1:]))
    return Prompt(length=n, next_pos=layout.length, first=first, hidden=None if reused else hidden,
                  input_tokens=input_tokens, kept_tokens=kept, reused=reused, shared=shared)


def prompt_rows(rt: Runtime, n: int) -> list[tuple[int, int]]:
    """(token id, position) of the n prefill rows in the arena: what a kept turn's KV rows are."""
    a = rt.arena
    return list(zip(a.token_ids[:n].tolist(), a.positions[:n].tolist()))


def extend(rt: Runtime, region: KVRegion, embeds: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
    """The decoder over prompt rows [start, start + T) (embeds [T, D], positions [T]) after a
    cache that holds rows [0, start): decode steps of many rows, each attending to every cached
    row and causally among its own, in calls of at most the decoder engine's largest step bucket
    (a graph backend's). Returns the last call's final-norm features (the last row's is what the
    first answer token is chosen from)."""
    a = rt.arena
    t = embeds.shape[0]
    most = max(getattr(region.decoder, "sizes", None) or (t,))
    for i in range(0, t, most):
        rows = min(most, t - i)
        s = start + i
        hidden = region.decoder.step(embeds[i:i + rows], positions[i:i + rows], a.slots[s:s + rows],
                                     a.all_visible(rows, s), a.causal_mask(rows))
    return hidden


def keep_turn(rt: Runtime, q: QueryState, tokens: list[int], text: str) -> None:
    """Keep an answered query for follow-ups under its id: its conversation so far and the rows its
    KV holds, the prompt's, then the answer tokens that entered the cache (each token is fed to the
    decoder to choose the next: all of them when the end token ended the answer, all but the last
    when the cap did)."""
    plan, prompt = q.plan, q.prompt
    in_cache = tokens if len(tokens) < plan.max_new_tokens else tokens[:-1]
    rows = [] if q.rows is None else q.rows + [(t, prompt.next_pos + i) for i, t in enumerate(in_cache)]
    turn = Turn(q.history + ((q.request.question, text),), tuple(plan.cameras), q.keep, plan.keep_ratio,
                q.frame_keys, rows)
    rt.conversations.keep(q.request.query_id, turn, q.region.k, q.region.v)
