"""Token selector: a copy of the decoder's first layer, run as its own stage before prefill, that
ranks visual tokens by how much the question attends to them and keeps the top fraction r.

Over the full prompt (template, every camera's visual tokens, question; original positions, causal
mask), the layer's attention probabilities from the question rows to the visual columns,
softmax(q k^T / sqrt(d)) over each question row's causal span, are averaged over heads and then
maxed (default) or averaged over the question tokens: one score per visual token. Each camera
keeps its top round(r * count) tokens (half up, at least one) in their original order (scope
"camera"), or the prompt keeps the top r of all visual tokens (scope "global").

Why per camera by default: the view selector has already decided which cameras matter, so every
selected camera keeps the same share; the kept count is then fixed by (cameras, r), which maps
onto the static shape buckets of the prefill engines; and a camera whose tokens all score low
relative to another (a dark rear view beside a busy front view) is not starved.

Only q of the question rows and k of the rows before them are needed, so the stage computes
exactly those (the layer's norm, q/k projection and RoPE) and no value, output projection, MLP
or KV cache: the scores are the same numbers the full layer computes, at a fraction of the cost.
Being its own module with its own weights, it leaves the decoder's graph untouched.

Weights: `load_token_selector(folder, lm)` reads `<folder>/model.safetensors` + `config.json`
(what `litevlm train tokens` writes, usually `<model>/token_selector/`), or, with folder None,
copies layer 0 of the loaded decoder (the untrained selector).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..weights.checkpoint import check_state_dict, read_safetensors
from ..models.config import LLMConfig
from ..errors import CheckpointError, InputError
from ..weights.integrity import verify_model_folder
from ..models.decoder import RotaryTable, attention_probs
from ..models.internlm2 import InternLM2Layer
from ..models.qwen2 import Qwen2Layer

LAYERS = {"internlm2": InternLM2Layer, "qwen2": Qwen2Layer}
REDUCTIONS = ("max", "mean")
SCOPES = ("camera", "global")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
ARCHITECTURE = "litevlm_token_selector"


@dataclass
class PromptLayout:
    """Where things are in the full prompt (every visual token present; row index = position id)."""

    length: int                          # full prompt length
    spans: list[tuple[int, int]]         # per camera: (first row, count) of its visual tokens
    question: tuple[int, int]            # [start, end) rows of the question text


def kept_count(count: int, keep_ratio: float) -> int:
    """Visual tokens kept out of `count` at ratio r: r * count rounded half up, at least one."""
    return max(1, min(count, int(math.floor(keep_ratio * count + 0.5)))) if count else 0


def check_keep_ratio(keep_ratio: float) -> None:
    if not (0.0 < keep_ratio <= 1.0):
        raise InputError(f"token keep ratio must lie in (0, 1], got {keep_ratio}")


class TokenSelector(nn.Module):
    def __init__(self, cfg: LLMConfig, reduce: str = "max", rope: RotaryTable | None = None):
        super().__init__()
        if reduce not in REDUCTIONS:
            raise InputError(f"token selector reduce must be one of {REDUCTIONS}, got {reduce!r}")
        self.cfg = cfg
        self.reduce = reduce
        self.layer = LAYERS[cfg.architecture](cfg)
        self.rope = rope                  # the decoder's table (shared, sized once)

    @classmethod
    def from_decoder(cls, lm, reduce: str = "max") -> "TokenSelector":
        """The untrained selector: a copy of the decoder's layer 0 (its own tensors from here on)."""
        sel = cls(lm.cfg, reduce, rope=lm.rope)
        sel.layer = copy.deepcopy(lm.layers[0])
        return sel

    def score_parameters(self) -> list[nn.Parameter]:
        """The parameters the scores depend on (input norm, q/k projections): what training
        updates. The rest of the layer (v, output projection, MLP) never touches a score."""
        layer = self.layer
        if self.cfg.architecture == "internlm2":
            projections = [layer.attention.wqkv]        # packed q/k/v: the v rows get zero gradient
        else:
            projections = [layer.self_attn.q_proj, layer.self_attn.k_proj]
        return list(layer.attn_norm.parameters()) + [p for m in projections for p in m.parameters()]

    # ------------------------------------------------------------------ scores
    def question_attention(self, embeds: torch.Tensor, positions: torch.Tensor,
                           question: tuple[int, int]) -> torch.Tensor:
        """Attention probabilities [heads, question rows, rows before the question's end] (float32).

        Row i of the question attends causally to rows 0..i; entries past that are 0.
        """
        q_start, q_end = question
        x = embeds[:q_end]                                   # later rows are invisible to the question
        cos, sin = self.rope(positions[:q_end], x.dtype)
        q, k = self.layer.query_key(x, cos, sin)
        rows = torch.arange(q_start, q_end, device=x.device)
        cols = torch.arange(q_end, device=x.device)
        return attention_probs(q[q_start:], k, cols[None, :] <= rows[:, None])

    def scores(self, embeds, positions, question, visual_rows: torch.Tensor, reduce: str | None = None) -> torch.Tensor:
        """One score per visual row: question->visual attention, mean over heads, max/mean over question."""
        probs = self.question_attention(embeds, positions, question)[:, :, visual_rows]   # [H, Tq, V]
        per_token = probs.mean(0)                                                         # [Tq, V]
        if (reduce or self.reduce) == "max":
            return per_token.max(0).values
        return per_token.mean(0)

    @torch.no_grad()
    def select(self, embeds: torch.Tensor, positions: torch.Tensor, layout: PromptLayout,
               keep_ratio: float, scope: str = "camera") -> list[torch.Tensor]:
        """Per camera: the kept token indices (0..count-1, ascending = original order)."""
        check_keep_ratio(keep_ratio)
        if scope not in SCOPES:
            raise InputError(f"token selection scope must be one of {SCOPES}, got {scope!r}")
        device = embeds.device
        visual_rows = torch.cat([torch.arange(s, s + c, device=device) for s, c in layout.spans])
        score = self.scores(embeds, positions, layout.question, visual_rows)
        keep: list[torch.Tensor] = []
        if scope == "camera":
            offset = 0
            for _, count in layout.spans:
                top = score[offset:offset + count].topk(kept_count(count, keep_ratio)).indices
                keep.append(top.sort().values)
                offset += count
        else:
            top = score.topk(kept_count(len(score), keep_ratio)).indices.sort().values
            offset = 0
            for _, count in layout.spans:
                mine = top[(top >= offset) & (top < offset + count)]
                keep.append(mine - offset)
                offset += count
        return keep


