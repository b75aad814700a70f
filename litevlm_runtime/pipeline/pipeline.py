"""The LiteVLM pipeline for one query, top to bottom (`Pipeline.answer`):

    view select -> preprocess -> vision -> token select -> prefill -> decode

A query is answered from K frame sets (frame_sets.py: oldest first, the key set last; K = 1 is one
camera -> image mapping, as always). View selection also chooses how many of them the question
needs (camera x time); each (camera, frame) view is encoded once while it is in the feature cache's
window; token selection keeps, of the older sets, only the tokens that changed (stages/temporal.py);
the prompt holds each camera's frames as upstream's video chat does (stages/prompt.py).

Each stage is a function of the runtime context (runtime.py: model, tokenizer, arena, engines,
device, built once) that reads and writes arena buffers, is timed, and is reported in the Answer.
Which modules run is the resolved configuration's business (options.py): by default the LiteVLM
pipeline, with every module the model folder carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
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
from ..stages.motion import tiles_motion
from ..stages.preprocess import load_image, to_tiles_uint8
from ..stages.prompt import build_prompt, prompt_digest
from ..stages.temporal import changed_tokens
from ..stages.token_selector import PromptLayout
from ..stages.view_selector import keyword_map, time_cue
from ..timing import StageTimer
from .answer import Answer, object_fields
from .conversation import Turn
from .explanation import QueryTrace, prompt_trace
from .frame_sets import FrameSet, frame_sets_of
from .request import QueryRequest
from .runtime import Runtime, build_runtime

View = tuple[str, int]          # (camera, frame set: 0 the query's oldest, K - 1 its newest)


@dataclass
class QueryState:
    """One query's own state, from its first stage to its Answer: the request it answers, its
    decoding state (KV region, sampling generator, constraint matcher), the conversation turn it
    continues, and what each stage left for the next. The runtime is shared and never copied."""
    request: QueryRequest
    decoding: QueryDecoding
    timer: StageTimer
    sets: tuple[FrameSet, ...]                 # its frame sets, oldest first (the newest `request.frames`)
    max_new: int                               # the answer cap before any budget cut
    budget_ms: float
    turn: Turn | None = None                   # the answered turn it continues (a follow-up)
    history: tuple = ()                        # the earlier turns of its conversation, (question, answer) oldest first
    plan: Plan | None = None
    views: list[View] = field(default_factory=list)   # (camera, frame set) in prompt order: camera by camera
    reused: list[View] = field(default_factory=list)  # views whose visual features came from the feature cache
    encoded: int = 0  # views the vision stage ran for
    keep: list | None = None  # per view, the visual tokens kept (its conversation's first question chose them)
    prompt: Prompt | None = None
    prompt_sha256: str = ""                    # of the full prompt's ids (stages/prompt.py prompt_digest)
    rows: list | None = None                   # (token id, position) of its prefill rows, when it is to be kept
    trace: QueryTrace | None = None            # what its explanation reads, when its request asks for one

    @property
    def region(self) -> KVRegion:
        return self.decoding.region

    @property
    def frame_keys(self) -> Mapping | None:
        """The newest frame set's keys (what a follow-up is about)."""
        return self.sets[-1].keys


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
    def answer(self, images: Mapping | Sequence[FrameSet], request: QueryRequest | str, *,
               frame_keys: Mapping | None = None, on_tokens=None, decoder=None) -> Answer:
        """One query (request.py; a plain question is the request of its text). `images`: one frame
        set (camera -> image), or the query's frame sets oldest first (frame_sets.py), of which it
        uses the newest `request.frames`. `frame_keys` (camera -> what identifies its image, e.g.
        the frame's stamp; a FrameSet carries its own) lets later questions about the same frames
        reuse their visual features and follow up on its answer; `on_tokens(ids so far)` sees the
        answer as it is decoded; `decoder` (decoding.greedy, speculative.eagle2) overrides the
        configured decoding for this call.

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

    def begin(self, images: Mapping | Sequence[FrameSet], request: QueryRequest | str,
              frame_keys: Mapping | None = None, region: int = 0) -> QueryState:
        """Every stage of one query up to and including prefill (the first answer token chosen):
        what `answer` decodes from, and what the batch scheduler (batching.py) admits. `region`:
        the arena's KV region prefill writes (the batch decoder gives each query its own)."""
        rt = self.rt
        q = start_query(rt, QueryRequest.of(request).checked(rt), frame_sets_of(images, frame_keys), region)
        turn, timer = q.turn, q.timer
        first = q.history[0][0] if q.history else q.request.question     # the question the images came with

        with timer("view_select"):
            if turn is None:
                cameras = select_views(rt, first)
                frames = select_frames(rt, first, len(q.sets))           # camera x time: how many sets it needs
                q.plan = plan_query(rt, first, cameras, frames, q.sets, q.budget_ms, q.max_new)  # fewer if over budget
            else:
                q.plan = plan_follow_up(rt, turn, q.request.question, q.budget_ms, q.max_new)   # its conversation's
        plan = q.plan
        if len(q.sets) < plan.frames:     # a follow-up given the newest set only: the others' rows are in the KV
            q.sets = (FrameSet({}),) * (plan.frames - len(q.sets)) + q.sets
        q.views = views = query_views(plan.cameras, plan.frames, len(q.sets))
        in_kv = views if turn is not None and rt.fastv is None else []   # their rows come with the turn's KV
        check_images(q.sets, [v for v in views if v not in in_kv or v[1] == len(q.sets) - 1])   # (the newest: always)
        cached = cached_visual(rt, [v for v in views if v not in in_kv], q.sets)   # from earlier queries
        todo = [v for v in views if v not in cached and v not in in_kv]
        skipped = bool(in_kv) and not todo              # a follow-up: no vision at all (reported 0 ms)
        visual = dict(cached)                           # view -> [tokens, D]
        for chunk in vision_calls(rt, todo):            # one frame set's worth of tiles per call
            with timer("preprocess", idle=skipped):
                pixels = preprocess_views(rt, q.sets, chunk)
                keep_grey_tiles(rt, q.sets, chunk)
            with timer("vision", idle=skipped):
                visual |= encode_views(rt, pixels, chunk, q.sets)
        visual = [visual.get(v) for v in views]         # per view, prompt order; None: its rows are in the KV
        with timer("vision", idle=skipped):             # a model with motion/: the newest sets' plus motion
            shown = with_motion(rt, q.sets, views, visual) if turn is None and plan.frames > 1 else visual
        with timer("token_select"):
            if turn is None:      # the first question's own prompt: what its visual tokens are ranked against
                layout = assemble_prompt(rt, plan.cameras, first, shown, frames=plan.frames)
                q.keep = select_tokens(rt, layout, plan.keep_ratio, views, visual)   # per view: kept token indices
            else:
                q.keep = turn.keep  # the conversation's (its first question chose them)
            if q.history:         # the whole conversation, as upstream builds it
                layout = assemble_prompt(rt, plan.cameras, q.request.question, shown, q.history, plan.frames)
        with timer("prefill"):
            q.prompt = prefill(rt, q.region, layout, q.keep, turn, q.decoding)
        followable = q.request.keep_turn and rt.conversations.keeps(
            len(q.history) + 1
        )  # (at max_turns: none may follow)
        q.rows = prompt_rows(rt, q.prompt.length) if followable else None
        q.prompt_sha256 = prompt_digest(rt.arena.prompt_ids[:layout.length].tolist())    # what assemble_prompt wrote
        if q.request.explain and not q.history:        # (a conversation's prompt is not explained yet)
            q.trace = prompt_trace(rt, first, plan.cameras, layout, q.prompt.length, plan.frames)
        q.reused = [v for v in views if v in cached or v in in_kv]
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
            visual_tokens=len(q.views) * rt.tokens_per_camera,
            kept_tokens=prompt.kept_tokens,
            input_tokens=prompt.input_tokens,
            decode_steps=out.steps,
            accepted_length=out.accepted,
            pipeline=rt.options.label(),
            reused_cameras=[c for c in plan.cameras if (c, q.views[-1][1]) in q.reused],   # of the newest set
            degraded=list(plan.degraded),
            budget_ms=q.budget_ms,
            turn=len(q.history) + 1,
            reused_tokens=prompt.reused,
            prompt_sha256=q.prompt_sha256,
            **object_fields(q.request.question, text, rt.options.cameras),
            extra={"rounds": out.rounds} if out.rounds else {},
            trace=q.trace.with_answer(text, out.tokens) if q.trace is not None else None,
            frames=plan.frames,
            encoded_views=q.encoded,
            reused_views=len(q.reused),
            kept_per_frame=kept_per_frame(q.views, q.keep, plan.frames),
        )
        if learn_costs and not prompt.reused and plan.frames == 1:  # (a follow-up's or a K-frame prefill is not
            rt.planner.costs.observe(ans, q.encoded, plan.decoding)   # the planner's model of one)
        if q.request.keep_turn:
            keep_turn(rt, q, out.tokens, ans.text)
        return ans

    def warm_up(self, images: dict | None = None) -> Answer:
        """One synthetic query (black frames), then the speculation cost table measured on this
        device and backend at that prompt length (speculative.py uses it per round)."""
        rt = self.rt
        images = images or {c: np.zeros((448, 448, 3), dtype=np.uint8) for c in rt.options.cameras}
        ans = self.answer(images, QueryRequest("warm-up: describe the scene.", frames=1))   # (one set, whatever
        # temporal.frames says: the node warms up before any frames came)
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
        if rt.features is None or not rt.features.reuse:
            return []
        done = []
        for cam in rt.options.cameras:
            if stop():
                break
            if cam not in images or cam not in frame_keys or rt.features.has(cam, frame_keys[cam]):
                continue
            try:
                pixels = preprocess(rt, images, [cam])
                keep_grey_tiles(rt, (FrameSet(images, frame_keys),), [(cam, 0)])     # (a model with motion/)
                encode(rt, pixels, [cam], {}, [cam], frame_keys)
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
def start_query(rt: Runtime, request: QueryRequest, sets: tuple[FrameSet, ...], region: int) -> QueryState:
    """A checked request's per-query state: its frame sets (the newest it asks for), its KV
    region, its own generator (the same query, the same draws: seeded with its seed or
    decoding.seed), its constraint's matcher, the turn it follows (looked up again: it may have
    expired since the request was checked), its caps."""
    options = rt.options
    asked = request.frames or options.temporal.frames
    if len(sets) < asked and request.follow_up_of == "":
        raise InputError(f"the query asks for {asked} frame sets; {len(sets)} given (oldest first, the newest "
                         f"last)", about="image")
    if not request.follow_up_of:       # (a follow-up's are its turn's, their rows in its KV: query_views)
        sets = sets[-asked:]
    temperature = request.temperature or options.decoding.temperature
    sampler = torch.Generator(device="cpu").manual_seed(request.seed or options.decoding.seed) if temperature > 0 \
        else None
    decoding = QueryDecoding(rt.region(region), temperature, sampler,
                             request.grammar.start() if request.grammar is not None else None)
    turn = rt.conversations.follow(request.follow_up_of, sets[-1].keys) if request.follow_up_of else None
    max_new = min(request.max_new_tokens or options.max_new_tokens, rt.arena.limits.new_tokens)
    budget = request.budget_ms or options.serving.latency_budget_ms
    return QueryState(request, decoding, StageTimer(rt.device), sets, max_new, float(budget), turn,
                      turn.history if turn is not None else request.history)


