"""The runtime context: everything a query touches, built once and passed to the stages, the
decoders, export, calibration and training (instead of a pipeline object they all reach into).

    rt = build_runtime(model_dir, options)      # or Runtime.from_model(model, tokenizer, options)

Order matters and is fixed here: the options are resolved against the model folder (which
modules run), the arena's limits follow from the options and the model config, the model is
loaded with its RoPE table sized once at the arena's max_len (shared by the token selector and
the EAGLE-2 head), moved to the device, and the engines of the chosen backend are bound to the
arena's buffers. Nothing here is sized twice.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import threads
from ..decoding.spec_policy import DeviceCosts, measure_costs
from ..engines import batch_limit, make_engines
from ..engines.base import Engines, KVRegion
from ..errors import InputError
from ..models.config import ModelConfig
from ..models.eagle import DraftHead
from ..options import BUNDLE_BACKENDS, BackendName, DecodingMode, PipelineOptions, TokenMode, ViewMode
from ..stages.budget import BudgetPlanner
from ..stages.fastv import FastV
from ..stages.feature_cache import FeatureCache
from ..stages.motion import MotionCache
from ..stages.preprocess import Normalizer
from ..stages.prompt import build_prompt, resolve_layout
from ..stages.token_selector import TokenSelector, load_token_selector
from ..stages.view_selector import LoadedViewSelector, load_view_selector
from ..weights.checkpoint import load_model, read_config
from ..weights.draft_head import load_draft_head
from ..weights.gemm import resolve_gemm, use_onednn
from ..weights.linear_forms import LinearForms, convert_linears, resolve_vision_gemm, vision_to
from ..weights.tokenizer import Tokenizer
from .arena import Arena, Limits
from .conversation import Conversations
from .prefix import PromptPrefix, prefix_ids

log = logging.getLogger("litevlm.runtime")
_said: set[str] = set()
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_threads_lock = threading.Lock()


def arena_limits(cfg: ModelConfig, tok: Tokenizer, options: PipelineOptions, layout: str) -> Limits:
    """The arena's maxima: the rig's cameras and tiles, the longest template + question, the
    answer cap and the largest draft tree the options allow."""

    # Everything in the prompt except the visual tokens, the questions and the earlier answers, for
    # a conversation of serving.max_turns turns (follow-up questions): each turn may bring a whole
    # question and, after the first, a whole earlier answer (8 rows of slack per turn for how the
    # tokenizer joins them to the separators).
    turns = options.serving.max_turns
    frames = options.temporal.max_frames
    template = build_prompt(tok, cfg.system_message, layout, list(options.cameras), "", 1,
                            history=(("", "x"),) * (turns - 1), frames=frames)
    template_tokens = len(template.input_ids) - len(options.cameras) * frames    # one placeholder per view
    tree = options.decoding.eagle
    eagle = options.decoding.mode == DecodingMode.EAGLE
    return Limits(
        cameras=len(options.cameras),
        tiles_per_camera=options.tiles_per_camera,
        frames=frames,
        text_tokens=template_tokens + turns * (8 + options.max_question_tokens) + (turns - 1) * options.max_new_tokens,
        new_tokens=options.max_new_tokens,
        tree_tokens=max(64, tree.total + 1, (tree.depth - 1) * tree.topk),   # so one export serves both decodings
        draft_layers=1 if eagle else 0,
        cached_cameras=feature_slots(options),
        batch=batch_capacity(options),
        conversations=options.serving.conversations if turns > 1 else 0,
        kv_dtype=options.arena.kv_dtype,
        prefix_rows=len(prefix_ids(tok, cfg.system_message, layout, options.cameras,
                                   options.tiles_per_camera * cfg.tokens_per_tile))
        if options.serving.prefix_cache and options.fastv.ratio == 0 else 0,
    )


def feature_slots(options: PipelineOptions) -> int:
    """Camera frames the feature cache holds: serving.feature_cache_cameras, and at least every
    view of a query over temporal.max_frames frame sets (its window: a K-frame query's views live
    there between vision and prefill, so that none of them evicts another); with reuse on, one frame
    set more: the next set, which the node encodes while idle (serving/server.py idle_job), then
    comes in without evicting the window the next query reuses."""
    sets = options.temporal.max_frames + (1 if options.serving.feature_cache else 0)
    window = sets * len(options.cameras) if options.temporal.max_frames > 1 else 0
    return max(options.serving.feature_cache_cameras if options.serving.feature_cache else 0, window)


def batch_capacity(options: PipelineOptions) -> int:
    """Queries decoded together (batching.py): serving.max_batch where the backend batches
    (engines.batch_limit), else 1 with a log line saying why."""
    capacity, why = batch_limit(options)
    if why and why not in _said:               # arena_limits runs twice per runtime: say it once
        _said.add(why)
        log.warning("serving.max_batch %d -> 1 (one query at a time): %s", options.serving.max_batch, why)
    return capacity


def set_threads(n: int) -> None:
    """torch's intra-op threads for this process (the one knob shared by every pipeline in it)."""

    if n > 1 and threads.torch_loaded_first:
        warnings.warn("torch was imported before litevlm_runtime, so its OpenMP threads spin when idle and a shared "
                      "CPU can collapse them: set OMP_WAIT_POLICY=PASSIVE in the environment, or import "
                      "litevlm_runtime first (threads.py)", RuntimeWarning, stacklevel=3)
    with _threads_lock:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


