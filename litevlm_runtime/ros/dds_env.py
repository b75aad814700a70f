"""The DDS environment of the development tools: the package's Fast DDS profile for one machine
(shared memory, UDP on 127.0.0.1 only, large frames: config/fastdds_large_data.xml). Never applied
to the node executable that launch starts: there the user's environment decides."""

from __future__ import annotations

import os
from pathlib import Path

from .params_file import config_dir


def large_data_profile() -> Path:
    return config_dir() / "fastdds_large_data.xml"


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
