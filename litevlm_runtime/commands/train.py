"""`litevlm train {views,tokens,eagle,vlm}`: one sub-command per trainer; each one's parser is in
commands/train_<name>.py and its training code in litevlm_runtime.training.<name>."""

from __future__ import annotations

from . import train_eagle, train_tokens, train_views, train_vlm

TRAINERS = {"views": train_views, "tokens": train_tokens, "eagle": train_eagle, "vlm": train_vlm}


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a module (view selector, token selector, EAGLE-2 head, VLM)")
    sub = parser.add_subparsers(dest="trainer", required=True)
    for module in TRAINERS.values():
        module.register(sub)
