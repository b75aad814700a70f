"""ROS 2 parameters of the node, derived from the typed configuration (options.py): every
pipeline setting is a parameter of the same dotted name (`tokens.keep_ratio`), with a descriptor
(description, type, range, choices), so `ros2 param describe` says what it is and
config/drive.yaml nests the same names. Pipeline settings are read-only: the pipeline is built
at configure, so a change needs cleanup + configure (a relaunch with new overrides).
"""

from __future__ import annotations

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType

from ..options import Setting, options_from_flat, settings

ROS_TYPES = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
             float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}


def descriptor(s: Setting, read_only: bool = True) -> ParameterDescriptor:
    d = ParameterDescriptor(name=s.key, type=ROS_TYPES[s.kind], description=s.help, read_only=read_only)
    if s.choices:
        d.additional_constraints = "one of: " + ", ".join(map(str, s.choices))
    if s.kind is float and (s.lo is not None or s.hi is not None):
        d.floating_point_range = [FloatingPointRange(from_value=float(s.lo if s.lo is not None else -1e308),
                                                     to_value=float(s.hi if s.hi is not None else 1e308), step=0.0)]
    if s.kind is int and (s.lo is not None or s.hi is not None):
        d.integer_range = [IntegerRange(from_value=int(s.lo if s.lo is not None else -(2 ** 62)),
                                        to_value=int(s.hi if s.hi is not None else 2 ** 62), step=0)]
    return d


def pipeline_settings() -> list[Setting]:
    return settings()


def declare_pipeline_parameters(node) -> None:
    for s in pipeline_settings():
        node.declare_parameter(s.key, s.default, descriptor(s))


def pipeline_options_from(values: dict):
    """Node parameter values (by name) -> validated PipelineOptions (raises InputError naming the key)."""
    keys = {s.key for s in pipeline_settings()}
    return options_from_flat({k: v for k, v in values.items() if k in keys})


def flatten(tree: dict, prefix: str = "") -> dict:
    """A ros__parameters YAML mapping -> dotted parameter names, as ROS 2 reads nested keys."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