def query_views(cameras: list[str], frames: int, sets: int) -> list[View]:
    """The (camera, frame set) views of a query in prompt order: camera by camera (rig order), each
    camera's newest `frames` sets oldest first (of `sets`, the newest last)."""
    return [(cam, t) for cam in cameras for t in range(sets - frames, sets)]


def check_images(sets: tuple[FrameSet, ...], views: list[View]) -> None:
    missing = [(c, t) for c, t in views if c not in sets[t].images]
    if missing:
        cam, t = missing[0]
        when = "" if len(sets) == 1 else f" in frame set t-{len(sets) - 1 - t}"
        raise InputError(f"no image for camera(s) {', '.join(dict.fromkeys(c for c, _ in missing))}{when}",
                         camera=cam)


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


def select_frames(rt: Runtime, question: str, asked: int) -> int:
    """How many of the `asked` frame sets (the newest last) the question needs, 1 .. asked: every
    one (temporal.mode all), or the time selector's (the view selector's time head fused with the
    time cue; the cue alone where the selector has no time head or there is no selector)."""
    if asked == 1 or rt.options.temporal.mode == "all":
        return asked
    if rt.view_selector is not None:
        past = rt.view_selector.explain(question).past_frames
    else:
        past = None if time_cue(question) else 0
    return asked if past is None else 1 + min(past, asked - 1)


