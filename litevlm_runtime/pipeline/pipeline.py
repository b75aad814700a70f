"""The LiteVLM pipeline for one query, top to bottom (`Pipeline.answer`):

    view select -> preprocess -> vision -> token select -> prefill -> decode

Each stage is a function of the runtime context (runtime.py: model, tokenizer, arena, engines,
device, built once) that reads and writes arena buffers, is timed, and is reported in the Answer.
Which modules run is the resolved configuration's business (options.py): by default the LiteVLM
pipeline, with every module the model folder carries.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .answer import Answer
from ..stages.budget import Plan
from ..decoding.greedy import Prompt, choose, greedy
from ..errors import InputError
from ..options import DecodingMode, PipelineOptions
from ..stages.preprocess import load_image, to_tiles_uint8
from .runtime import Runtime, build_runtime
from ..decoding.speculative import eagle2, speculates
from ..timing import StageTimer
from ..stages.token_selector import PromptLayout
from ..stages.prompt import build_prompt
from ..weights.tokenizer import SPECIAL_TOKENS

INVISIBLE = {"\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"}     # zero-width characters


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
    def answer(self, images: dict, question: str, max_new_tokens: int | None = None, on_tokens=None,
               decoder=None, frame_keys: dict | None = None, budget_ms: float = 0.0) -> Answer:
        """One query. `frame_keys` (camera -> what identifies its image, e.g. the frame's stamp)
        lets later questions about the same frames reuse their visual features; `budget_ms` (0:
        the configured default, none) makes the plan fit a latency budget; `on_tokens(ids so far)`
        sees the answer as it is decoded; `decoder` (decoding.greedy, speculative.eagle2)
        overrides the configured decoding for this call."""
        rt = self.rt
        check_question(rt, question)
        max_new = min(max_new_tokens or rt.options.max_new_tokens, rt.arena.limits.new_tokens)
        rt.sampler.manual_seed(rt.options.decoding.seed)   # sampling: the same query, the same answer
        budget = budget_ms or rt.options.serving.latency_budget_ms
        timer = StageTimer(rt.device)

        with timer("view_select"):
            cameras = select_views(rt, question)
            plan = plan_query(rt, question, cameras, frame_keys, budget, max_new)   # fewer/less if over budget
        check_images(images, plan.cameras)
        cached = cached_visual(rt, plan.cameras, frame_keys)  # camera -> visual tokens from earlier queries
        todo = [c for c in plan.cameras if c not in cached]
        with timer("preprocess"):
            pixels = preprocess(rt, images, todo)
        with timer("vision"):
            visual = encode(rt, pixels, todo, cached, plan.cameras, frame_keys)   # per camera [tokens, D]
        with timer("token_select"):
            layout = assemble_prompt(rt, plan.cameras, question, visual)   # full prompt, in the arena
            keep = select_tokens(rt, layout, plan.keep_ratio)  # per camera: kept token indices
        with timer("prefill"):
            prompt = prefill(rt, layout, keep)
        with timer("decode"):
            speculate = decoder is None and plan.decoding == "eagle" and speculates(rt)
            decode = decoder or (eagle2 if speculate else greedy)
            out = decode(rt, prompt, plan.max_new_tokens, on_tokens)
        stage_ms = timer.milliseconds()                       # (one device sync, after the last stage)
        if decoder is None and plan.decoding == "eagle" and rt.costs is not None:    # the policy learns from whole answers of both kinds
            rt.costs.observe_answer("eagle" if speculate else "greedy", len(out.tokens), stage_ms["decode"])
        if plan.capped and len(out.tokens) >= plan.max_new_tokens:      # the budget's cap cut the answer
            plan.degraded.append(f"answer cut at {plan.max_new_tokens} tokens (cap {max_new})")

        ans = Answer(
            question=question,
            text=rt.tok.decode(out.tokens).strip(),
            token_ids=out.tokens,
            stage_ms=stage_ms,
            cameras=list(plan.cameras),
            visual_tokens=len(plan.cameras) * rt.tokens_per_camera,
            kept_tokens=prompt.kept_tokens,
            input_tokens=prompt.input_tokens,
            decode_steps=out.steps,
            accepted_length=out.accepted,
            pipeline=rt.options.label(),
            reused_cameras=[c for c in plan.cameras if c in cached],
            degraded=list(plan.degraded),
            budget_ms=float(budget),
            extra={"rounds": out.rounds} if out.rounds else {},
        )
        rt.planner.costs.observe(ans, len(todo), plan.decoding)
        return ans

    def warm_up(self, images: dict | None = None) -> Answer:
        """One synthetic query (black frames), then the speculation cost table measured on this
        device and backend at that prompt length (speculative.py uses it per round)."""
        import numpy as np

        from ..decoding.spec_policy import measure_costs

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
def check_question(rt: Runtime, question: str) -> list[int]:
    if not isinstance(question, str) or not "".join(ch for ch in question if ch not in INVISIBLE).strip():
        raise InputError("empty question")
    bad = [t for t in SPECIAL_TOKENS if t in question]
    if bad:
        raise InputError(f"question contains reserved token {bad[0]!r}")
    ids = rt.tok.encode(question)
    if len(ids) > rt.options.max_question_tokens:
        raise InputError(f"question too long: {len(ids)} tokens > {rt.options.max_question_tokens}")
    return ids


def check_images(images, cameras: list[str]) -> None:
    missing = [c for c in cameras if c not in images]
    if missing:
        raise InputError(f"no image for camera(s) {', '.join(missing)}")


def select_views(rt: Runtime, question: str) -> list[str]:
    """The cameras the question needs, most needed first (the view selector's scores, or the
    keyword map's where there is none; rig order among equals): what a latency budget drops last."""
    from ..stages.view_selector import keyword_map

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
            raise InputError(f"no image for camera(s) {cam}")
        img = load_image(images[cam], cam, (s * tpc, s), limits.max_pixels, limits.jpeg_draft)
        to_tiles_uint8(img, s, tpc, a.pixels_u8[i * tpc:(i + 1) * tpc])
    n = len(cameras) * tpc
    return rt.normalize(a.pixels_u8[:n], a.pixels[:n])


def encode(rt: Runtime, pixels: torch.Tensor, todo: list[str] | None = None, cached: dict | None = None,
           cameras: list[str] | None = None, frame_keys: dict | None = None) -> list[torch.Tensor]:
    """Visual tokens per camera of `cameras` [tokens_per_camera, D]: the cameras in `todo` through
    the vision engine (their tiles in `pixels`, and into the feature cache when it has a key for
    them), the others from `cached`."""
    todo = list(todo) if todo is not None else list(rt.options.cameras)[:pixels.shape[0] // rt.options.tiles_per_camera]
    cameras, cached = cameras or todo, cached or {}
    out = rt.arena.visual[:pixels.shape[0]]
    if todo:
        out.copy_(rt.engines.vision.run(pixels))
    fresh = dict(zip(todo, out.view(len(todo), rt.tokens_per_camera, rt.cfg.llm.hidden_size)))
    if rt.features is not None and frame_keys:
        fresh = {c: rt.features.put(c, frame_keys[c], v) if c in frame_keys else v for c, v in fresh.items()}
    return [cached[c] if c in cached else fresh[c] for c in cameras]


def prompt_ids(rt: Runtime, cameras: list[str], question: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The full prompt's token ids with `<IMG_CONTEXT>` placeholders, and each camera's (start, count)."""
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera)
    return list(prompt.input_ids), list(prompt.image_spans)


def assemble_prompt(rt: Runtime, cameras: list[str], question: str, visual: torch.Tensor) -> PromptLayout:
    """Write the full prompt, [template, <img> every visual token </img> per camera, question],
    as ids + embeddings into the arena once: the token selector reads it, prefill gathers the
    kept rows from it. Row index = original position id."""
    a = rt.arena
    prompt = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, cameras, question, rt.tokens_per_camera)
    n = len(prompt.input_ids)
    a.prompt_ids[:n].copy_(torch.tensor(prompt.input_ids, dtype=torch.long, device=rt.device))
    embeds = a.prompt_embeds[:n]
    torch.index_select(rt.lm.embed.weight, 0, a.prompt_ids[:n], out=embeds)
    for cam_index, (start, count) in enumerate(prompt.image_spans):
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


def prefill(rt: Runtime, layout: PromptLayout, keep: list[torch.Tensor]) -> Prompt:
    """Gather [template, <img> kept visual </img> per camera, question] from the assembled full
    prompt into the arena, run the decoder over it, and choose the first answer token.

    Kept visual tokens keep their original position ids: a row's position is its index in the
    full prompt, as if every visual token were present.
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
    if rt.fastv is not None:
        visual_rows = torch.cat([a.slots[s:s + c] for s, c in visual_ranges])
        hidden, fastv_rows, kept = rt.fastv.prune(embeds, positions, mask, visual_rows)
        input_tokens = len(fastv_rows)   # rows the layers >= K see
    else:
        hidden = rt.engines.decoder.prefill(embeds, positions, mask)
    first = choose(rt, rt.engines.head.run(hidden[-1:]))
    return Prompt(length=n, next_pos=layout.length, first=first, hidden=hidden, input_tokens=input_tokens,
                  kept_tokens=kept)
