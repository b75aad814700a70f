"""The node-parameter flags of the commands that run the node or its serving code (drive, bag
eval/soak/peak, fleet): --params FILE, --set NAME=VALUE (repeatable) and, where a model folder is
the usual change, --model DIR as shorthand for --set model_dir=DIR."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def add_node_param_flags(p, model: bool = False) -> None:
    p.add_argument("--params", type=Path, help="the node's parameters YAML (default: config/drive.yaml)")
    if model:
        p.add_argument("--model", type=Path, help="shorthand for --set model_dir=DIR")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one node parameter (YAML value syntax), e.g. --set tokens.keep_ratio=0.9")


def parse_sets(items: list[str], flag: str = "--set") -> dict[str, str]:
    """NAME=VALUE items as {name: value}, in order; a malformed item is refused naming it and `flag`."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InputError(f"{flag} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def overrides(args) -> dict[str, str]:
    """The parameters a command's flags override: its --set items, then --model as model_dir."""
    out = parse_sets(args.set)
    if getattr(args, "model", None):
        out["model_dir"] = str(args.model)
    return out
