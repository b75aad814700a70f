"""`litevlm drive [--params FILE] [--set NAME=VALUE ...]`: run the ROS 2 node.

The same node and parameters as `ros2 launch litevlm drive.launch.py`, for machines without the
`ros2` CLI and launch (the ROS 2 wheels): it also drives the lifecycle (configure, activate) and
selects the Fast DDS large-data profile (config/fastdds_large_data.xml) unless
FASTDDS_DEFAULT_PROFILES_FILE is set.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def run(args) -> int:
    from ..ros.node import NODE_NAME, config_dir, run_node

    params = args.params or config_dir() / "drive.yaml"
    if not Path(params).is_file():
        raise InputError(f"--params {params}: no such file")
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InputError(f"--set {item!r}: expected NAME=VALUE")
        overrides[name] = value
    return run_node(params, overrides, node_name=args.node_name or NODE_NAME)


def register(subparsers) -> None:
    p = subparsers.add_parser("drive", help="run the ROS 2 node (camera topics + queries -> answers)")
    p.add_argument("--params", type=Path, help="node parameters YAML (default: config/drive.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one parameter (YAML value syntax), e.g. --set model_dir=runs/models/tiny")
    p.add_argument("--node-name", help="node name (the YAML must use the same name)")
    p.set_defaults(func=run)
