#!/usr/bin/env bash
# Build the real `ros2` CLI (ros2cli, ros2launch, ros2lifecycle, ros2param, ros2topic, ros2node,
# ros2service), launch and launch_ros from their sources, plus this package, with colcon, in a
# workspace OUTSIDE the checkout, against the ROS 2 wheels of the runtime venv (none of them is a
# wheel; ../shared/ENVIRONMENT.md). About 2 minutes. Then:
#
#     source WS/env.sh          # what /opt/ros/<distro>/setup.bash is on a ROS install
#     ros2 launch litevlm drive.launch.py ...
#     LITEVLM_ROS2_SETUP=WS/env.sh python -m pytest tests/ros/test_ros_launch_real.py
#
# usage: bash scripts/ros2_cli.sh WS     (WS/src/<repo> already cloned is used as it is; else cloned
#                                         from github.com at the commits below)
# colcon lives in WS/colcon (pip --target) and runs on the venv's python, so that the scripts it
# installs (`ros2`, litevlm_drive_node) start the venv's python; a colcon venv of its own would put
# its own python in their shebangs, and in the runtime venv it would downgrade setuptools.
set -euo pipefail
WS=$(mkdir -p "${1:?usage: ros2_cli.sh WS}" && cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${LITEVLM_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
case "$WS/" in "$ROOT"/*) echo "WS must be outside the checkout ($ROOT)" >&2; exit 2;; esac

# The commits this was checked with (rolling, December 2026).
REPOS=(
    "ros2cli e20d2c664fc2981b0b80ebed534e5becc6fdbf34"             # 0.36.1
    "launch 02595bafc7891d4d287667b6aa9161edf738e9f3"              # 3.7.1
    "launch_ros f9ab9371824d470bca47602bc7d277eb2217c90d"          # 0.28.0+1
    "rosidl_runtime_py 3327b1dc488af514017c5446ffff12d102bbe94a"   # 0.14.0
    "rcl_interfaces f6b3741d921ef5414125091b2ccc74b863be3c24"      # 2.2.0: composition_interfaces, for launch_ros
)
mkdir -p "$WS/src"
for entry in "${REPOS[@]}"; do
    read -r name commit <<< "$entry"
    if [ ! -d "$WS/src/$name" ]; then
        git clone -q "https://github.com/ros2/$name" "$WS/src/$name"
        git -C "$WS/src/$name" checkout -q "$commit"
    fi
done
ln -sfn "$ROOT" "$WS/src/litevlm"     # this checkout: the ament_python package at its root

# colcon for the build; psutil, osrf_pycommon and argcomplete for the CLI at run time.
[ -d "$WS/colcon/colcon_core" ] || "$PY" -m pip install -q --target "$WS/colcon" colcon-common-extensions
[ -d "$WS/deps/psutil" ] || "$PY" -m pip install -q --target "$WS/deps" psutil osrf-pycommon argcomplete

cd "$WS"
PACKAGES=(composition_interfaces rosidl_runtime_py launch launch_xml launch_yaml launch_ros ros2cli ros2pkg
          ros2run ros2node ros2service ros2topic ros2param ros2lifecycle ros2launch)
# The tests of these repositories are not built: their test-only packages are left out of the set.
IGNORE=(launch_testing launch_testing_ros launch_testing_ament_cmake launch_pytest test_launch_ros
        test_launch_testing ros2cli_test_interfaces ros2lifecycle_test_fixtures)
BASES=(src/rcl_interfaces/composition_interfaces src/ros2cli src/launch src/launch_ros src/rosidl_runtime_py)
export PATH="$VENV/bin:$PATH" AMENT_PREFIX_PATH="$VENV" CMAKE_PREFIX_PATH="$VENV" PYTHONPATH="$WS/colcon"
"$PY" colcon/bin/colcon build --base-paths "${BASES[@]}" --packages-select "${PACKAGES[@]}" \
    --packages-ignore "${IGNORE[@]}" \
    --cmake-args -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" -DBUILD_TESTING=OFF
# litevlm with --symlink-install: the installed package runs this checkout's code, as edited.
"$PY" colcon/bin/colcon build --symlink-install --base-paths src/litevlm --packages-select litevlm
unset PYTHONPATH

cat > "$WS/env.sh" <<EOF
# The ROS 2 environment of this build: the colcon install (ros2 CLI, launch, launch_ros, litevlm),
# the pure-Python deps beside it, and the runtime venv's tools.
source "$WS/install/setup.bash"
export PYTHONPATH="$WS/deps\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$VENV/bin:\$PATH"
EOF
echo "built: source $WS/env.sh; ros2 launch litevlm drive.launch.py --show-args"
