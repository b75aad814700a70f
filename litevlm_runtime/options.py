"""The pipeline's configuration: one typed, nested tree of frozen dataclasses, validated where it
is built, and its flat view (dotted names) from which every other surface is derived:

    PipelineOptions(views=Views(...), tokens=Tokens(...), decoding=Decoding(...), backend=Backend(...))
    tokens.keep_ratio            the one name of a setting, everywhere:
      --tokens.keep_ratio 0.9      a CLI flag (add_option_flags)
      tokens.keep_ratio            a ROS 2 parameter with its descriptor (ros/parameters.py)
      tokens: {keep_ratio: 0.9}    a key of config/drive.yaml (ROS 2 nests dotted parameter names)

Defaults are the deployed configuration: the LiteVLM pipeline, whose modules (view selector,
token selector, EAGLE-2 head) are switched on wherever the model folder carries them (`auto`);
`pipeline=baseline` turns the `auto` modules off for comparison. `resolved(model_dir)` replaces
every `auto` by what will actually run, so an answer can say which pipeline served it.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .cameras import CAMERAS
from .errors import InputError
from .threads import default_threads

# Choices the command-line parser offers, here (a module without torch) so that building the
# parser loads no model code: the view selector's keyword/model fusion rules (stages/view_selector.py)
# and how `train views` labels cameras from an answer's object tags (training/views.py).
FUSION_RULES = ("add", "remove", "add_remove", "weighted")
ANSWER_TAG_POLICIES = ("cued", "always", "never")


class PipelineKind(str, Enum):
    LITEVLM = "litevlm"      # view selection, token selection, EAGLE-2: each where the model folder has it
    BASELINE = "baseline"    # every camera, every visual token, greedy decoding


class ViewMode(str, Enum):
    AUTO = "auto"            # the selector under pipeline=litevlm when <model>/view_selector exists, else all
    ALL = "all"
    SELECTOR = "selector"


class TokenMode(str, Enum):
    AUTO = "auto"            # the trained selector under pipeline=litevlm when <model>/token_selector exists
    OFF = "off"
    SELECTOR = "selector"    # the trained selector (tokens.selector_dir or <model>/token_selector)
    LAYER0 = "layer0"        # the untrained copy of the decoder's first layer


class DecodingMode(str, Enum):
    AUTO = "auto"            # EAGLE-2 under pipeline=litevlm when <model>/eagle exists, else greedy
    GREEDY = "greedy"
    EAGLE = "eagle"          # EAGLE-2 draft tree + one-pass verification (lossless under greedy)


class TreePolicy(str, Enum):
    ADAPTIVE = "adaptive"    # per round, the tree the device's measured costs say pays most (or none)
    FIXED = "fixed"          # always the configured total/depth/top-k


class BackendName(str, Enum):
    TORCH = "torch"
    TORCH_CUDAGRAPH = "torch-cudagraph"
    TORCH_COMPILE = "torch-compile"
    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"
    TENSORRT = "tensorrt"


# The backends that run an export bundle's graphs (backend.bundle) rather than the PyTorch modules.
BUNDLE_BACKENDS = (BackendName.ONNXRUNTIME, BackendName.OPENVINO, BackendName.TENSORRT)


DTYPES = ("float32", "float16", "bfloat16")
SCOPES = ("camera", "global")
REDUCTIONS = ("", "max", "mean")
ENGINE_PRECISIONS = ("fp16", "fp8", "int8", "int4")
# LiteVLM paper: r = 0.8 at FP16, 0.9 at FP8; INT8/INT4 engines (not in the paper) take FP16's
PAPER_KEEP_RATIO = {"fp16": 0.8, "fp8": 0.9, "int8": 0.8, "int4": 0.8}


def setting(default, help: str, *, lo=None, hi=None, choices=None, live=False, ros=True):
    """A leaf setting: its default, its description and its constraints, in one place.
    live: may change while serving (applied by the node without a reconfigure).
    ros: declared as a node parameter (False for what only Python callers set)."""
    meta = {"help": help, "lo": lo, "hi": hi, "choices": choices, "live": live, "ros": ros}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def nested(cls):
    return field(default_factory=cls, metadata={"nested": True})


class _Validated:
    """Coerces enum fields from their string values and checks each field's range and choices."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            if f.metadata.get("nested"):
                continue
            value, kind = getattr(self, f.name), hints[f.name]
            if isinstance(kind, type) and issubclass(kind, Enum) and not isinstance(value, kind):
                try:
                    value = kind(value)
                except ValueError:
                    raise InputError(f"{self._path(f.name)}: {value!r} is not one of "
                                     f"{', '.join(m.value for m in kind)}") from None
                object.__setattr__(self, f.name, value)
            check_value(self._path(f.name), value, f.metadata)

    def _path(self, name: str) -> str:
        return f"{SECTION_OF.get(type(self).__name__, '')}{name}"


