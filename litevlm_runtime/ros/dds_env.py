"""The DDS environment of the development tools: the package's Fast DDS profile for one machine
(shared memory, UDP on 127.0.0.1 only, large frames: config/fastdds_large_data.xml). Never applied
to the node executable that launch starts: there the user's environment decides. Where that
environment names no profile at all, the node takes config/fastdds_node.xml, Fast DDS's defaults
but for a 50 ms heartbeat of its writers, so that its shutdown learns at once that its answers were
received (the XML says why)."""

from __future__ import annotations

import os
from pathlib import Path

from .params_file import config_dir


def large_data_profile() -> Path:
    return config_dir() / "fastdds_large_data.xml"


def node_profile() -> Path:
    return config_dir() / "fastdds_node.xml"


def use_node_profile_if_none() -> str:
    """Point Fast DDS at config/fastdds_node.xml when the environment names no profile (neither
    FASTDDS_DEFAULT_PROFILES_FILE nor ./DEFAULT_FASTDDS_PROFILES.xml, which Fast DDS reads on its
    own) and the middleware is Fast DDS. Must run before rclpy.init. Returns the profile in effect
    ("" for Fast DDS's defaults under another middleware)."""
    chosen = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE", "")
    if chosen:
        return chosen
    if Path("DEFAULT_FASTDDS_PROFILES.xml").is_file():
        return str(Path("DEFAULT_FASTDDS_PROFILES.xml").resolve())
    if os.environ.get("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp") not in ("rmw_fastrtps_cpp", "rmw_fastrtps_dynamic_cpp"):
        return ""
    if node_profile().is_file():
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(node_profile())
        return str(node_profile())
    return ""


def use_large_data_profile() -> None:
    """Point Fast DDS at config/fastdds_large_data.xml unless the user chose a profile already
    (the development tools: `litevlm drive`, `litevlm bag replay|record`; never the node
    executable that launch starts). Must run before rclpy.init."""
    if not os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"):
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(large_data_profile())
    use_profile_memory_policy()


def use_profile_memory_policy() -> None:
    """With the shipped profile in effect, let rmw_fastrtps take its reader memory policy from it
    (RMW_FASTRTPS_USE_QOS_FROM_XML; the XML says why), unless the user set that variable."""
    chosen = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE", "")
    if chosen and Path(chosen).resolve() == large_data_profile().resolve():
        os.environ.setdefault("RMW_FASTRTPS_USE_QOS_FROM_XML", "1")