def plan_query(rt: Runtime, question: str, cameras: list[str], frames: int, sets: tuple[FrameSet, ...],
               budget_ms: float, max_new: int) -> Plan:
    """What this query runs: the configured pipeline, or (with a budget) the least degraded plan
    predicted to fit it (budget.py). `cameras`: the selection, most needed first; the plan's
    cameras come back in rig order (the prompt's). `frames`: the frame sets the question needs (a
    budget plans the newest one only when it cannot afford them: `frames K->1`)."""
    configured = "eagle" if rt.options.decoding.mode == DecodingMode.EAGLE else "greedy"
    keep = rt.options.tokens.keep_ratio if rt.token_selector is not None else 1.0
    rig = list(rt.options.cameras)
    if not budget_ms:
        return Plan(sorted(cameras, key=rig.index), keep, configured, max_new, 0.0, frames=frames)
    keys = sets[-1].keys
    cached = {c for c in cameras if rt.features is not None and keys and c in keys and rt.features.has(c, keys[c])}
    text_rows = len(prompt_ids(rt, cameras, question)[0]) - len(cameras) * rt.tokens_per_camera
    plan = rt.planner.plan(budget_ms, list(cameras), cached, keep, configured, max_new, text_rows)
    plan.cameras.sort(key=rig.index)
    if frames > 1:    # (the planner's cost model is one frame set's: a budget answers from the newest only)
        plan.degraded.insert(0, f"frames {frames}->1")
    if not plan.fits:
        plan.degraded.append(f"budget {budget_ms:g} ms cannot be met (coarsest plan: {plan.predicted_ms:.0f} ms)")
    return plan