def check_value(key: str, value, meta) -> None:
    lo, hi, choices = meta.get("lo"), meta.get("hi"), meta.get("choices")
    if choices is not None and value not in choices:
        raise InputError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
    if lo is not None and value < lo:
        raise InputError(f"{key}: {value!r} is below its minimum {lo}")
    if hi is not None and value > hi:
        raise InputError(f"{key}: {value!r} is above its maximum {hi}")


@dataclass(frozen=True)
class Images(_Validated):
    max_pixels: int = setting(4096 * 4096, "refuse a camera image above this many pixels, from its header, before "
                                           "decoding (a decompression bomb): bad_image naming the camera", lo=4)
    jpeg_draft: bool = setting(True, "decode JPEG at libjpeg's reduced DCT scale nearest above the tile size (2-4x "
                                     "faster; false: full decode then resize, as upstream InternVL)")


@dataclass(frozen=True)
class Views(_Validated):
    mode: ViewMode = setting(
        ViewMode.AUTO, "view selection: auto (the model's selector under pipeline=litevlm) | all | selector"
    )
    selector_dir: str = setting("", "view selector folder ('': <model_dir>/view_selector)")
    threshold: float = setting(0.0, "the selector's keyword-map threshold (0: the threshold saved with the selector)",
                               lo=0.0, hi=1.0, live=False)


@dataclass(frozen=True)
class Tokens(_Validated):
    mode: TokenMode = setting(
        TokenMode.AUTO, "token selection: auto (the model's selector under pipeline=litevlm) | off | selector | layer0"
    )
    keep_ratio: float = setting(
        0.0, "fraction of visual tokens kept (0: the paper's r for the precision: 0.8, 0.9 at fp8)", lo=0.0, hi=1.0
    )
    selector_dir: str = setting("", "token selector folder ('': <model_dir>/token_selector)")
    reduce: str = setting("", "score over question tokens: max | mean ('': the selector's own)", choices=REDUCTIONS)
    scope: str = setting(
        "camera", "keep the top r of each camera (camera) or of all visual tokens (global)", choices=SCOPES
    )


@dataclass(frozen=True)
class EagleTree(_Validated):
    total: int = setting(60, "draft-tree nodes verified per round, at most (paper 60)", lo=1, hi=256)
    depth: int = setting(6, "draft levels, at most (paper 5 to 7)", lo=1, hi=16)
    topk: int = setting(10, "children expanded per node (paper 10)", lo=1, hi=32)
    policy: TreePolicy = setting(
        TreePolicy.ADAPTIVE,
        "adaptive (the tree the device's measured costs say pays, or plain "
        "greedy steps) | fixed (always total/depth/topk)",
    )


@dataclass(frozen=True)
class Decoding(_Validated):
    mode: DecodingMode = setting(
        DecodingMode.AUTO, "auto (EAGLE-2 under pipeline=litevlm when the model has eagle/) | greedy | eagle"
    )
    eagle: EagleTree = nested(EagleTree)
    draft_dir: str = setting("", "EAGLE-2 draft head folder ('': <model_dir>/eagle)")
    temperature: float = setting(
        0.0, "0: greedy; > 0: sampling (EAGLE-2 verifies by rejection sampling)", lo=0.0, hi=10.0
    )
    seed: int = setting(0, "sampling generator seed", lo=0)


LOWBIT_WEIGHTS = ("int8", "int4", "int4-rtn", "fp16")    # the decoder weight forms of weights/lowbit.py


