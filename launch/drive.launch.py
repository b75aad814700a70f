"""`ros2 launch litevlm drive.launch.py [namespace:=NS] [params_file:=FILE] [model_dir:=DIR]
[log_level:=LEVEL] [fastdds_profile:=FILE] [auto_activate:=true|false]`
(`ros2 launch litevlm drive.launch.py --show-args`)

Starts the litevlm_drive lifecycle node and requests configure; when that first configure
succeeds (configuring -> inactive) it requests activate, once: the handler handles one event only
(handle_once) and activates only on success, so a manual `ros2 lifecycle set /litevlm_drive
configure` later (after deactivate and cleanup, or after fixing a parameter that failed the
launch's configure) leaves the node inactive, and the user's own `activate` works.
`auto_activate:=false` leaves the node inactive after the launch's configure too.

Topic names inside the node are relative; the remappings below give the shipped names in the
root namespace (/litevlm/query, /litevlm/answer ...; the cameras' /cam_front/image_raw/compressed
... need none), and under `namespace:=car1` (or a PushRosNamespace around an include of this
file) every topic moves under /car1 with the node. The same remappings are
litevlm_runtime/ros/topics.py's SHIPPED_REMAPS, which `litevlm drive` applies (a test keeps the two
equal).

DDS: nothing is set by default, so the user's environment (FASTDDS_DEFAULT_PROFILES_FILE,
ROS_DOMAIN_ID, RMW_IMPLEMENTATION ...) decides, and cameras on another computer are discovered.
fastdds_profile:=FILE sets FASTDDS_DEFAULT_PROFILES_FILE for the node; the package's own
$(ros2 pkg prefix litevlm)/share/litevlm/config/fastdds_large_data.xml (shared memory, UDP on
127.0.0.1 only) suits a single machine.
"""

import os

import launch
import launch.actions
import launch.conditions
import launch.events
import launch.substitutions
import launch_ros.actions
import launch_ros.event_handlers
import launch_ros.events.lifecycle
import lifecycle_msgs.msg
from ament_index_python.packages import get_package_share_directory

REMAPPINGS = [
    ("query", "litevlm/query"),
    ("question", "litevlm/question"),
    ("answer", "litevlm/answer"),
    ("answer_json", "litevlm/answer_json"),
    ("answer_partial", "litevlm/answer_partial"),
]


def change_state(node, transition_id):
    return launch.actions.EmitEvent(event=launch_ros.events.lifecycle.ChangeState(
        lifecycle_node_matcher=launch.events.matches_action(node), transition_id=transition_id))


def activate_if_configured(context, node):
    """The one event the handler takes: the outcome of the launch's own configure. Activate on
    success (goal inactive); on failure (goal unconfigured) nothing, now or later."""
    if context.locals.event.goal_state == "inactive":
        return [change_state(node, lifecycle_msgs.msg.Transition.TRANSITION_ACTIVATE)]
    return []


def node_and_transitions(context):
    """The node and its two transition requests. In an OpaqueFunction because model_dir
    overrides the params file only when it is given (a parameters dict always would)."""
    parameters = [launch.substitutions.LaunchConfiguration("params_file")]
    model_dir = launch.substitutions.LaunchConfiguration("model_dir").perform(context)
    if model_dir:
        parameters.append({"model_dir": model_dir})
    node = launch_ros.actions.LifecycleNode(
        package="litevlm",
        executable="litevlm_drive_node",
        name="litevlm_drive",
        namespace=launch.substitutions.LaunchConfiguration("namespace"),
        output="screen",
        parameters=parameters,
        remappings=REMAPPINGS,
        ros_arguments=["--log-level", launch.substitutions.LaunchConfiguration("log_level")],
    )
    activate_once_configured = launch.actions.RegisterEventHandler(launch_ros.event_handlers.OnStateTransition(
        target_lifecycle_node=node, start_state="configuring", handle_once=True,
        entities=[launch.actions.OpaqueFunction(function=lambda ctx: activate_if_configured(ctx, node))],
    ), condition=launch.conditions.IfCondition(launch.substitutions.LaunchConfiguration("auto_activate")))
    return [activate_once_configured, node, change_state(node, lifecycle_msgs.msg.Transition.TRANSITION_CONFIGURE)]


def generate_launch_description():
    share = get_package_share_directory("litevlm")
    profile = launch.substitutions.LaunchConfiguration("fastdds_profile")
    return launch.LaunchDescription([
        launch.actions.DeclareLaunchArgument(
            "namespace", default_value="",
            description="ROS namespace of the node; every topic but /diagnostics moves with it (e.g. car1)"),
        launch.actions.DeclareLaunchArgument(
            "params_file", default_value=os.path.join(share, "config", "drive.yaml"),
            description="node parameters YAML (keys under /**/litevlm_drive apply in any namespace)"),
        launch.actions.DeclareLaunchArgument(
            "model_dir", default_value="",
            description="InternVL2.5-layout model folder; overrides the params file's model_dir when given "
                        "(there, '' is the bundled SynthDrive model)"),
        launch.actions.DeclareLaunchArgument(
            "log_level", default_value="info", choices=["debug", "info", "warn", "error", "fatal"],
            description="log level of the node"),
        launch.actions.DeclareLaunchArgument(
            "fastdds_profile", default_value="",
            description="Fast DDS XML profile for the node (sets FASTDDS_DEFAULT_PROFILES_FILE); '' leaves the "
                        "environment's. Single machine: " + os.path.join(share, "config", "fastdds_large_data.xml")),
        launch.actions.DeclareLaunchArgument(
            "auto_activate", default_value="true", choices=["true", "false"],
            description="activate the node once the launch's own configure succeeds (false: leave it inactive; "
                        "a manual configure never activates)"),
        launch.actions.SetEnvironmentVariable(
            "FASTDDS_DEFAULT_PROFILES_FILE", profile,
            condition=launch.conditions.IfCondition(launch.substitutions.NotEqualsSubstitution(profile, ""))),
        launch.actions.OpaqueFunction(function=node_and_transitions),
    ])
