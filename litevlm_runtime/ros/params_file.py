"""The node's parameters read from its YAML params file without a running node (`litevlm drive`,
`bag eval`, `bag replay` and the soak harness read the same file the node does)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .node import NODE_NAME, PARAMETERS, config_dir
from .parameters import flatten, node_section, pipeline_settings
from .topics import shipped_topic_names


def load_node_params(params_file: Path | None, overrides: dict | None = None) -> dict:
    """ros__parameters of the node from its YAML (the same file `litevlm drive` reads)."""
    import yaml


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


