"""Random-weight InternVL models and checkpoints of a preset's shape: the one initialisation that
`litevlm make-checkpoint`, `litevlm train vlm` (grown layers) and the in-memory models of
`litevlm bench --preset` / scripts/gpu_check.py all use."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..models.eagle import DraftHead
from ..models.internvl import InternVL
from .checkpoint import write_checkpoint
from .corpus import default_corpus
from .presets import preset
from .tokenizer import Tokenizer, train_bpe_tokenizer

# Parameters that start at one (norm scales, layer scales); biases start at zero, the rest normal(0, std).
ONES = ("norm.weight", "norm1.weight", "norm2.weight", "ls1", "ls2", "layernorm.weight",
        "attention_norm.weight", "ffn_norm.weight", "mlp1.0.weight")


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random init in the spirit of the upstream models (normal(0, std) weights,
    zero biases, unit norms, layer scale 1), so activations keep a sane scale at any width. The
    generator lives on each parameter's device, so a 2B model on a GPU initialises in seconds."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ONES):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                g = generators.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
                p.normal_(0.0, std, generator=g)


def make_checkpoint(out: Path, preset_name: str, seed: int = 0, corpus: list[str] | None = None,
                    vocab_size: int = 2000, shard_bytes: int | None = None) -> Path:
    """A random-weight checkpoint folder in the real InternVL2.5 layout (config.json,
    safetensors, a BPE tokenizer.json trained on `corpus`), for tests and as a training start."""
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        train_bpe_tokenizer(corpus or default_corpus(), vocab_size, tok_file)
        real_vocab = Tokenizer(Path(tmp)).vocab_size
        model = InternVL(preset(preset_name, vocab_size=real_vocab))
        init_weights(model, seed)
        write_checkpoint(out, model, tok_file, shard_bytes=shard_bytes)
    return out


def random_internvl(preset_name: str, vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """InternVL of the preset built on `device` (no checkpoint file), initialised as make-checkpoint does."""
    with torch.device(device):
        model = InternVL(preset(preset_name, vocab_size=vocab_size))
    init_weights(model, seed)
    return model.to(dtype).eval()


def random_draft(model):
    """An EAGLE-2 head started from the target's last layer, as `litevlm train eagle` starts it."""
    lm = model.language_model
    draft = DraftHead(lm.cfg).to(lm.embed.weight.device, lm.embed.weight.dtype)
    src = lm.layers[-1].state_dict()
    draft.layer.load_state_dict({k: v for k, v in src.items() if k in draft.layer.state_dict()})
    return draft.eval()


def small_tokenizer():
    """The tiny preset's tokenizer (its ids fit any vocabulary): prompts for a random model."""
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), "tiny")
        tok = Tokenizer(Path(tmp))
        tok.vocab_size          # read what it needs while the files exist
    return tok