@dataclass(frozen=True)
class Backend(_Validated):
    name: BackendName = setting(
        BackendName.TORCH, "stage engines: torch | torch-cudagraph | torch-compile | onnxruntime | openvino | tensorrt"
    )
    bundle: str = setting("", "export bundle folder (litevlm export) for onnxruntime, openvino and tensorrt")
    compress: str = setting("none", "openvino: the bundle's weights compressed by NNCF at load: none | int8 (per "
                                    "channel) | int4 (groups of 128 input channels; engines/openvino_engine.py)",
                            choices=("none", "int8", "int4"))
    precision: str = setting("fp16", "TensorRT engine precision: fp16 | fp8 | int8 | int4 (engines built by litevlm "
                                     "build-engines)",
                             choices=ENGINE_PRECISIONS)
    buckets: str = setting(
        "",
        "torch-cudagraph / torch-compile shape buckets, e.g. 'vision=2,6;prefill=256,512;step=1,64;head=1,64' "
        "('': derived from the arena)",
    )
    weights: str = setting(
        "float",
        "linear weights: float (the pipeline's dtype) | int8 (the decoder's linears, LM head "
        "and a tied head's embedding, per-channel int8, quantized at load) | int4 (the same "
        "set, group-wise INT4 with AWQ scales from `litevlm quantize`: backend.quantized) | "
        "int4-rtn (INT4 round to nearest, quantized at load) | fp16 (the same set in float16, "
        "widened in registers) | bf16 (a float32 pipeline on the CPU: calls of many rows, "
        "vision, prefill, token selection, run bfloat16 GEMMs on the CPU's matrix units, "
        "decode steps stay float32): weights/lowbit.py, weights/bf16.py",
        choices=("float", "int8", "int4", "int4-rtn", "fp16", "bf16"),
    )
    lowbit_prefill: str = setting(
        "auto",
        "GEMM of the int4/int8/fp16 weight forms' calls of many rows (prefill, vision-free stages): float32 (each "
        "weight tile dequantized to float32, the float32 GEMM) | bfloat16 (tiles and input rounded to bfloat16, the "
        "bfloat16 GEMM: the numerics of backend.weights bf16) | int8 (int4/int8: the input quantized to int8 per "
        "block of 128, integer products on AVX-512 VNNI or AVX2; fp16 takes bfloat16) | auto (int8 where the low-bit "
        "kernels run, else bfloat16 where the CPU has bfloat16 units, avx512_bf16 or amx_bf16, else float32): "
        "weights/lowbit.py",
        choices=("auto", "float32", "bfloat16", "int8"),
    )
    vision_gemm: str = setting(
        "auto",
        "GEMM of the vision encoder's and projector's linears on the CPU: float32 | bfloat16 (input rounded to "
        "bfloat16, the bfloat16 GEMM: the numerics of backend.weights bf16) | int8 (weights quantized per channel "
        "to int8 at load, the input per block of 128, integer products on AVX-512 VNNI or AVX2) | auto (where "
        "backend.weights is a low-bit form, whose prompt already runs reduced-precision GEMMs: int8 where the CPU "
        "has AVX-512 VNNI, else bfloat16 where it has bfloat16 units, else float32; a float pipeline stays "
        "float32, backend.weights bf16 covers vision itself): weights/linear_forms.py",
        choices=("auto", "float32", "bfloat16", "int8"),
    )
    quantized: str = setting("", "folder of stored quantized weights `backend.weights int4` reads (`litevlm quantize "
                                 "--out`; '': <model folder>/quantized-int4)")
    gemm: str = setting("auto", "float32 GEMM kernel of the CPU linears: torch (F.linear: MKL on x86 wheels) | onednn "
                                "(oneDNN's float32 matmul for calls of 4+ rows) | auto (onednn on a non-Intel CPU with "
                                "AVX-512, where MKL runs its AVX2 path; torch elsewhere): weights/gemm.py",
                        choices=("auto", "torch", "onednn"))
    threads: int = setting(0, "CPU threads per stage (0: one per core this process may use; idle threads sleep, "
                               "so that a shared CPU does not collapse them: threads.py)", lo=0, hi=1024)


