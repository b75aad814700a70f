"""The node under the real `ros2` CLI, as a user types it: `ros2 launch litevlm drive.launch.py`
from the colcon-installed package, `ros2 lifecycle get|set`, `ros2 param set|get`, over real DDS,
and Ctrl-C as a terminal sends it (SIGINT to the whole process group: ros2 launch and the node).

ros2cli, launch and launch_ros are not wheels: build them (and this package) with colcon outside
the checkout (docs/ros.md, "The real ros2 CLI": the recipe) and point LITEVLM_ROS2_SETUP at a
shell script that puts that build on the path (its install/setup.bash plus the pure-Python deps,
as /opt/ros/<distro>/setup.bash would). Skipped without it. The litevlm package must be
installed with --symlink-install from this checkout, so that the code under test is this tree's."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from ros_helpers import ROOT, Rig, RosClient, domain_id, ros_env, write_params

SETUP = os.environ.get("LITEVLM_ROS2_SETUP", "")
NAME = "/litevlm_drive"


def ros2_command(args: str) -> list[str]:
    """`ros2 ARGS` in a bash that sourced the ROS environment (exec: the process is ros2 itself)."""
    return ["bash", "-c", f'source "{SETUP}" && exec ros2 {args}']


def have_ros2() -> bool:
    if not SETUP:
        return False
    r = subprocess.run(ros2_command("pkg prefix litevlm"), capture_output=True, text=True, timeout=120)
    return r.returncode == 0


pytestmark = pytest.mark.skipif(not have_ros2(), reason="the ros2 CLI and the litevlm package not built "
                                                        "(LITEVLM_ROS2_SETUP; docs/ros.md)")


class Cli:
    """Runs `ros2 ...` with the test's environment (its domain, the large-data profile)."""

    def __init__(self, env: dict):
        self.env = env

    def __call__(self, args: str, timeout: float = 120) -> str:
        r = subprocess.run(ros2_command(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()

    def state(self) -> str:
        try:
            return self(f"lifecycle get {NAME}", timeout=60)
        except subprocess.TimeoutExpired:       # the node's executor is busy (configuring)
            return "(no answer in 60 s)"

    def wait_state(self, want: str, timeout: float = 240) -> str:
        end, got = time.monotonic() + timeout, ""
        while time.monotonic() < end:
            got = self.state()
            if got.startswith(want):
                return got
            time.sleep(1.0)
        return got


def test_ros2_launch_lifecycle_param_and_ctrl_c(tmp_path, tiny_model):
    installed = Path(subprocess.run(ros2_command("pkg prefix litevlm"), capture_output=True, text=True,
                                    timeout=120).stdout.strip())
    launch_file = installed / "share/litevlm/launch/drive.launch.py"
    assert launch_file.resolve() == (ROOT / "launch/drive.launch.py").resolve(), (
        f"{launch_file} is not this checkout's: rebuild litevlm with colcon --symlink-install (docs/ros.md)")
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=16,
                          queue_size=16, **{"tokens.mode": "layer0", "tokens.keep_ratio": 0.8})
    domain = domain_id(31)
    env = ros_env(domain)
    cli = Cli(env)
    log_path = tmp_path / "launch.log"
    log = log_path.open("w")
    profile = installed / "share/litevlm/config/fastdds_large_data.xml"
    launch = subprocess.Popen(ros2_command(f"launch litevlm drive.launch.py params_file:={params} "
                                           f"fastdds_profile:={profile}"),
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = RosClient(domain)
    text = lambda: log_path.read_text(errors="replace")  # noqa: E731
    try:
        assert cli.wait_state("active") == "active [3]", text()[-3000:]      # the launch's configure + activate
        # A pipeline setting is refused while active, with the node's reason as the CLI prints it.
        assert cli(f"param set {NAME} tokens.keep_ratio 0.5") == (
            "Setting parameter failed: tokens.keep_ratio: applies at configure: deactivate, cleanup, set, configure")
        assert cli(f"lifecycle set {NAME} deactivate") == "Transitioning successful"
        assert cli(f"lifecycle set {NAME} cleanup") == "Transitioning successful"
        assert cli(f"param set {NAME} tokens.keep_ratio 0.5") == "Set parameter successful"
        assert cli(f"lifecycle set {NAME} configure") == "Transitioning successful"
        time.sleep(3.0)
        assert cli.state() == "inactive [2]", text()[-3000:]                 # a manual configure: not activated
        assert cli(f"lifecycle set {NAME} activate") == "Transitioning successful"
        assert cli.state() == "active [3]"
        assert cli(f"param get {NAME} tokens.keep_ratio") == "Double value is: 0.5"

        rig = Rig(client)
        assert client.spin_until(rig.connected, 60)
        rig.frames(1)
        client.spin_for(0.3)
        rig.ask("r1", "What is in front of the car?")
        assert client.spin_until(lambda: rig.answers, 60)
        assert "tokens@0.5" in rig.answers[0].pipeline, (rig.answers[0].pipeline, rig.answers[0].status_message)

        # Ctrl-C during a burst: every query answered, one drain, launch reports a clean exit.
        ids = [f"L{i}" for i in range(12)]
        rig.frames(2)
        client.spin_for(0.3)
        for qid in ids:
            rig.ask(qid, f"What is in front of the car {qid}?")
        assert client.spin_until(lambda: len(rig.answers) > 1, 60)
        os.killpg(launch.pid, signal.SIGINT)
        assert launch.wait(60) == 0, text()[-3000:]
        client.spin_until(lambda: len(rig.answers) >= 1 + len(ids), 5)
        got = sorted(a.query_id for a in rig.answers[1:])
        assert got == sorted(ids), (got, text()[-3000:])
        out = text()
        assert "process has finished cleanly" in out and "process has died" not in out, out[-3000:]
        assert out.count("stopping: draining the request queue") == 1 and "summary: 13 answered" in out, out[-3000:]
        print(out[-1500:])
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        subprocess.run(ros2_command("daemon stop"), env=env, capture_output=True, timeout=60)
        client.close()
        log.close()
