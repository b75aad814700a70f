"""`ros2 launch litevlm drive.launch.py [params_file:=FILE] [fastdds_profile:=FILE]`

Starts the litevlm_drive lifecycle node with config/drive.yaml and the Fast DDS large-data
profile (shared memory for the images), then drives it through configure and activate, as
`litevlm drive` does where `ros2 launch` is not installed.
"""

import os

import launch
import launch.actions
import launch.events
import launch_ros.actions
import launch_ros.event_handlers
import launch_ros.events.lifecycle
import lifecycle_msgs.msg
from ament_index_python.packages import get_package_share_directory
from launch.substitutions import LaunchConfiguration


def generate_launch_description():
    share = get_package_share_directory("litevlm")
    params = LaunchConfiguration("params_file")
    profile = LaunchConfiguration("fastdds_profile")

    node = launch_ros.actions.LifecycleNode(
        package="litevlm",
        executable="litevlm_drive_node",
        name="litevlm_drive",
        namespace="",
        output="screen",
        parameters=[params],
    )
    configure = launch.actions.EmitEvent(event=launch_ros.events.lifecycle.ChangeState(
        lifecycle_node_matcher=launch.events.matches_action(node),
        transition_id=lifecycle_msgs.msg.Transition.TRANSITION_CONFIGURE,
    ))
    activate_when_configured = launch.actions.RegisterEventHandler(launch_ros.event_handlers.OnStateTransition(
        target_lifecycle_node=node, goal_state="inactive",
        entities=[launch.actions.EmitEvent(event=launch_ros.events.lifecycle.ChangeState(
            lifecycle_node_matcher=launch.events.matches_action(node),
            transition_id=lifecycle_msgs.msg.Transition.TRANSITION_ACTIVATE,
        ))],
    ))
    return launch.LaunchDescription([
        launch.actions.DeclareLaunchArgument(
            "params_file", default_value=os.path.join(share, "config", "drive.yaml")),
        launch.actions.DeclareLaunchArgument(
            "fastdds_profile", default_value=os.path.join(share, "config", "fastdds_large_data.xml")),
        launch.actions.SetEnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE", profile),
        activate_when_configured,
        node,
        configure,
    ])