@dataclass
class Runtime:
    """Built once per loaded model and shared by every query (their own state is
    pipeline.QueryState): nothing here is copied per query or per KV region."""
    name: str
    model_dir: Path | None
    options: PipelineOptions          # resolved: no `auto` left
    cfg: ModelConfig
    model: torch.nn.Module            # InternVL
    tok: Tokenizer
    arena: Arena
    device: torch.device
    dtype: torch.dtype
    pos_embed: torch.Tensor           # InternViT's position table at this tile size
    normalize: Normalizer
    view_selector: LoadedViewSelector | None = None
    token_selector: TokenSelector | None = None
    draft: DraftHead | None = None
    fastv: FastV | None = None
    engines: Engines | None = None    # bound last
    costs: DeviceCosts | None = None  # the speculation cost table, measured at warm-up (adaptive trees)
    features: FeatureCache | None = None      # visual reuse, or None
    planner: BudgetPlanner | None = None      # latency budgets
    prompt_layout: str = "cameras"    # prompt.py: internvl | cameras | a template (the model folder's)
    weights: LinearForms | None = None        # the linears' weight form when not float (backend.weights)
    conversations: Conversations | None = None   # answered turns kept for follow-up questions
    prefix: PromptPrefix | None = None         # the KV of the prompt prefix every query shares, or None
    motion_cache: MotionCache | None = None       # a model with motion/: the frames' grey tiles (stages/motion.py)
    gemm: str = "torch"               # the float32 GEMM kernel its linears run: torch | onednn (weights/gemm.py)
    vision_gemm: str = "float32"      # the vision encoder's GEMM: float32 | bfloat16 | int8 (weights/linear_forms.py)
    _regions: dict[int, KVRegion] = field(default_factory=dict, repr=False)
    _regions_of: object = field(default=None, repr=False)      # the decoder engine they were made for

    def region(self, index: int) -> KVRegion:
        """KV region `index` of the arena (batching.py gives each query of a batch one; region 0
        is every single query's) with the decoder engine bound to it. Made once per set of
        engines: calibration and the static-stage tests rebind engines after the runtime is built."""
        decoder = self.engines.decoder
        if self._regions_of is not decoder:
            self._regions, self._regions_of = {}, decoder
        region = self._regions.get(index)
        if region is None:
            k, v = self.arena.k_regions[index], self.arena.v_regions[index]
            region = KVRegion(index, k, v, decoder if index == 0 else decoder.on_region(k, v))
            self._regions[index] = region
        return region

    @property
    def lm(self):
        return self.model.language_model

    @property
    def tokens_per_camera(self) -> int:
        return self.options.tiles_per_camera * self.cfg.tokens_per_tile

    @classmethod
    def from_model(cls, model, tok: Tokenizer, options: PipelineOptions, *, name: str = "model",
                   model_dir: str | Path | None = None, draft=None, token_selector=None,
                   view_selector=None) -> "Runtime":
        """A runtime over an already built model (tests, the GPU check, training): `options` must
        be resolved (see PipelineOptions.resolved); modules not passed are loaded from model_dir."""

        model_dir = Path(model_dir) if model_dir else None
        provided = frozenset(
            name
            for name, obj in (("view_selector", view_selector), ("token_selector", token_selector), ("eagle", draft))
            if obj is not None
        )
        options = options.resolved(model_dir, provided)
        device, dtype = torch.device(options.device), DTYPES[options.dtype]
        set_threads(options.threads())
        cfg = model.cfg
        layout = resolve_layout(options.prompt_layout or None, model_dir or tok.folder)[0]
        arena = Arena(cfg, arena_limits(cfg, tok, options, layout), dtype, device)
        model = model.to(device, dtype).eval()
        lm = model.language_model
        if getattr(lm, "rope", None) is None or lm.rope.max_len != arena.max_len:
            lm.init_rope(arena.max_len)                 # the one RoPE table, at the arena's size
        with torch.inference_mode():
            grid = cfg.patches_per_side
            pos_embed = model.vision_model.embeddings.position_embedding_for(grid, grid)
        rt = cls(name=name, model_dir=model_dir, options=options, cfg=cfg, model=model, tok=tok, arena=arena,
                 device=device, dtype=dtype, pos_embed=pos_embed, normalize=Normalizer(dtype, device),
                 prompt_layout=layout)
        on = options.modules()
        rt.view_selector = (view_selector or load_views(options, model_dir)) if "views" in on else None
        rt.token_selector = (token_selector or load_tokens(options, model_dir, lm, dtype)) \
            if any(m.startswith("tokens") for m in on) else None
        if options.decoding.mode == DecodingMode.EAGLE:
            rt.draft = draft if draft is not None else load_draft(options, model_dir, lm, dtype)
            rt.draft = rt.draft.to(device, dtype).eval()
            rt.draft.rope = lm.rope
        if rt.token_selector is not None:
            rt.token_selector = rt.token_selector.to(device, dtype).eval()
            rt.token_selector.rope = lm.rope
        if options.fastv.ratio > 0:
            rt.fastv = FastV(lm, arena, options.fastv.k, options.fastv.ratio)
        if options.backend.weights != "float":          # after the selector/draft copied what they need
            rt.weights = convert_linears(model, options.backend.weights, extra=(rt.token_selector, rt.draft),
                                         quantized=options.backend.quantized, model_dir=model_dir,
                                         prefill=options.backend.lowbit_prefill)
        rt.vision_gemm = resolve_vision_gemm(options.backend.vision_gemm, options.backend.weights, device, dtype)
        if rt.vision_gemm != "float32":
            vision_to(model, rt.vision_gemm)            # (bf16 weights converted vision to bfloat16 already)
        rt.gemm = resolve_gemm(options.backend.gemm, device, dtype)
        if rt.gemm == "onednn":                         # the linears no weight form took (weights/gemm.py)
            use_onednn([model, rt.token_selector, rt.draft])
        rt.engines = make_engines(rt)
        if arena.feature_cache.shape[0]:      # (serving.feature_cache false: a K-frame query's window only)
            rt.features = FeatureCache(arena.feature_cache, reuse=options.serving.feature_cache)
        rt.motion_cache = motion_cache_for(model, options, device, dtype)
        rt.conversations = Conversations(arena.k_turns, arena.v_turns, options.serving.max_turns)
        rt.planner = BudgetPlanner(rt)
        if rt.fastv is not None:
            rt.engines.decoder = rt.fastv          # later passes run under FastV's per-layer masks
        elif arena.prefix_k.shape[2] and rt.engines.decoder.extends_prompt:
            rt.prefix = PromptPrefix.build(rt)
        if options.decoding.mode == DecodingMode.EAGLE:
            # The speculation cost table (spec_policy.py), at half the longest prompt; a server's
            # warm-up re-measures it at a real prompt's length (Pipeline.warm_up).
            rt.costs = (measure_costs(rt) if options.decoding.eagle.policy.value == "adaptive"
                        else DeviceCosts({1: 1.0}, 0.0, {1: 0.0}, source="fixed tree: not measured"))
        return rt


