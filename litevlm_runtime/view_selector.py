"""View selector: which of the six cameras a question needs, decided from the text alone.

Runs first in the pipeline, before any image is decoded (DESIGN.md section 3). Three parts:

1. `keyword_map(question)`: spatial words and phrases ("front left", "behind", "rear right",
   ...) -> a score in [0, 1] per camera, plus the cameras named in DriveLM object tags
   `<cN,CAM_X,x,y>` (those are certain).
2. `ViewSelector`: a small transformer encoder over the tokenized question, one learnable latent
   query per camera cross-attending to it, and an MLP mapping each latent to one logit.
3. `LoadedViewSelector.scores/select`: fusion `w * keyword + (1 - w) * sigmoid(logit)`, a
   threshold, tagged cameras always kept, at least one camera kept when the question has a cue,
   all cameras when it has none.

The selector has its own word-level tokenizer (`tokenizer.json`, Hugging Face `tokenizers`
format), so it does not depend on the VLM's tokenizer being present. A selector folder holds
`config.json`, `model.safetensors` and `tokenizer.json`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .cameras import CAMERAS
from .checkpoint import read_safetensors
from .errors import CheckpointError, InputError
from .integrity import verify_model_folder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"

# ---------------------------------------------------------------------------------------------
# Object tags and the keyword map
# ---------------------------------------------------------------------------------------------

# DriveLM object reference: <c1,CAM_BACK,1088.3,497.5> (object id, camera, pixel centre).
OBJECT_TAG = re.compile(r"<c\d+,\s*(CAM_[A-Z_]+)\s*,\s*-?[\d.]+\s*,\s*-?[\d.]+\s*>")

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
    named = set(OBJECT_TAG.findall(text))
    return [cam for cam in CAMERAS if cam in named]


def spatial_phrases(text: str) -> list[str]:
    """The spatial phrases found in `text` (longest match first, non-overlapping), in order."""
    return _PHRASE_RE.findall(OBJECT_TAG.sub(" ", text).lower())


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
    from tokenizers import Regex, normalizers

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
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

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
    from tokenizers import Tokenizer

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
    # Fusion at inference: score = keyword_weight * keyword_map + (1 - keyword_weight) * sigmoid.
    # With keyword_weight >= threshold a keyword camera is always kept; a camera without a
    # keyword needs sigmoid >= threshold / (1 - keyword_weight).
    keyword_weight: float = 0.4
    threshold: float = 0.4


class ViewSelector(nn.Module):
    """Question tokens -> one logit per camera (CAMERAS order)."""

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

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """ids, pad_mask: [B, T] (pad_mask True where padding) -> logits [B, cameras]."""
        ids, pad_mask = ids[:, : self.cfg.max_len], pad_mask[:, : self.cfg.max_len]
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        queries = self.latent_queries.unsqueeze(0).expand(ids.shape[0], -1, -1)
        latents, _ = self.cross_attention(queries, x, x, key_padding_mask=pad_mask, need_weights=False)
        return self.head(latents + queries).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Fusion and the object the pipeline calls
# ---------------------------------------------------------------------------------------------


@dataclass
class Selection:
    cameras: list[str]          # kept, CAMERAS order, never empty
    scores: dict[str, float]    # fused score per camera
    keyword: dict[str, float]   # keyword-map score per camera
    module: dict[str, float]    # sigmoid of the module's logit per camera
    reason: str                 # "selected" | "argmax" (cue but nothing passed) | "no_cue" (all cameras)


def fuse(
    keyword: dict[str, float],
    module: dict[str, float] | None,
    tagged: list[str],
    keyword_weight: float,
    threshold: float,
) -> Selection:
    """The selection rule, shared by the trained selector and the keyword-only baseline.

    module=None is the keyword-map-only selector (fused score = keyword score).
    """
    if module is None:
        fused = dict(keyword)
    else:
        fused = {c: keyword_weight * keyword[c] + (1.0 - keyword_weight) * module[c] for c in CAMERAS}
    kept = [c for c in CAMERAS if fused[c] >= threshold or c in tagged]
    has_cue = bool(tagged) or any(v > 0 for v in keyword.values())
    reason = "selected"
    if not kept:
        if has_cue:
            # At least one camera: the best-scoring one.
            kept, reason = [max(CAMERAS, key=lambda c: fused[c])], "argmax"
        else:
            # No keyword, no tag and the module not confident about any camera: keep all.
            kept, reason = list(CAMERAS), "no_cue"
    return Selection(kept, fused, dict(keyword), dict(module) if module else {c: 0.0 for c in CAMERAS}, reason)


class LoadedViewSelector:
    """A trained (or freshly initialised) selector with its tokenizer and fusion settings."""

    def __init__(self, model: ViewSelector, tokenizer, device: str | torch.device = "cpu"):
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.cfg = model.cfg

    @torch.inference_mode()
    def module_probs(self, questions: list[str]) -> torch.Tensor:
        """sigmoid(logits) [B, cameras] for a batch of questions."""
        ids, pad = encode_batch(self.tokenizer, questions, self.cfg.max_len, self.device)
        return torch.sigmoid(self.model(ids, pad)).float().cpu()

    def explain(self, question: str) -> Selection:
        if not isinstance(question, str) or not question.strip():
            raise InputError("view selector: the question is empty")
        probs = self.module_probs([question])[0].tolist()
        module = dict(zip(CAMERAS, probs))
        return fuse(keyword_map(question), module, tagged_cameras(question), self.cfg.keyword_weight, self.cfg.threshold)

    def select(self, question: str) -> list[str]:
        """Camera names to process, in CAMERAS order; never empty."""
        return self.explain(question).cameras

    def scores(self, question: str) -> dict[str, float]:
        """Fused score per camera (what `select` thresholds)."""
        return self.explain(question).scores


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
        "keyword_weight": model.cfg.keyword_weight,
        "threshold": model.cfg.threshold,
    }
    config.update(extra or {})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_view_selector(
    path: str | Path,
    device: str | torch.device = "cpu",
    keyword_weight: float | None = None,
    threshold: float | None = None,
) -> LoadedViewSelector:
    """Load a selector folder (config.json, model.safetensors, tokenizer.json).

    keyword_weight / threshold override the saved fusion settings for this instance only.
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
    if keyword_weight is not None:
        arch["keyword_weight"] = keyword_weight
    if threshold is not None:
        arch["threshold"] = threshold
    cfg = ViewSelectorConfig(**arch)
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
