"""`litevlm make-checkpoint --preset tiny|small OUT`: a random-weight checkpoint in the real
InternVL2.5 layout (config.json, safetensors, tokenizer.json), for tests and as a training start."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..weights.checkpoint import write_checkpoint
from ..weights.corpus import default_corpus
from ..models.internvl import InternVL
from ..weights.presets import PRESETS, preset
from ..weights.tokenizer import Tokenizer, train_bpe_tokenizer


def init_weights(model: InternVL, seed: int, std: float = 0.02) -> None:
    """Deterministic random init in the spirit of the upstream models (normal(0, std) weights,
    zero biases, unit norms, layer scale 1), so activations keep a sane scale at any width."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ls1", "ls2", "layernorm.weight",
                              "attention_norm.weight", "ffn_norm.weight", "mlp1.0.weight")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_checkpoint(out: Path, preset_name: str, seed: int = 0, corpus: list[str] | None = None,
                    vocab_size: int = 2000, shard_bytes: int | None = None) -> Path:
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        train_bpe_tokenizer(corpus or default_corpus(), vocab_size, tok_file)
        real_vocab = Tokenizer(Path(tmp)).vocab_size
        model = InternVL(preset(preset_name, vocab_size=real_vocab))
        init_weights(model, seed)
        write_checkpoint(out, model, tok_file, shard_bytes=shard_bytes)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("make-checkpoint", help="write a random-weight checkpoint in the InternVL2.5 layout")
    p.add_argument("out", type=Path)
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary of the tokenizer trained for it")
    p.add_argument("--corpus", type=Path, help="text file (one line per sample) to train the tokenizer on")
    p.add_argument("--shard-mb", type=float, help="write sharded safetensors of at most this size")

    def run(args) -> int:
        corpus = args.corpus.read_text().splitlines() if args.corpus else None
        shard = int(args.shard_mb * 2**20) if args.shard_mb else None
        make_checkpoint(args.out, args.preset, args.seed, corpus, args.vocab_size, shard)
        print(f"wrote {args.preset} checkpoint to {args.out}")
        return 0

    p.set_defaults(func=run)
