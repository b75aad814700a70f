"""`litevlm drive [--params FILE] [--set NAME=VALUE ...] [--namespace NS] [--remap FROM:=TO ...]`

The same node, parameters and remappings as `ros2 launch litevlm drive.launch.py`, for machines
without the `ros2` CLI and launch (the ROS 2 wheels): it also drives the lifecycle (configure,
activate). Like the `litevlm bag` tools it talks to, it selects the Fast DDS large-data profile
(config/fastdds_large_data.xml: shared memory + UDP on 127.0.0.1 only) unless
FASTDDS_DEFAULT_PROFILES_FILE is set; `--fastdds-profile none` leaves Fast DDS's defaults (other
hosts reachable) but for the node's 50 ms writer heartbeat, as under launch without a profile
(config/fastdds_node.xml), `--fastdds-profile FILE` picks one.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError
from .node_params import add_node_param_flags
from .node_params import overrides as node_overrides

LOG_LEVELS = ("debug", "info", "warn", "error", "fatal")


def run(args) -> int:
    from ..ros.dds_env import use_large_data_profile
    from ..ros.parameters import NODE_NAME
    from ..ros.params_file import config_dir, load_node_params
    from ..ros.runner import ros_arguments, run_node

    params = args.params or config_dir() / "drive.yaml"
    if not Path(params).is_file():
        raise InputError(f"--params {params}: no such file")
    overrides = node_overrides(args)
    for rule in args.remap:
        if ":=" not in rule or rule.startswith(":=") or rule.endswith(":="):
            raise InputError(f"--remap {rule!r}: expected FROM:=TO, e.g. query:=/car1/ask")
    # rclpy ignores a parameter the node does not declare: a misspelt key in the file or in --set
    # would silently do nothing, so both are checked against the declared names first.
    load_node_params(params, overrides)
    if args.fastdds_profile == "none":
        os.environ.pop("FASTDDS_DEFAULT_PROFILES_FILE", None)
    elif args.fastdds_profile:
        if not Path(args.fastdds_profile).is_file():
            raise InputError(f"--fastdds-profile {args.fastdds_profile}: no such file")
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(Path(args.fastdds_profile).resolve())
    else:
        use_large_data_profile()
    ros_args = ros_arguments(params, overrides, namespace=args.namespace, remaps=args.remap,
                             log_level=args.log_level)
    return run_node(ros_args, node_name=args.node_name or NODE_NAME)


def register(subparsers) -> None:
    p = subparsers.add_parser("drive", help="run the ROS 2 node (camera topics + queries -> answers)")
    add_node_param_flags(p)
    p.add_argument(
        "--namespace", default="", help="the node's namespace, e.g. /car1 (every relative topic moves with it)"
    )
    p.add_argument("--remap", action="append", default=[], metavar="FROM:=TO",
                   help="a ROS remapping rule, before the shipped ones (query:=litevlm/query ...), e.g. "
                        "cam_front/image_raw/compressed:=/front/image/compressed")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="", help="the node's log level (default info)")
    p.add_argument(
        "--fastdds-profile",
        default="",
        metavar="FILE|none",
        help="Fast DDS XML profile (default: $FASTDDS_DEFAULT_PROFILES_FILE, else config/fastdds_large_data.xml; "
        "none: Fast DDS defaults, writer heartbeat 50 ms: config/fastdds_node.xml)",
    )
    p.add_argument("--node-name", help="node name (the YAML must use the same name)")
    p.set_defaults(func=run)
