"""Set-up and ROS packaging: set-up is idempotent, the interface package is built into the venv,
and the repository is laid out as colcon expects (root = ament_python `litevlm`)."""

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_setup_is_idempotent_and_fast_when_up_to_date():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    again = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert "python dependencies up to date" in again.stdout and "litevlm_msgs up to date" in again.stdout


def test_interface_package_is_importable_with_all_fields():
    from litevlm_msgs.msg import Answer, Query

    a = Answer()
    for name in ("query_id", "question", "answer", "token_ids", "status", "status_message", "cameras", "stage_names",
                 "stage_ms", "total_ms", "queue_ms", "visual_tokens", "kept_tokens", "input_tokens",
                 "decode_steps", "accepted_length", "frame_cameras", "frame_stamps"):
        assert hasattr(a, name), name
    q = Query()
    assert hasattr(q, "header") and hasattr(q, "deadline") and hasattr(q, "id") and hasattr(q, "text")


def test_colcon_layout():
    root_pkg = ET.parse(ROOT / "package.xml").getroot()
    assert root_pkg.get("format") == "3" and root_pkg.findtext("name") == "litevlm"
    assert root_pkg.find("export/build_type").text == "ament_python"
    deps = {d.text for d in root_pkg.findall("depend")}
    assert {"rclpy", "sensor_msgs", "std_msgs", "diagnostic_msgs", "litevlm_msgs"} <= deps
    msgs = ET.parse(ROOT / "ros2_ws/src/litevlm_msgs/package.xml").getroot()
    assert msgs.find("export/build_type").text == "ament_cmake"
    assert msgs.findtext("member_of_group") == "rosidl_interface_packages"
    # ros2_ws/src/litevlm is the repository root; colcon stops descending at a package.xml, so
    # the symlink cannot make it find ros2_ws again.
    link = ROOT / "ros2_ws" / "src" / "litevlm"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link)) and link.resolve() == ROOT
    assert (ROOT / "setup.cfg").read_text().count("$base/lib/litevlm") == 2     # where launch_ros looks
    compile((ROOT / "launch" / "drive.launch.py").read_text(), "drive.launch.py", "exec")


def test_drive_yaml_declares_only_known_parameters():
    import yaml

    from litevlm_runtime.options import settings
    from litevlm_runtime.ros.parameters import PARAMETERS, flatten, node_section

    doc = yaml.safe_load((ROOT / "config" / "drive.yaml").read_text())
    assert list(doc) == ["/**/litevlm_drive"]            # any namespace (a bare node name: the root one only)
    params = flatten(node_section(doc, "litevlm_drive"))
    declared = dict(PARAMETERS) | {s.key: s.default for s in settings()}
    assert set(params) == set(declared)
    for k, v in params.items():
        assert type(v) is type(declared[k]) or (isinstance(v, float) and isinstance(declared[k], float)), k


def test_node_parameters_are_the_pipeline_settings():
    """Every pipeline setting is a node parameter of the same dotted name, with a descriptor."""
    from litevlm_runtime.options import settings
    from litevlm_runtime.ros.parameters import CONFIGURE_NOTE, all_settings, descriptor, pipeline_options_from

    declared = all_settings()
    for s in settings():
        d = descriptor(declared[s.key])
        assert d.name == s.key and d.description.endswith(CONFIGURE_NOTE) and not d.read_only   # built at configure
    opts = pipeline_options_from({"dtype": "float16", "decoding.mode": "eagle", "decoding.eagle.topk": 7,
                                  "backend.threads": 0, "queue_size": 4})
    assert opts.dtype == "float16" and opts.decoding.mode.value == "eagle" and opts.decoding.eagle.topk == 7
