"""ROS 2 parameters of the node, from two typed configurations with one kind of metadata
(options.setting: help, lo/hi, choices, live):

  NodeSettings      the node's own (model folder, camera topics, diagnostics) and, inherited from
                    serving/settings.py's ServerSettings, frame matching and the request queue
  PipelineOptions   the pipeline's (options.py), under their dotted names (`tokens.keep_ratio`)

Each setting is a parameter of the same name with a descriptor (description, type, range,
choices), so `ros2 param describe` says what it is, and config/drive.yaml nests the same names.
A `live` setting may change while the node serves (`ros2 param set`; the node applies it at
once); every other one applies at configure (the pipeline is built, and the cameras subscribed,
at configure/activate): it may be set while the node is unconfigured and is validated at the
next configure, and is refused while inactive or active with AT_CONFIGURE (the ROS 2 way:
deactivate, cleanup, set, configure; no relaunch). Each descriptor's description says which.

Bad values never take the process down: a value the descriptor refuses at start (wrong type,
out of range) is kept out and named, and configure fails with it (validate_values).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.validate_full_topic_name import validate_full_topic_name

from ..errors import InputError
from ..options import Setting, options_from_flat, parse_value, setting, settings
from ..serving.settings import ServerSettings, check_window
from .topics import DEFAULT_CAMERA_TOPICS, expand

ROS_TYPES = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
             float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING,
             tuple: ParameterType.PARAMETER_STRING_ARRAY}


@dataclass(frozen=True)
class NodeSettings(ServerSettings):
    """The node's own settings plus, inherited, every setting of the query server it serves with."""
    model_dir: str = setting("", "InternVL2.5-layout model folder ('': the bundled SynthDrive model)")
    warmup: bool = setting(True, "run one synthetic query during configure (and measure the speculation costs)")
    require_manifest: bool = setting(
        False, "refuse a model folder without litevlm_manifest.json (`litevlm checksum DIR` writes one)"
    )
    camera_topics: tuple = setting(
        DEFAULT_CAMERA_TOPICS, "six camera topics in rig order (FRONT, FRONT_LEFT, FRONT_RIGHT, BACK, BACK_LEFT, "
        "BACK_RIGHT); relative names are under the node's namespace and remappable; a name ending in /compressed "
        "is sensor_msgs/CompressedImage, any other sensor_msgs/Image")
    diagnostics_period_s: float = setting(1.0, "period of /diagnostics (s)", lo=0.05, hi=3600.0)

    def __post_init__(self):
        super().__post_init__()

        if len(self.camera_topics) != 6:
            raise InputError(f"camera_topics: needs 6 topics in rig order, got {len(self.camera_topics)}")
        for topic in self.camera_topics:
            try:
                validate_full_topic_name(expand(str(topic)))
            except Exception as exc:  # noqa: BLE001 - rclpy's message says which character
                raise InputError(f"camera_topics: {topic!r} is not a valid topic name: "
                                 f"{str(exc).splitlines()[0]}") from None

    def server_settings(self, cameras) -> ServerSettings:
        return ServerSettings.from_values({f.name: getattr(self, f.name) for f in fields(ServerSettings)}, cameras)


def node_settings() -> list[Setting]:
    return settings(NodeSettings)


def pipeline_settings() -> list[Setting]:
    return settings()


def all_settings() -> dict[str, Setting]:
    """Every parameter. A pipeline setting marked live in options.py (serving.latency_budget_ms)
    applies at configure here: the built pipeline has no way yet to take a new value, and a
    `ros2 param set` that reports success and does nothing is what the node must not do."""
    return {s.key: s for s in (*node_settings(), *(replace(s, live=False) for s in pipeline_settings()))}


def ros_default(s: Setting):
    return list(s.default) if s.kind is tuple else s.default


# Why a pipeline setting is refused while the node is configured (inactive or active).
AT_CONFIGURE = "applies at configure: deactivate, cleanup, set, configure"
LIVE_NOTE = " [live: applied at once in any state]"
CONFIGURE_NOTE = " [applies at configure: settable while unconfigured (deactivate, cleanup, set, configure)]"


