"""The EAGLE-2 draft head's folder (`<model>/eagle/`): model.safetensors with the head's own weights
(the embedding table, LM head and RoPE table are the target's) and config.json naming the target
family and how it was trained; verified against the folder's manifest when it has one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..models.config import LLMConfig
from ..models.decoder import RotaryTable
from ..models.eagle import DraftHead
from .checkpoint import check_state_dict, read_safetensors
from .integrity import verify_model_folder


def save_draft_head(draft: DraftHead, folder: Path, record: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in draft.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {"architecture": "eagle2_draft_head", "llm_architecture": draft.cfg.architecture, **record}, indent=2
        )
        + "\n"
    )


def load_draft_head(folder: Path, cfg: LLMConfig, rope: RotaryTable, dtype: torch.dtype) -> DraftHead:
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: EAGLE-2 draft head weights missing")
    verify_model_folder(folder)
    draft = DraftHead(cfg)
    state = read_safetensors(weights)
    check_state_dict(weights, state, draft.state_dict())
    draft.load_state_dict(state)
    draft.rope = rope
    return draft.to(dtype).eval()
