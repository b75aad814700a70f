"""Random-weight models of a preset's shape, built in memory (no checkpoint file): for measuring
what the real sizes cost on a device (`litevlm bench --preset`, scripts/gpu_check.py), where no
trained InternVL2.5 checkpoint is at hand. Initialised as make-checkpoint does."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

ONES = ("norm.weight", "norm1.weight", "norm2.weight", "ls1", "ls2", "attention_norm.weight", "ffn_norm.weight",
        "mlp1.0.weight")


def random_internvl(preset_name: str, vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """InternVL of the preset on `device`: normal(0, 0.02) weights, unit norms and layer scales,
    zero biases; seconds even at 2B on a GPU."""
    from .models.internvl import InternVL
    from .weights.presets import preset

    torch.manual_seed(seed)
    with torch.device(device):
        model = InternVL(preset(preset_name, vocab_size=vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ONES):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def random_draft(model):
    """An EAGLE-2 head started from the target's last layer, as `litevlm train eagle` starts it."""
    from .models.eagle import DraftHead

    lm = model.language_model
    draft = DraftHead(lm.cfg).to(lm.embed.weight.device, lm.embed.weight.dtype)
    src = lm.layers[-1].state_dict()
    draft.layer.load_state_dict({k: v for k, v in src.items() if k in draft.layer.state_dict()})
    return draft.eval()


def small_tokenizer():
    """The tiny preset's tokenizer (its ids fit any vocabulary): prompts for a random model."""
    from .commands.make_checkpoint import make_checkpoint
    from .weights.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), "tiny")
        tok = Tokenizer(Path(tmp))
        tok.vocab_size          # read what it needs while the files exist
    return tok


def random_pipeline(preset_name: str, options, seed: int = 0):
    """A Pipeline over a random model of the preset with a random EAGLE-2 head (when the options
    decode with EAGLE) and the untrained token selector."""
    from .options import DecodingMode
    from .pipeline.pipeline import Pipeline
    from .pipeline.runtime import DTYPES

    tok = small_tokenizer()
    vocab = 92553 if preset_name.startswith("internvl") else tok.vocab_size
    model = random_internvl(preset_name, vocab, torch.device(options.device), DTYPES[options.dtype], seed)
    eagle = options.decoding.mode in (DecodingMode.EAGLE, DecodingMode.AUTO) and options.pipeline.value == "litevlm"
    draft = random_draft(model) if eagle or options.decoding.mode == DecodingMode.EAGLE else None
    return Pipeline.from_model(model, tok, options, name=f"{preset_name} (random weights)", draft=draft)