def plan_follow_up(rt: Runtime, turn: Turn, question: str, budget_ms: float, max_new: int) -> Plan:
    """A follow-up's plan: its conversation's views and kept tokens (its first question chose
    them), decoded with plain steps (EAGLE-2's draft cache is not kept with a conversation, and
    greedy EAGLE-2 answers are these token for token). A latency budget can only cut the answer:
    prefill is predicted over the rows that follow the turn's KV."""
    plan = Plan(list(turn.cameras), turn.keep_ratio, "greedy", max_new, 0.0, frames=turn.frames)
    if budget_ms:
        ids, spans = prompt_ids(rt, plan.cameras, question, turn.history, turn.frames)
        rows = len(ids) - sum(count - len(k) for (_, count), k in zip(spans, turn.keep)) - len(turn.rows)
        plan = rt.planner.plan(budget_ms, plan.cameras, set(plan.cameras), plan.keep_ratio, "greedy", max_new,
                               max(1, rows), fixed_views=True)
        plan.frames = turn.frames
        if not plan.fits:
            plan.degraded.append(f"budget {budget_ms:g} ms cannot be met (coarsest plan: {plan.predicted_ms:.0f} ms)")
    return plan


def cached_visual(rt: Runtime, views: list[View], sets: tuple[FrameSet, ...]) -> dict[View, torch.Tensor]:
    """The views whose visual features the feature cache holds (by their frame set's key)."""
    if rt.features is None:
        return {}
    found = {(c, t): rt.features.get(c, sets[t].keys[c]) for c, t in views if sets[t].keys and c in sets[t].keys}
    return {v: f for v, f in found.items() if f is not None}