# ---------------------------------------------------------------------- save / load
def save_token_selector(selector: TokenSelector, folder: str | Path, record: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {f"layer.{k}": v.detach().float().contiguous() for k, v in selector.layer.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"architecture": ARCHITECTURE, "llm_architecture": selector.cfg.architecture,
              "reduce": selector.reduce, "initialized_from": "decoder layer 0", **record}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_token_selector(folder: str | Path | None, lm, reduce: str | None = None,
                        dtype: torch.dtype | None = None) -> TokenSelector:
    """A trained selector from `folder`, or (folder None) the layer-0 copy of the decoder `lm`;
    either shares `lm`'s RoPE table and lives on its device.

    `reduce` overrides the folder's recorded reduction (max | mean); the layer-0 copy defaults to max.
    """
    device = lm.layers[0].attn_norm.weight.device
    if folder is None:
        sel = TokenSelector.from_decoder(lm, reduce or "max")
        return sel.to(device=device, dtype=dtype).eval()
    folder = Path(folder)
    weights, config_path = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: token selector weights missing (train them: litevlm train tokens)")
    verify_model_folder(folder)
    verify_model_folder(folder)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: cannot read token selector config ({exc})") from None
    if config.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{config_path}: not a token selector (architecture {config.get('architecture')!r})")
    if config.get("llm_architecture") != lm.cfg.architecture:
        raise CheckpointError(f"{config_path}: selector for {config.get('llm_architecture')!r}, "
                              f"decoder is {lm.cfg.architecture!r}")
    sel = TokenSelector(lm.cfg, reduce or config.get("reduce", "max"), rope=lm.rope)
    state = {k.removeprefix("layer."): v for k, v in read_safetensors(weights).items()}
    check_state_dict(weights, state, sel.layer.state_dict(), prefix="layer.")
    sel.layer.load_state_dict(state)
    return sel.to(device=device, dtype=dtype).eval()
