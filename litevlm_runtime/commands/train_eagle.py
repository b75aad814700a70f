"""`litevlm train eagle`: the command line of litevlm_runtime.training.eagle."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("eagle", help="distill an EAGLE-2 draft head from the target model")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, action="append", required=True, help="DriveLM-format QA json (repeatable)")
    p.add_argument("--frames", type=Path, required=True, help="root the QA image paths resolve under")
    p.add_argument("--out", type=Path, help="default: <model>/eagle")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--holdout", type=int, default=20)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int)
    p.add_argument("--tree", default="60,6,10", help="total,depth,topk of the draft tree for the held-out metric")

    def run(args):
        # (training loads torch: imported when run, so `--help` loads none)
        from ..training.eagle import EagleTraining, train_eagle

        tree = tuple(int(x) for x in args.tree.split(","))
        if len(tree) != 3:
            raise InputError(f"--tree {args.tree!r}: total,depth,topk (three integers)")
        train_eagle(args.model, args.data, args.frames, args.out,
                    EagleTraining(samples=args.samples, holdout=args.holdout, epochs=args.epochs, lr=args.lr,
                                  noise=args.noise, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                  threads=args.threads, tree=tree))
        return 0

    p.set_defaults(func=run)