def vision_calls(rt: Runtime, todo: list[View]) -> list[list[View]]:
    """The views to encode, in calls of at most one frame set's tiles (the vision engine's and the
    arena's pixel buffers' size); one call with nothing when there is nothing (every answer
    reports the preprocess and vision stages)."""
    most = rt.arena.limits.cameras
    return [todo[i:i + most] for i in range(0, len(todo), most)] or [[]]


def preprocess_views(rt: Runtime, sets: tuple[FrameSet, ...], views: list[View]) -> torch.Tensor:
    """The normalised tiles of `views` [views * tiles_per_camera, 3, S, S] in the arena."""
    return preprocess_images(rt, [(c, sets[t].images[c]) for c, t in views])


def preprocess(rt: Runtime, images: dict, cameras: list[str]) -> torch.Tensor:
    return preprocess_images(rt, [(c, images[c]) for c in cameras])


def preprocess_images(rt: Runtime, images: list[tuple[str, object]]) -> torch.Tensor:
    """(camera, image) pairs, decoded and cut into tiles in the arena's pixel buffers, normalised."""
    a, tpc, s = rt.arena, rt.options.tiles_per_camera, rt.cfg.force_image_size
    limits = rt.options.images
    if len(images) * tpc > a.pixels_u8.shape[0]:      # (callers split into vision_calls)
        raise LiteVLMError(f"{len(images)} images in one vision call; the arena holds {a.limits.cameras}")
    for i, (cam, image) in enumerate(images):
        if image is None:
            raise InputError(f"no image for camera(s) {cam}", camera=cam)
        img = load_image(image, cam, (s * tpc, s), limits.max_pixels, limits.jpeg_draft)
        to_tiles_uint8(img, s, tpc, a.pixels_u8[i * tpc:(i + 1) * tpc])
    n = len(images) * tpc
    return rt.normalize(a.pixels_u8[:n], a.pixels[:n])


def frame_key(sets: tuple[FrameSet, ...], view: View):
    """What identifies a view's frame (its set's key for the camera), or None: the set has none."""
    camera, t = view
    return (sets[t].keys or {}).get(camera)


def keep_grey_tiles(rt: Runtime, sets: tuple[FrameSet, ...], views: list[View]) -> None:
    """A model with motion/: the grey tiles of the views just cut (in the arena's uint8 buffers)."""
    if rt.motion_cache is None:
        return
    tpc = rt.options.tiles_per_camera
    for i, view in enumerate(views):
        rt.motion_cache.put(view[0], frame_key(sets, view), rt.arena.pixels_u8[i * tpc:(i + 1) * tpc])


def grey_tiles_of(rt: Runtime, sets: tuple[FrameSet, ...], view: View) -> list:
    """A view's grey tiles: kept when it was cut, else its image cut again (its features were reused
    from before the model's grey tiles were kept, or it has no frame key)."""
    found = rt.motion_cache.get(view[0], frame_key(sets, view))
    if found is not None:
        return found
    preprocess_views(rt, sets, [view])
    return rt.motion_cache.put(view[0], frame_key(sets, view), rt.arena.pixels_u8[:rt.options.tiles_per_camera])


def with_motion(rt: Runtime, sets: tuple[FrameSet, ...], views: list[View], visual: list) -> list:
    """`visual` with, for a model with motion/ (stages/motion.py), each camera's newest set's tokens
    plus what its network makes of the flow from the previous set; every other view as it is."""
    if rt.model.motion is None:
        return visual
    newest, grid = len(sets) - 1, rt.cfg.tokens_per_side
    shown = list(visual)
    for i, (c, t) in enumerate(views):
        if t == newest and visual[i] is not None:
            now, before = (c, t), (c, t - 1)
            motion = rt.motion_cache.flow(c, frame_key(sets, now), frame_key(sets, before), lambda: (
                tiles_motion(grey_tiles_of(rt, sets, now), grey_tiles_of(rt, sets, before), grid)))
            shown[i] = visual[i] + rt.model.motion(motion.to(rt.device)).to(visual[i].dtype)
    return shown


