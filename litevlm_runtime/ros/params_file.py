"""The node's parameters read from its YAML params file without a running node (`litevlm drive`,
`bag eval`, `bag replay` and the soak harness read the same file the node does)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import InputError
from .parameters import NODE_NAME, PARAMETERS, flatten, node_section, pipeline_settings
from .topics import shipped_topic_names


def config_dir() -> Path:
    """config/ of the ROS package on the ament index; else of this source tree; else the
    share/litevlm/config that a wheel or `pip install .` put beside this install's lib/
    (<prefix>/lib/python3.X/site-packages/litevlm_runtime/ros/params_file.py), with no index set up."""
    try:
        # Imported here: a pip install (wheel, `pip install .`) has no ament index, and no ament_index_python.
        from ament_index_python.packages import get_package_share_directory
        d = Path(get_package_share_directory("litevlm")) / "config"
        if d.is_dir():
            return d
    except Exception:  # noqa: BLE001 - not on the ament index: look beside this file
        pass
    here = Path(__file__).resolve()
    source = here.parents[2] / "config"
    installed = here.parents[5] / "share" / "litevlm" / "config" if len(here.parents) > 5 else source
    return source if source.is_dir() or not installed.is_dir() else installed


def load_node_params(params_file: Path | None, overrides: dict | None = None) -> dict:
    """ros__parameters of the node from its YAML (the same file `litevlm drive` reads)."""
    params = dict(PARAMETERS) | {s.key: s.default for s in pipeline_settings()}
    path = Path(params_file) if params_file else config_dir() / "drive.yaml"
    doc = yaml.safe_load(path.read_text()) or {}
    given = flatten(node_section(doc, NODE_NAME))
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise InputError(f"{path}: unknown parameter(s) {', '.join(unknown)}")
    params.update(given)
    for k, v in (overrides or {}).items():
        if k not in params:
            raise InputError(f"unknown parameter {k!r}")
        params[k] = yaml.safe_load(v) if isinstance(v, str) else v
    # The names the node uses in the root namespace with the shipped remappings (ros/topics.py).
    return params | shipped_topic_names(params["camera_topics"])


