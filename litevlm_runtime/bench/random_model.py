"""A Pipeline over random weights of a preset's shape, built in memory: for measuring what the
real sizes cost on a device (`litevlm bench --preset`, scripts/gpu_check.py), where no trained
InternVL2.5 checkpoint is at hand."""

from __future__ import annotations

import torch

from ..options import DecodingMode
from ..pipeline.pipeline import Pipeline
from ..pipeline.runtime import DTYPES
from ..weights.presets import UPSTREAM_VOCAB
from ..weights.random_init import random_draft, random_internvl, small_tokenizer


def random_pipeline(preset_name: str, options, seed: int = 0):
    """A Pipeline over a random model of the preset with a random EAGLE-2 head (when the options
    decode with EAGLE) and the untrained token selector."""
    tok = small_tokenizer()
    vocab = UPSTREAM_VOCAB.get(preset_name, 92553 if preset_name.startswith("internvl") else tok.vocab_size)
    model = random_internvl(preset_name, vocab, torch.device(options.device), DTYPES[options.dtype], seed)
    eagle = options.decoding.mode in (DecodingMode.EAGLE, DecodingMode.AUTO) and options.pipeline.value == "litevlm"
    draft = random_draft(model) if eagle or options.decoding.mode == DecodingMode.EAGLE else None
    return Pipeline.from_model(model, tok, options, name=f"{preset_name} (random weights)", draft=draft)