def encode_views(rt: Runtime, pixels: torch.Tensor, views: list[View],
                 sets: tuple[FrameSet, ...]) -> dict[View, torch.Tensor]:
    """Visual tokens [tokens_per_camera, D] of `views` (their tiles in `pixels`) through the vision
    engine, and into the feature cache under their frame set's key where there is one (a K-frame
    query's views always have one: frame_sets.py; the cache holds its window)."""
    if not views:
        return {}
    out = rt.arena.visual[:pixels.shape[0]]
    out.copy_(rt.engines.vision.run(pixels))
    fresh = out.view(len(views), rt.tokens_per_camera, rt.cfg.llm.hidden_size)
    keyed = rt.features is not None
    return {(c, t): rt.features.put(c, sets[t].keys[c], v) if keyed and c in (sets[t].keys or {}) else v
            for (c, t), v in zip(views, fresh)}


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


def prompt_ids(rt: Runtime, cameras: list[str], question: str, history=(),
               frames: int = 1) -> tuple[list[int], list[tuple[int, int]]]:
    """The full prompt's token ids with `<IMG_CONTEXT>` placeholders, and each view's (start, count)."""
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera,
                          history, frames)
    return list(prompt.input_ids), list(prompt.image_spans)


def assemble_prompt(rt: Runtime, cameras: list[str], question: str, visual, history=(),
                    frames: int = 1) -> PromptLayout:
    """Write the full prompt, [template, <img> every visual token </img> per view, question] (with
    `history`: the conversation it continues; with `frames` > 1, each camera's frames oldest
    first), as ids + embeddings into the arena once: the token selector reads it, prefill gathers
    the kept rows from it. Row index = original position id. A view whose `visual` is None keeps
    its rows unwritten (a follow-up's: they are in the KV)."""
    a = rt.arena
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera,
                          history, frames)
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


def select_tokens(rt: Runtime, layout: PromptLayout, keep_ratio: float | None = None, views: list[View] | None = None,
                  visual: list | None = None) -> list[torch.Tensor]:
    """Per view, the indices of the visual tokens to keep (ascending): the newest frame set's by
    the token selector (ranked against the question), an older set's by change against the newest
    set at the same camera and position (stages/temporal.py)."""
    a = rt.arena
    keep_ratio = rt.options.tokens.keep_ratio if keep_ratio is None else keep_ratio
    views = views or [(None, 0)] * len(layout.spans)
    newest = max(t for _, t in views)
    key_spans = [span for span, (_, t) in zip(layout.spans, views) if t == newest]
    if rt.token_selector is None or keep_ratio >= 1.0:
        key_keep = [a.slots[:count] for _, count in key_spans]
    else:
        n = layout.length
        key_keep = rt.token_selector.select(a.prompt_embeds[:n], a.slots[:n], replace(layout, spans=key_spans),
                                            keep_ratio, rt.options.tokens.scope)
    key_visual = {c: v for (c, t), v in zip(views, visual or [None] * len(views)) if t == newest}
    threshold = rt.options.temporal.change_threshold
    kept, key_keep = [], iter(key_keep)
    for (c, t), (_, count), v in zip(views, layout.spans, visual or [None] * len(views)):
        kept.append(next(key_keep) if t == newest else changed_tokens(v, key_visual[c], threshold))
    return kept


def kept_per_frame(views: list[View], keep: list[torch.Tensor], frames: int) -> list[int]:
    """Visual tokens kept per frame set, oldest first, over every camera."""
    newest = max(t for _, t in views)
    out = [0] * frames
    for (_, t), k in zip(views, keep):
        out[frames - 1 - (newest - t)] += len(k)
    return out


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
                q.frame_keys, rows, frames=plan.frames)
    rt.conversations.keep(q.request.query_id, turn, q.region.k, q.region.v)
