"""View selector: which of the six cameras a question needs, decided from the text alone.

Runs first in the pipeline, before any image is decoded (DESIGN.md section 3). Three parts:

1. `keyword_map(question)`: spatial words and phrases ("front left", "behind", "rear right",
   ...) -> a score in [0, 1] per camera, plus the cameras named in DriveLM object tags
   `<cN,CAM_X,x,y>` (those are certain).
2. `ViewSelector`: a small transformer encoder over the tokenized question, one learnable latent
   query per camera cross-attending to it, and an MLP mapping each latent to one logit.
3. `LoadedViewSelector.scores/select`: the fusion of both (`Fusion`). It starts from the keyword
   map's choice and lets the module add cameras, or remove the ones the keyword map is unsure of
   where the module is confident; the cameras the keyword map is certain of (tags, camera names,
   a phrase naming one camera) are kept by every rule, so on every question whose cameras the
   question names the selector keeps them. Which rule a trained selector uses is measured on
   validation frames by `litevlm train views` and recorded in its config.json.

Camera x time: a question about motion ("Is X moving?", "Will X cross the ego lane?") needs the frame
sets before the newest, a colour question none. A selector trained on motion data (`litevlm train
views` on SynthDrive in motion: a QA item's "frames" K says it needs K - 1 past frame sets) has a
seventh latent query, the time query, whose head gives a distribution over how many past frame sets
the question needs (0 .. max_past_frames). `Selection.past_frames` is that head's most likely count
where the fused evidence says the question needs time: `time_keyword_weight * time_cue(question) +
(1 - w) * P(past frames > 0)` reaching `time_threshold`, where `time_cue` is the keyword map's
counterpart for time (motion words); without a time head, the cue alone decides, and a question
that needs time gets every frame set it asked for (None). The query's `frames` is the upper bound.

The selector has its own word-level tokenizer (`tokenizer.json`, Hugging Face `tokenizers`
format), so it does not depend on the VLM's tokenizer being present. A selector folder holds
`config.json`, `model.safetensors` and `tokenizer.json`.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from ..cameras import CAMERAS
from ..errors import CheckpointError, InputError
from ..objects import OBJECT_TAG  # DriveLM object reference: <c1,CAM_BACK,1088.3,497.5> (id, camera, pixel centre)
from ..options import FUSION_RULES
from ..weights.checkpoint import read_safetensors
from ..weights.integrity import verify_model_folder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"

# ---------------------------------------------------------------------------------------------
# Object tags and the keyword map
# ---------------------------------------------------------------------------------------------

F, FL, FR, B, BL, BR = CAMERAS
_HALF = 0.5  # a neighbouring camera that may also see what the phrase names

# Spatial phrase -> {camera: score}. Matching is on lower-cased text at word boundaries,
# longest phrase first, and a matched span is consumed, so "front left" does not also fire
# "front" and "rear right" does not also fire "rear". Bare "left"/"right" are deliberately
# absent: in driving questions they are mostly manoeuvres ("turn left", "right lane"), not views.
SPATIAL_PHRASES: dict[str, dict[str, float]] = {
    # front left / front right
    "front left": {FL: 1.0},
    "front-left": {FL: 1.0},
    "left front": {FL: 1.0},
    "front right": {FR: 1.0},
    "front-right": {FR: 1.0},
    "right front": {FR: 1.0},
    # back left / back right
    "back left": {BL: 1.0},
    "back-left": {BL: 1.0},
    "rear left": {BL: 1.0},
    "rear-left": {BL: 1.0},
    "left rear": {BL: 1.0},
    "left back": {BL: 1.0},
    "behind left": {BL: 1.0},
    "back right": {BR: 1.0},
    "back-right": {BR: 1.0},
    "rear right": {BR: 1.0},
    "rear-right": {BR: 1.0},
    "right rear": {BR: 1.0},
    "right back": {BR: 1.0},
    "behind right": {BR: 1.0},
    # sides: both cameras of that side
    "left side": {FL: 1.0, BL: 1.0},
    "to the left": {FL: 1.0, BL: 1.0},
    "on the left": {FL: 1.0, BL: 1.0},
    "right side": {FR: 1.0, BR: 1.0},
    "to the right": {FR: 1.0, BR: 1.0},
    "on the right": {FR: 1.0, BR: 1.0},
    # straight ahead; the front corners overlap the front camera's field of view
    "front": {F: 1.0, FL: _HALF, FR: _HALF},
    "ahead": {F: 1.0, FL: _HALF, FR: _HALF},
    "forward": {F: 1.0, FL: _HALF, FR: _HALF},
    "front view": {F: 1.0},
    # straight behind; likewise the back corners
    "back": {B: 1.0, BL: _HALF, BR: _HALF},
    "behind": {B: 1.0, BL: _HALF, BR: _HALF},
    "rear": {B: 1.0, BL: _HALF, BR: _HALF},
    "backward": {B: 1.0, BL: _HALF, BR: _HALF},
    "backwards": {B: 1.0, BL: _HALF, BR: _HALF},
    "back view": {B: 1.0},
}
# Camera names written out ("cam_front_left", "CAM_BACK") outside of tags count as certain.
SPATIAL_PHRASES.update({cam.lower(): {cam: 1.0} for cam in CAMERAS})

_PHRASE_RE = re.compile(
    r"(?<![\w-])("
    + "|".join(re.escape(p) for p in sorted(SPATIAL_PHRASES, key=len, reverse=True))
    + r")(?![\w-])"
)


def tagged_cameras(text: str) -> list[str]:
    """Cameras named in `<cN,CAM_X,x,y>` object tags, in CAMERAS order (unknown names ignored)."""
    named = {m.group(2) for m in OBJECT_TAG.finditer(text)}
    return [cam for cam in CAMERAS if cam in named]


def spatial_phrases(text: str) -> list[str]:
    """The spatial phrases found in `text` (longest match first, non-overlapping), in order."""
    return _PHRASE_RE.findall(OBJECT_TAG.sub(" ", text).lower())


# Words that say a question is about motion: what the ego or an object does over time. A match of any
# of them is the time cue (1.0). Matched on lower-cased text at word boundaries, tags removed.
TIME_WORDS = ("moving", "move", "moves", "moved", "approaching", "approach", "approaches", "closer", "cross",
              "crosses", "crossing", "turning", "stopped", "parked", "standing", "walking", "speed", "speeding",
              "accelerating", "decelerating", "slowing", "going ahead", "moving status", "status", "do next",
              "future state", "heading", "overtaking", "overtake", "driving", "velocity")
_TIME_RE = re.compile(r"(?<![\w-])(" + "|".join(re.escape(w) for w in sorted(TIME_WORDS, key=len, reverse=True))
                      + r")(?![\w-])")


def time_cue(question: str) -> float:
    """1.0 when the question names motion (TIME_WORDS), else 0.0: the keyword map of time."""
    return 1.0 if _TIME_RE.search(OBJECT_TAG.sub(" ", question).lower()) else 0.0


def keyword_map(question: str) -> dict[str, float]:
    """Per-camera score in [0, 1] from spatial phrases and object tags (tags score 1.0)."""
    scores = {cam: 0.0 for cam in CAMERAS}
    for phrase in spatial_phrases(question):
        for cam, s in SPATIAL_PHRASES[phrase].items():
            scores[cam] = max(scores[cam], s)
    for cam in tagged_cameras(question):
        scores[cam] = 1.0
    return scores


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _normalizer():
    # Lower-case, then turn each object tag into two words "objtag cam_x": the coordinates and
    # object ids are frame-specific noise, the camera is the signal.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"<c\d+,\s*"), " objtag "),
            normalizers.Replace(Regex(r"\s*,\s*-?[\d.]+\s*,\s*-?[\d.]+\s*>"), " "),
            normalizers.Replace(Regex(r"\d+(\.\d+)?"), " 0 "),
        ]
    )


def train_tokenizer(questions: list[str], min_frequency: int = 1):
    """A word-level tokenizer over the training questions, with [PAD] (id 0) and [UNK] (id 1).

    Word level rather than BPE: the question vocabulary is small and templated, and whole words
    ("front", "behind") are exactly the units the selector reasons about.
    """
    tok = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tok.normalizer = _normalizer()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD_TOKEN, UNK_TOKEN], min_frequency=min_frequency)
    # Make sure every camera word and the spatial vocabulary exist even if the training
    # questions never use them, so that a user's "rear right" is not [UNK].
    always = ["objtag " + " ".join(c.lower() for c in CAMERAS), " ".join(SPATIAL_PHRASES)]
    tok.train_from_iterator(list(questions) + always * max(1, min_frequency), trainer=trainer)
    return tok


def load_tokenizer(path: Path):
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: not a readable tokenizers JSON file ({exc})") from None


def encode_batch(tokenizer, questions: list[str], max_len: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] (right-padded with 0, truncated to max_len) and a padding mask (True = pad)."""
    encodings = tokenizer.encode_batch(list(questions))
    length = max(1, min(max_len, max(len(e.ids) for e in encodings)))
    ids = torch.zeros(len(encodings), length, dtype=torch.long, device=device)
    pad = torch.ones(len(encodings), length, dtype=torch.bool, device=device)
    for i, e in enumerate(encodings):
        row = e.ids[:length]
        if row:
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
            pad[i, : len(row)] = False
        else:
            pad[i, 0] = False  # an empty encoding still attends to one (pad) token, never to none
    return ids, pad


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fusion:
    """How the keyword map and the module's probabilities decide the cameras.

    Every rule starts from the keyword map's choice (cameras whose keyword score reaches
    `threshold`, plus tagged ones; a question with no cue: all six) and never drops a camera the
    keyword map is certain of (`certain_cameras`). The rules differ in what the module may do:

    add        add a camera whose module probability reaches `add_threshold`; never removes, so
               the kept set always contains the keyword map's and recall can only go up.
    remove     remove an uncertain camera (a half-score neighbour such as CAM_FRONT_LEFT for
               "ahead", or any camera of a question with no cue) whose module probability is
               below `remove_threshold`, i.e. only where the module is confident it is not needed.
    add_remove both.
    weighted   the paper's rule: keep a camera when `keyword_weight * keyword + (1 -
               keyword_weight) * module` reaches `threshold` (certain cameras still kept).
    """

    rule: str = "weighted"
    threshold: float = 0.4
    keyword_weight: float = 0.4
    add_threshold: float = 0.5
    remove_threshold: float = 0.1

    def __post_init__(self):
        if self.rule not in FUSION_RULES:
            raise ValueError(f"fusion rule {self.rule!r}: expected one of {', '.join(FUSION_RULES)}")
        for name in ("threshold", "keyword_weight", "add_threshold", "remove_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fusion {name} {getattr(self, name)} is outside [0, 1]")

    def describe(self) -> str:
        return {
            "add": f"add, module >= {self.add_threshold:g}",
            "remove": f"remove, module < {self.remove_threshold:g}",
            "add_remove": f"add >= {self.add_threshold:g}, remove < {self.remove_threshold:g}",
            "weighted": f"weighted, w {self.keyword_weight:g}, thr {self.threshold:g}",
        }[self.rule]