@dataclass(frozen=True)
class Serving(_Validated):
    feature_cache: bool = setting(True, "reuse each camera's visual features for later questions about the same frame")
    feature_cache_cameras: int = setting(
        12, "camera features kept (oldest evicted first; 12 = two six-camera frame sets)", lo=0, hi=1024
    )
    prefix_cache: bool = setting(True, "keep the KV of the prompt prefix every query shares (system message, user "
                                       "turn's opening) and prefill only the rest (engines whose prompt runs the "
                                       "model's own forward: torch, torch-compile on the CPU; pipeline/prefix.py)")
    latency_budget_ms: float = setting(0.0, "a query's default latency budget (0: none; a Query's budget_ms wins)",
                                       lo=0.0, hi=600000.0, live=True)
    stream_partials: bool = setting(True, "publish the answer as it is decoded (litevlm_msgs/AnswerPartial)", live=True)
    max_batch: int = setting(4, "queries decoded together, one decoder pass per step over all (in-flight batching, "
                                "every backend: a bundle's batched step graph for onnxruntime/tensorrt; not with "
                                "FastV; 1: one query at a time)", lo=1, hi=64)
    conversations: int = setting(4, "answered queries a follow-up question may name (Query.follow_up_of): their "
                                    "turns and KV kept in the arena, one KV region each, least recently used "
                                    "evicted first (0: no follow-ups)", lo=0, hi=64)
    max_turns: int = setting(4, "turns per conversation, at most (a follow-up past it is answered bad_follow_up); "
                                "the arena's prompt rows are sized for this many full turns", lo=1, hi=64)


TEMPORAL_MODES = ("auto", "all", "selector")


@dataclass(frozen=True)
class Temporal(_Validated):
    frames: int = setting(1, "frame sets a query is answered from unless it says (Query frames): 1 = the newest only, "
                             "as without time; K = the newest and the K - 1 before it, stride_s apart, oldest first",
                          lo=1, hi=16)
    max_frames: int = setting(4, "most frame sets a query may ask for: the feature cache holds max_frames x cameras "
                                 "views and the arena's prompt rows max_frames sets (sized at start-up)", lo=1, hi=16)
    stride_s: float = setting(0.5, "seconds between a query's frame sets (nuScenes' key frames are 2 Hz)",
                              lo=0.01, hi=10.0)
    mode: str = setting("auto", "how many of the asked frame sets a question gets: auto (the view selector's time "
                                "prediction under views.mode selector, else all) | all | selector (the view "
                                "selector's: its time head fused with time words, or the words alone)",
                        choices=TEMPORAL_MODES)
    change_threshold: float = setting(0.2, "temporal token selection: an older frame set's visual token is dropped "
                                            "before prefill when its features differ from the newest set's at the "
                                            "same camera and position by less than this (relative L2 distance; "
                                            "0: keep every token)", lo=0.0, hi=10.0)


@dataclass(frozen=True)
class ArenaOptions(_Validated):
    kv_dtype: str = setting("float", "KV cache elements: float (the pipeline's dtype) | int8 | fp8 (E4M3): 8-bit codes "
                                     "with a float16 scale per head and row, read dequantized by attention, in every "
                                     "KV region (batch, conversation turns, prompt prefix); an onnxruntime/tensorrt "
                                     "bundle is exported for one (models/kv_cache.py)",
                            choices=("float", "int8", "fp8"))


@dataclass(frozen=True)
class FastVOptions(_Validated):
    k: int = setting(2, "FastV baseline: prune inside the decoder from layer K on", lo=1)
    ratio: float = setting(0.0, "FastV drop ratio R (0: off; the paper's 'FastV r=0.3' is R = 0.7)", lo=0.0, hi=0.99)


