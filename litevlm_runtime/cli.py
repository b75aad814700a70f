"""`litevlm` command line. Each sub-command lives in its own module and registers itself here.

A module in COMMAND_MODULES exposes `register(subparsers)`, which adds its parser(s) and sets
`func` (called with the parsed args; its return value is the exit code). A command module keeps
its heavy imports (torch, rclpy, onnxruntime) inside its `run`, so that building the parser, and
`litevlm --help`, loads none of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import LiteVLMError

COMMAND_MODULES = [
    "litevlm_runtime.commands.ask",
    "litevlm_runtime.commands.prompt",
    "litevlm_runtime.commands.bench",
    "litevlm_runtime.commands.make_checkpoint",
    "litevlm_runtime.commands.checksum",
    "litevlm_runtime.commands.export",
    "litevlm_runtime.commands.build_engines",
    "litevlm_runtime.commands.calibrate",
    "litevlm_runtime.commands.quantize",
    "litevlm_runtime.commands.train",
    "litevlm_runtime.commands.eval_views",
    "litevlm_runtime.commands.drive",
    "litevlm_runtime.commands.bag",
    "litevlm_runtime.commands.synth",
    "litevlm_runtime.commands.evaluate",
    "litevlm_runtime.commands.fleet",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="litevlm", description="LiteVLM six-camera VLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LiteVLMError as exc:
        print(f"litevlm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