@dataclass
class ViewSelectorConfig:
    vocab_size: int
    width: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 256
    max_len: int = 160
    dropout: float = 0.1
    cameras: list[str] = field(default_factory=lambda: list(CAMERAS))
    # Fusion at inference (see Fusion). A folder written before fusion rules existed has no
    # fusion_rule and keeps the weighted sum it was tuned for.
    fusion_rule: str = "weighted"
    keyword_weight: float = 0.4
    threshold: float = 0.4
    add_threshold: float = 0.5
    remove_threshold: float = 0.1
    # Time (camera x time selection): past frame sets the time head predicts, 0 .. max_past_frames
    # (0: no time head, a selector trained without motion data), and how its P(needs time) is fused
    # with the time cue.
    max_past_frames: int = 0
    time_keyword_weight: float = 0.4
    time_threshold: float = 0.5

    def fusion(self) -> Fusion:
        return Fusion(self.fusion_rule, self.threshold, self.keyword_weight, self.add_threshold, self.remove_threshold)


class ViewSelector(nn.Module):
    """Question tokens -> one logit per camera (CAMERAS order), and with a time head
    (cfg.max_past_frames > 0) logits over how many past frame sets the question needs."""

    def __init__(self, cfg: ViewSelectorConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.width
        # No padding_idx: with a borrowed tokenizer id 0 may be a real word; the padding mask
        # already keeps padded positions out of every attention.
        self.token_embedding = nn.Embedding(cfg.vocab_size, d)
        self.position_embedding = nn.Embedding(cfg.max_len, d)
        layer = nn.TransformerEncoderLayer(
            d, cfg.heads, cfg.ffn, cfg.dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # enable_nested_tensor=False: the nested-tensor fast path only applies to post-norm layers.
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.latent_queries = nn.Parameter(torch.randn(len(cfg.cameras), d) * 0.02)
        self.cross_attention = nn.MultiheadAttention(d, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        if cfg.max_past_frames:
            # One more latent query: each query cross-attends on its own, so the camera logits are
            # the same with or without it.
            self.time_query = nn.Parameter(torch.randn(1, d) * 0.02)
            self.time_head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(),
                                           nn.Linear(d, cfg.max_past_frames + 1))

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor, with_time: bool = False):
        """ids, pad_mask: [B, T] (pad_mask True where padding) -> logits [B, cameras]; with_time:
        forward_all's pair (what training calls through its DDP wrapper)."""
        out = self.forward_all(ids, pad_mask)
        return out if with_time else out[0]

    def forward_all(self, ids: torch.Tensor, pad_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, pad_mask: [B, T] -> (camera logits [B, cameras], time logits [B, max_past_frames + 1]
        over 0 .. max_past_frames past frame sets, or None without a time head)."""
        ids, pad_mask = ids[:, : self.cfg.max_len], pad_mask[:, : self.cfg.max_len]
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        queries = self.latent_queries
        if self.cfg.max_past_frames:
            queries = torch.cat([queries, self.time_query])
        queries = queries.unsqueeze(0).expand(ids.shape[0], -1, -1)
        latents, _ = self.cross_attention(queries, x, x, key_padding_mask=pad_mask, need_weights=False)
        out = latents + queries
        cameras = len(self.cfg.cameras)
        camera_logits = self.head(out[:, :cameras]).squeeze(-1)
        return camera_logits, (self.time_head(out[:, cameras]) if self.cfg.max_past_frames else None)


# ---------------------------------------------------------------------------------------------
# Fusion and the object the pipeline calls
# ---------------------------------------------------------------------------------------------


@dataclass
class Selection:
    cameras: list[str]          # kept, CAMERAS order, never empty
    scores: dict[str, float]    # per camera, higher = more needed; every kept camera scores above every dropped one
    keyword: dict[str, float]   # keyword-map score per camera
    module: dict[str, float]    # sigmoid of the module's logit per camera
    reason: str                 # "selected" | "argmax" (cue but nothing passed) | "no_cue" (all cameras)
    # Time: past frame sets the question needs (0: the newest only; None: every one asked for), and
    # the evidence: {"cue": time_cue, "module": P(past frames > 0) or None, "score": the fused score}
    past_frames: int | None = 0
    time: dict = field(default_factory=dict)


def certain_cameras(keyword: dict[str, float], tagged: list[str]) -> set[str]:
    """The keyword map's hard cues: cameras tagged in the question or named outright (a camera
    name, or a phrase such as "back left" that means exactly that camera: score 1.0)."""
    return set(tagged) | {c for c in CAMERAS if keyword[c] >= 1.0}


def keyword_choice(keyword: dict[str, float], tagged: list[str], threshold: float) -> tuple[list[str], str]:
    """The keyword map alone: tagged cameras and keyword scores >= threshold; with a cue but
    nothing passing, the best-scoring camera; with no cue at all, every camera."""
    kept = [c for c in CAMERAS if keyword[c] >= threshold or c in tagged]
    if kept:
        return kept, "selected"
    if tagged or any(v > 0 for v in keyword.values()):
        return [max(CAMERAS, key=lambda c: keyword[c])], "argmax"
    return list(CAMERAS), "no_cue"


def fuse(keyword: dict[str, float], module: dict[str, float] | None, tagged: list[str], fusion: Fusion) -> Selection:
    """The selection rule, shared by the trained selector and the keyword-only baseline.

    module=None is the keyword map alone (score = keyword score, cut at fusion.threshold).
    """
    base, reason = keyword_choice(keyword, tagged, fusion.threshold)
    if module is None:
        return Selection(base, dict(keyword), dict(keyword), {c: 0.0 for c in CAMERAS}, reason)
    certain = certain_cameras(keyword, tagged)
    if fusion.rule == "weighted":
        w = fusion.keyword_weight
        scores = {c: w * keyword[c] + (1.0 - w) * module[c] for c in CAMERAS}
        kept = {c for c in CAMERAS if scores[c] >= fusion.threshold} | certain
        if not kept:  # nothing passed: the best-scoring camera with a cue, all six without
            kept = {max(CAMERAS, key=lambda c: scores[c])} if reason != "no_cue" else set(base)
        for c in certain:
            scores[c] = max(scores[c], fusion.threshold)
    else:
        kept = set(base)
        if fusion.rule in ("remove", "add_remove"):
            kept -= {c for c in base if c not in certain and module[c] < fusion.remove_threshold}
        if fusion.rule in ("add", "add_remove"):
            kept |= {c for c in CAMERAS if module[c] >= fusion.add_threshold}
        if not kept:
            # Only a no-cue question can lose every camera (each cue names a certain one): the
            # module claims no view is needed, which it cannot know; fall back to all six.
            kept = set(base)
        # One score per camera that orders kept above dropped (certain first, then by module
        # probability), so that a caller with a camera budget can take the highest ones.
        scores = {c: 1.0 if c in certain else 0.5 * (c in kept) + 0.49 * module[c] for c in CAMERAS}
    cameras = [c for c in CAMERAS if c in kept]
    if set(cameras) != set(base):
        reason = "selected"  # the module changed the keyword map's choice
    return Selection(cameras, scores, dict(keyword), dict(module), reason)


def fuse_time(cue: float, probs: list[float] | None, weight: float, threshold: float) -> tuple[int | None, dict]:
    """Past frame sets a question needs, from the time cue and the time head's distribution over
    0 .. max past frame sets (`probs`, or None without a time head): 0 unless the fused score
    `weight * cue + (1 - weight) * P(> 0)` reaches `threshold` (the cue alone without a head);
    then the head's most likely count above 0, or None (every frame set asked for) without one."""
    if probs is None:
        return (None if cue >= threshold else 0), {"cue": cue, "module": None, "score": cue}
    needs = 1.0 - probs[0]
    score = weight * cue + (1.0 - weight) * needs
    if score < threshold:
        return 0, {"cue": cue, "module": needs, "score": score}
    return 1 + max(range(len(probs) - 1), key=lambda i: probs[i + 1]), {"cue": cue, "module": needs, "score": score}


SELECTIONS_KEPT = 256   # questions whose selection is remembered (a car's consumers repeat theirs every frame)


class LoadedViewSelector:
    """A trained (or freshly initialised) selector with its tokenizer and fusion settings.

    The selection is a function of the question's text alone (the selector never sees a frame):
    `explain` remembers it for the last SELECTIONS_KEPT questions, so a planner asking the same
    questions of every frame pays the selector once (2-3 ms a question on one CPU core)."""

    def __init__(self, model: ViewSelector, tokenizer, device: str | torch.device = "cpu"):
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.cfg = model.cfg
        self.fusion = model.cfg.fusion()
        self._selections: OrderedDict[str, Selection] = OrderedDict()
        self._lock = threading.Lock()        # a batching node asks from several threads

    @torch.inference_mode()
    def module_probs(self, questions: list[str]) -> torch.Tensor:
        """sigmoid(logits) [B, cameras] for a batch of questions."""
        return self.all_probs(questions)[0]

    @torch.inference_mode()
    def all_probs(self, questions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sigmoid of the camera logits [B, cameras], softmax of the time logits [B, max past + 1]
        or None without a time head) for a batch of questions."""
        ids, pad = encode_batch(self.tokenizer, questions, self.cfg.max_len, self.device)
        cameras, time = self.model.forward_all(ids, pad)
        return torch.sigmoid(cameras).float().cpu(), (None if time is None else time.softmax(-1).float().cpu())

    def explain(self, question: str) -> Selection:
        if not isinstance(question, str) or not question.strip():
            raise InputError("view selector: the question is empty")
        with self._lock:
            known = self._selections.get(question)
            if known is not None:
                self._selections.move_to_end(question)
        if known is None:
            cameras, time = self.all_probs([question])
            known = fuse(keyword_map(question), dict(zip(CAMERAS, cameras[0].tolist())), tagged_cameras(question),
                         self.fusion)
            known.past_frames, known.time = fuse_time(time_cue(question), None if time is None else time[0].tolist(),
                                                      self.cfg.time_keyword_weight, self.cfg.time_threshold)
            with self._lock:
                self._selections[question] = known
                while len(self._selections) > SELECTIONS_KEPT:
                    self._selections.popitem(last=False)
        # a copy: a caller may edit what it was given
        return Selection(list(known.cameras), dict(known.scores), dict(known.keyword), dict(known.module), known.reason,
                         known.past_frames, dict(known.time))

    def select(self, question: str) -> list[str]:
        """Camera names to process, in CAMERAS order; never empty."""
        return self.explain(question).cameras

    def scores(self, question: str) -> dict[str, float]:
        """Score per camera, highest first; the cameras `select` keeps come before the others."""
        scores = self.explain(question).scores
        return dict(sorted(scores.items(), key=lambda kv: -kv[1]))


def save_view_selector(out_dir: Path, model: ViewSelector, tokenizer, extra: dict | None = None) -> None:
    """Write config.json + model.safetensors + tokenizer.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "model_type": "litevlm_view_selector",
        "architecture": asdict(model.cfg),
        "tokenizer_file": TOKENIZER_FILE,
        "weights_file": WEIGHTS_FILE,
        "fusion": asdict(model.cfg.fusion()),  # the same settings as in "architecture", for reading
    }
    config.update(extra or {})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_view_selector(
    path: str | Path,
    device: str | torch.device = "cpu",
    keyword_weight: float | None = None,
    threshold: float | None = None,
    fusion_rule: str | None = None,
    add_threshold: float | None = None,
    remove_threshold: float | None = None,
) -> LoadedViewSelector:
    """Load a selector folder (config.json, model.safetensors, tokenizer.json).

    The fusion arguments override the saved fusion settings for this instance only.
    """
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE} (not a view selector folder)")
    verify_model_folder(path)
    try:
        config = json.loads(config_path.read_text())
        arch = dict(config["architecture"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{config_path}: malformed view selector config ({exc})") from None
    if list(arch.get("cameras", CAMERAS)) != list(CAMERAS):
        raise CheckpointError(f"{config_path}: cameras {arch.get('cameras')} differ from the rig {list(CAMERAS)}")
    overrides = {"keyword_weight": keyword_weight, "threshold": threshold, "fusion_rule": fusion_rule,
                 "add_threshold": add_threshold, "remove_threshold": remove_threshold}
    arch.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = ViewSelectorConfig(**arch)
        cfg.fusion()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: bad view selector settings ({exc})") from None
    tokenizer = load_tokenizer(path / config.get("tokenizer_file", TOKENIZER_FILE))
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.get_vocab_size()} words, config says vocab_size {cfg.vocab_size}"
        )
    weights_path = path / config.get("weights_file", WEIGHTS_FILE)
    if not weights_path.is_file():
        raise CheckpointError(f"{path}: missing {weights_path.name}")
    model = ViewSelector(cfg)
    state = read_safetensors(weights_path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: missing tensors {missing}, unexpected tensors {unexpected}")
    return LoadedViewSelector(model, tokenizer, device)