@dataclass(frozen=True)
class PipelineOptions(_Validated):
    pipeline: PipelineKind = setting(
        PipelineKind.LITEVLM, "litevlm (the deployed pipeline) | baseline (for comparison)"
    )
    device: str = setting("cpu", "torch device: cpu | cuda | cuda:N")
    dtype: str = setting("float32", "weights and activations: float32 | float16 | bfloat16", choices=DTYPES)
    tiles_per_camera: int = setting(1, "tiles of S x S per camera (2 = the paper's 12-tile rig)", choices=(1, 2))
    max_new_tokens: int = setting(64, "answer length cap (tokens)", lo=1, hi=4096)
    max_question_tokens: int = setting(256, "question length cap (tokens)", lo=1, hi=8192)
    cameras: tuple = setting(CAMERAS, "the rig this pipeline serves, in rig order", ros=False)
    prompt_layout: str = setting("", "prompt layout: internvl | cameras | a template with <image> ('': the model "
                                     "folder's litevlm.json, else guessed from its tokenizer; prompt.py)")
    images: Images = nested(Images)
    views: Views = nested(Views)
    tokens: Tokens = nested(Tokens)
    decoding: Decoding = nested(Decoding)
    backend: Backend = nested(Backend)
    serving: Serving = nested(Serving)
    temporal: Temporal = nested(Temporal)
    arena: ArenaOptions = nested(ArenaOptions)
    fastv: FastVOptions = nested(FastVOptions)

    def __post_init__(self):
        super().__post_init__()
        if not str(self.device).split(":")[0] in ("cpu", "cuda", "meta"):
            raise InputError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        unknown = [c for c in self.cameras if c not in CAMERAS]
        if unknown or not self.cameras:
            raise InputError(f"cameras: {unknown or '(none)'} not in the rig {', '.join(CAMERAS)}")
        if self.temporal.frames > self.temporal.max_frames:
            raise InputError(f"temporal.frames: {self.temporal.frames} is above temporal.max_frames "
                             f"{self.temporal.max_frames}")
        if self.fastv.ratio > 0 and self.backend.name != BackendName.TORCH:
            raise InputError("fastv.ratio: FastV prunes inside the decoder and needs backend.name torch")
        if self.backend.weights in LOWBIT_WEIGHTS and self.backend.name in BUNDLE_BACKENDS:
            raise InputError(
                f"backend.weights {self.backend.weights} quantizes the PyTorch engines' weights; "
                f"{self.backend.name.value} runs "
                f"an exported bundle: build an INT8/FP8 bundle with `litevlm calibrate --precision int8|fp8`"
                f"{' or set backend.compress int8' if self.backend.name == BackendName.OPENVINO else ''}"
            )
        if self.backend.compress != "none" and self.backend.name != BackendName.OPENVINO:
            raise InputError(f"backend.compress {self.backend.compress}: NNCF compresses the weights OpenVINO runs "
                             f"(backend.name openvino); backend.name is {self.backend.name.value}")
        if self.backend.vision_gemm in ("bfloat16", "int8") and (
                self.dtype != "float32" or str(self.device).startswith("cuda")
                or self.backend.name not in (BackendName.TORCH, BackendName.TORCH_COMPILE)):
            raise InputError(
                f"backend.vision_gemm {self.backend.vision_gemm} runs the vision encoder's GEMMs of a float32 "
                f"pipeline on the CPU's bfloat16 / VNNI units (PyTorch engines); with dtype {self.dtype} on "
                f"{self.device}, backend.name {self.backend.name.value}, leave it auto"
            )
        if self.backend.weights == "bf16":
            if self.dtype != "float32" or str(self.device).startswith("cuda"):
                raise InputError(
                    f"backend.weights bf16 runs the compute-bound GEMMs of a float32 pipeline on the CPU in "
                    f"bfloat16; with dtype {self.dtype} on {self.device} choose dtype bfloat16/float16 instead"
                )
            if self.backend.name not in (BackendName.TORCH, BackendName.TORCH_COMPILE):
                raise InputError(
                    f"backend.weights bf16 changes the PyTorch engines' linears; {self.backend.name.value} "
                    f"runs an exported bundle's graphs"
                )

    # ------------------------------------------------------------------ resolution
    def resolved(self, model_dir: str | Path | None, provided: frozenset[str] = frozenset()) -> "PipelineOptions":
        """Every `auto` replaced by what runs for this model folder; folders the chosen modules
        need are checked here, naming what is missing. `provided`: modules the caller passes as
        built objects ("view_selector", "token_selector", "eagle"), present whatever the folder."""
        folder = Path(model_dir) if model_dir else None
        lite = self.pipeline == PipelineKind.LITEVLM

        def present(explicit: str, sub: str, marker: str) -> bool:
            if sub in provided:
                return True
            path = Path(explicit) if explicit else (folder / sub if folder else None)
            return path is not None and (path / marker).is_file()

        views, tokens, decoding = self.views, self.tokens, self.decoding
        if views.mode == ViewMode.AUTO:
            on = lite and present(views.selector_dir, "view_selector", "config.json")
            views = replace(views, mode=ViewMode.SELECTOR if on else ViewMode.ALL)
        if tokens.mode == TokenMode.AUTO:
            on = lite and present(tokens.selector_dir, "token_selector", "model.safetensors")
            tokens = replace(tokens, mode=TokenMode.SELECTOR if on else TokenMode.OFF)
        if tokens.keep_ratio == 0.0:
            tokens = replace(tokens, keep_ratio=PAPER_KEEP_RATIO[self.backend.precision]
                             if self.backend.name == BackendName.TENSORRT else PAPER_KEEP_RATIO["fp16"])
        if decoding.mode == DecodingMode.AUTO:
            on = lite and present(decoding.draft_dir, "eagle", "model.safetensors")
            decoding = replace(decoding, mode=DecodingMode.EAGLE if on else DecodingMode.GREEDY)
        for mode, explicit, sub, marker, what in (
            (
                views.mode == ViewMode.SELECTOR,
                views.selector_dir,
                "view_selector",
                "config.json",
                "views.mode selector",
            ),
            (
                tokens.mode == TokenMode.SELECTOR,
                tokens.selector_dir,
                "token_selector",
                "model.safetensors",
                "tokens.mode selector",
            ),
            (
                decoding.mode == DecodingMode.EAGLE,
                decoding.draft_dir,
                "eagle",
                "model.safetensors",
                "decoding.mode eagle",
            ),
        ):
            if mode and not present(explicit, sub, marker):
                where = explicit or (folder / sub if folder else f"<model_dir>/{sub}")
                raise InputError(f"{what}: no {marker} in {where} (train one with `litevlm train "
                                 f"{ {'view_selector': 'views', 'token_selector': 'tokens', 'eagle': 'eagle'}[sub]}`)")
        if decoding.mode == DecodingMode.EAGLE and self.fastv.ratio > 0:
            raise InputError("fastv.ratio with decoding.mode eagle: FastV and EAGLE-2 are separate ablation rows")
        temporal = self.temporal
        if temporal.mode == "auto":      # camera x time selection goes with view selection
            temporal = replace(temporal, mode="selector" if views.mode == ViewMode.SELECTOR else "all")
        return replace(self, views=views, tokens=tokens, decoding=decoding, temporal=temporal)

    def modules(self) -> list[str]:
        """The LiteVLM modules on, of a resolved configuration."""
        on = []
        if self.views.mode == ViewMode.SELECTOR:
            on.append("views")
        if self.tokens.mode in (TokenMode.SELECTOR, TokenMode.LAYER0) and self.tokens.keep_ratio < 1.0:
            on.append(f"tokens@{self.tokens.keep_ratio:g}")      # r = 1 keeps everything: no stage
        if self.decoding.mode == DecodingMode.EAGLE:
            on.append("eagle")
        if self.fastv.ratio > 0:
            on.append(f"fastv@{1 - self.fastv.ratio:g}")
        return on

    def label(self) -> str:
        """Which pipeline serves (resolved options): 'baseline', or 'litevlm[views,tokens@0.8,eagle]'."""
        on = self.modules()
        return f"litevlm[{','.join(on)}]" if on else "baseline"

    def threads(self) -> int:
        return self.backend.threads or default_threads()


