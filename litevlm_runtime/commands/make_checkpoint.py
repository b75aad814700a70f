"""`litevlm make-checkpoint --preset tiny|small OUT`: a random-weight checkpoint in the real
InternVL2.5 layout (config.json, safetensors, tokenizer.json), for tests and as a training start."""

from __future__ import annotations

from pathlib import Path

from ..weights.presets import PRESETS


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
        from ..weights.random_init import make_checkpoint

        make_checkpoint(args.out, args.preset, args.seed, corpus, args.vocab_size, shard)
        print(f"wrote {args.preset} checkpoint to {args.out}")
        return 0

    p.set_defaults(func=run)