def descriptor(s: Setting, read_only: bool = False) -> ParameterDescriptor:
    """The parameter's descriptor. Never rclpy-read-only (that would refuse it in every state,
    unconfigured included); the description ends with when it applies (LIVE_NOTE/CONFIGURE_NOTE)."""
    d = ParameterDescriptor(name=s.key, type=ROS_TYPES[s.kind], read_only=read_only,
                            description=s.help + (LIVE_NOTE if s.live else CONFIGURE_NOTE))
    if s.kind is tuple and not s.default:
        # An empty list has no element type: rclpy declares it a byte array, and a string array set
        # later (ros2 param set, a params file) would be refused for its type without this.
        d.dynamic_typing = True
    if s.choices:
        d.additional_constraints = "one of: " + ", ".join(map(str, s.choices))
    if s.kind is float and (s.lo is not None or s.hi is not None):
        d.floating_point_range = [FloatingPointRange(from_value=float(s.lo if s.lo is not None else -1e308),
                                                     to_value=float(s.hi if s.hi is not None else 1e308), step=0.0)]
    if s.kind is int and (s.lo is not None or s.hi is not None):
        d.integer_range = [IntegerRange(from_value=int(s.lo if s.lo is not None else -(2 ** 62)),
                                        to_value=int(s.hi if s.hi is not None else 2 ** 62), step=0)]
    return d


def declare_parameters(node) -> dict[str, str]:
    """Declare every setting on `node`. A start value (params file, -p) that rclpy refuses
    against the descriptor would raise in the constructor; it is replaced by the default and
    returned (name -> why), so that configure can fail naming it while the process stays up. So
    is an override of a name the node does not declare: rclpy would drop it without a word (a
    misspelt key in a params file under ros2 launch would silently run the default)."""

    refused = {}
    for s in all_settings().values():
        try:
            node.declare_parameter(s.key, ros_default(s), descriptor(s))
        except (InvalidParameterTypeException, InvalidParameterValueException) as exc:
            hint = " (write a float, e.g. 1.0)" if s.kind is float and "INTEGER" in str(exc) else ""
            refused[s.key] = f"{s.key}: {exc}{hint}"
            node.declare_parameter(s.key, ros_default(s), descriptor(s), ignore_override=True)
    # _parameter_overrides is rclpy's own record of the start values (no public accessor).
    for name in sorted(set(getattr(node, "_parameter_overrides", {})) - set(node._parameters)):
        refused[name] = f"{name}: not a parameter of this node (misspelt? `ros2 param list` shows them)"
    return refused


def node_settings_from(values: dict) -> NodeSettings:
    """Node parameter values (by name) -> validated NodeSettings (InputError naming the key)."""
    kwargs = {}
    for f in fields(NodeSettings):
        if f.name in values:
            raw = values[f.name]
            if isinstance(f.default, tuple):          # string arrays (camera_topics, standing_questions)
                if not isinstance(raw, (list, tuple)) or not all(isinstance(t, str) for t in raw):
                    raise InputError(f"{f.name}: {raw!r} is not a list of strings")
                kwargs[f.name] = tuple(raw)
            else:
                kwargs[f.name] = parse_value(f.name, type(f.default), raw)
    return NodeSettings(**kwargs)


def pipeline_options_from(values: dict):
    """Node parameter values (by name) -> validated PipelineOptions (raises InputError naming the key)."""
    keys = {s.key for s in pipeline_settings()}
    return options_from_flat({k: v for k, v in values.items() if k in keys})


def validate_values(values: dict):
    """Everything configure checks before it loads anything: (NodeSettings, PipelineOptions), and
    that the two agree (the frame store's window holds what temporal.max_frames needs)."""
    settings, options = node_settings_from(values), pipeline_options_from(values)
    check_window(settings, options.temporal)
    return settings, options


def check_live_change(name: str, value, configured: bool = True) -> str | None:
    """Why `ros2 param set name value` is refused (None: accepted). rclpy has already checked
    the type and the range against the descriptor; this adds the lifecycle rule (a setting that
    is not live is refused while `configured`, i.e. inactive or active) and a live one's choices.
    While unconfigured, a setting that applies at configure is validated by that configure."""
    s = all_settings().get(name)
    if s is None:
        return None                      # not ours (use_sim_time ...): rclpy's own
    if not s.live:
        return f"{name}: {AT_CONFIGURE}" if configured else None
    try:
        node_settings_from({name: value})
    except InputError as exc:
        return str(exc)
    return None


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


def node_section(doc: dict, node_name: str) -> dict:
    """The ros__parameters that apply to node `node_name` in a params file, by the keys the
    shipped files use: `/**/NAME` (any namespace), `NAME` (root namespace only), `/**`."""
    for key in (f"/**/{node_name}", node_name, f"/{node_name}", "/**"):
        if key in (doc or {}):
            return (doc[key] or {}).get("ros__parameters", {}) or {}
    return {}


NODE_NAME = "litevlm_drive"
# The node's own parameters (name -> default, as ROS values); the pipeline's are options.py's.
PARAMETERS = {s.key: ros_default(s) for s in node_settings()}