# The dotted prefix of each section's fields (for messages and the flat view).
SECTION_OF = {
    "Images": "images.",
    "Views": "views.",
    "Tokens": "tokens.",
    "Decoding": "decoding.",
    "EagleTree": "decoding.eagle.",
    "Backend": "backend.",
    "Serving": "serving.",
    "Temporal": "temporal.",
    "ArenaOptions": "arena.",
    "FastVOptions": "fastv.",
    "PipelineOptions": "",
}


# ---------------------------------------------------------------------- the flat view
@dataclass(frozen=True)
class Setting:
    key: str              # dotted name: CLI flag --KEY, ROS parameter KEY, YAML nesting
    kind: type            # bool | int | float | str
    default: Any          # as the ROS parameter / YAML value (enums as their strings)
    help: str
    lo: Any = None
    hi: Any = None
    choices: tuple | None = None
    live: bool = False


def _leaves(cls, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if f.metadata.get("nested"):
            yield from _leaves(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, kind


def settings(cls=None) -> list[Setting]:
    """Every setting of PipelineOptions that the node and CLI expose, in declaration order."""
    out = []
    for key, f, kind in _leaves(cls or PipelineOptions):
        if not f.metadata.get("ros", True):
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        if isinstance(kind, type) and issubclass(kind, Enum):
            choices, default, kind = tuple(m.value for m in kind), default.value, str
        out.append(Setting(key, kind, default, f.metadata["help"], f.metadata.get("lo"), f.metadata.get("hi"),
                           tuple(choices) if choices else None, f.metadata.get("live", False)))
    return out


def parse_value(key: str, kind: type, raw):
    """A setting's value from a string (CLI, `--set`) or a YAML/ROS value, checked against its type."""
    if isinstance(raw, str) and kind is not str:
        text = raw.strip().lower()
        try:
            if kind is bool:
                if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                return text in ("1", "true", "yes", "on")
            return kind(text)
        except ValueError:
            raise InputError(f"{key}: {raw!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise InputError(f"{key}: {raw!r} is not a {kind.__name__}")
    return raw


def options_from_flat(values: dict[str, Any], base: PipelineOptions | None = None) -> PipelineOptions:
    """PipelineOptions with the dotted settings in `values` applied over `base` (default: the
    defaults). An unknown key is an error naming it; values are type-checked and validated."""
    known = {s.key: s for s in settings()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InputError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
    tree = as_tree(base or PipelineOptions())
    for key, raw in values.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = parse_value(key, known[key].kind, raw)
    return from_tree(PipelineOptions, tree)


def flat_from_options(options: PipelineOptions) -> dict[str, Any]:
    out = {}
    for s in settings():
        value = options
        for part in s.key.split("."):
            value = getattr(value, part)
        out[s.key] = value.value if isinstance(value, Enum) else value
    return out


def as_tree(obj) -> dict:
    return {f.name: as_tree(getattr(obj, f.name)) if is_dataclass(getattr(obj, f.name)) else getattr(obj, f.name)
            for f in fields(obj)}


def from_tree(cls, tree: dict):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        value = tree[f.name]
        kwargs[f.name] = from_tree(hints[f.name], value) if f.metadata.get("nested") else value
    return cls(**kwargs)


# ---------------------------------------------------------------------- CLI flags
def add_option_flags(parser, *, with_model: bool = True) -> None:
    """`--model` plus one flag per setting, named as the setting (`--tokens.keep_ratio 0.9`)."""
    if with_model:
        parser.add_argument("--model", type=Path, required=True, help="InternVL2.5 checkpoint folder")
    group = parser.add_argument_group("pipeline settings (the same names as the node's parameters)")
    for s in settings():
        metavar = "|".join(s.choices) if s.choices and s.kind is str else s.kind.__name__.upper()
        group.add_argument(f"--{s.key}", dest=f"opt:{s.key}", default=None, metavar=metavar,
                           help=f"{s.help} (default {s.default!r})")
    group.add_argument("--set", dest="opt_set", action="append", default=[], metavar="KEY=VALUE",
                       help="any setting as KEY=VALUE (repeatable)")


def options_from_args(args, **overrides) -> PipelineOptions:
    """The flags of add_option_flags -> PipelineOptions; keyword overrides (dotted names as
    keys) apply first, so that explicit flags win over a command's own defaults."""
    values = dict(overrides)
    for item in getattr(args, "opt_set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise InputError(f"--set {item!r}: expected KEY=VALUE")
        values[key.strip()] = raw
    for key, raw in vars(args).items():
        if key.startswith("opt:") and raw is not None:
            values[key[4:]] = raw
    return options_from_flat(values)
