"""`litevlm train {views,tokens,eagle,vlm}`: each trainer lives in litevlm_runtime.training.<name>."""

from __future__ import annotations

import importlib

TRAINERS = ["views", "tokens", "eagle", "vlm"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a module (view selector, token selector, EAGLE-2 head, VLM)")
    sub = parser.add_subparsers(dest="trainer", required=True)
    for name in TRAINERS:
        try:
            module = importlib.import_module(f"litevlm_runtime.training.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("litevlm_runtime"):
                continue  # trainer not built yet in this checkout
            raise
        module.register(sub)