def motion_cache_for(model, options: PipelineOptions, device: torch.device, dtype: torch.dtype) -> MotionCache | None:
    """A model with a motion network (its folder's motion/): the network on the runtime's device and
    the store of the frames' grey tiles its flow is made from (two windows' worth)."""
    if getattr(model, "motion", None) is None:
        return None
    model.motion.to(device, dtype)
    return MotionCache(2 * options.temporal.max_frames * len(options.cameras))


def load_views(options: PipelineOptions, model_dir: Path | None):
    if options.views.mode != ViewMode.SELECTOR:
        return None

    folder = Path(options.views.selector_dir) if options.views.selector_dir else model_dir / "view_selector"
    return load_view_selector(folder, threshold=options.views.threshold or None)


def load_tokens(options: PipelineOptions, model_dir: Path | None, lm, dtype):
    mode = options.tokens.mode
    if mode == TokenMode.OFF:
        return None
    reduce = options.tokens.reduce or None
    if mode == TokenMode.LAYER0:
        return load_token_selector(None, lm, reduce, dtype)
    folder = Path(options.tokens.selector_dir) if options.tokens.selector_dir else model_dir / "token_selector"
    return load_token_selector(folder, lm, reduce, dtype)


def load_draft(options: PipelineOptions, model_dir: Path | None, lm, dtype):
    folder = Path(options.decoding.draft_dir) if options.decoding.draft_dir else model_dir / "eagle"
    return load_draft_head(folder, lm.cfg, lm.rope, dtype)


def build_runtime(model_dir: str | Path, options: PipelineOptions | None = None) -> Runtime:
    """Load an InternVL2.5 folder into a runtime for `options` (default: the deployed LiteVLM
    configuration, modules where the folder has them)."""

    options = options or PipelineOptions()
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)                 # fail fast on a bad folder before loading weights
    resolved = options.resolved(model_dir)
    if resolved.backend.name == BackendName.TENSORRT and not resolved.device.startswith("cuda"):
        raise InputError(f"backend.name tensorrt runs on a CUDA device; device is {resolved.device!r}")
    if resolved.backend.name in BUNDLE_BACKENDS and not resolved.backend.bundle:
        raise InputError(f"backend.name {resolved.backend.name.value} needs backend.bundle (an export folder: "
                         f"`litevlm export --model {model_dir} --out DIR`)")
    tok = Tokenizer(model_dir)
    layout = resolve_layout(resolved.prompt_layout or None, model_dir)[0]
    max_len = Arena.max_len_for(cfg, arena_limits(cfg, tok, resolved, layout))
    model = load_model(model_dir, DTYPES[resolved.dtype], max_len=max_len)
    return Runtime.from_model(model, tok, resolved, name=model_dir.name, model_dir=model_dir)
