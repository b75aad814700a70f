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
import sys
import time
from pathlib import Path

import pytest
from helpers.ros import ROOT, Rig, RosClient, domain_id, ros_env, write_params

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


def start_launch(tmp_path: Path, installed: Path, params: Path, env: dict):
    """`ros2 launch litevlm drive.launch.py` with `params` and the installed Fast DDS profile, in a
    session of its own (a terminal's Ctrl-C is os.killpg): (process, its log file, the log's text)."""
    log_path = tmp_path / "launch.log"
    log = log_path.open("w")
    profile = installed / "share/litevlm/config/fastdds_large_data.xml"
    launch = subprocess.Popen(ros2_command(f"launch litevlm drive.launch.py params_file:={params} "
                                           f"fastdds_profile:={profile}"),
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return launch, log, lambda: log_path.read_text(errors="replace")


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
    launch, log, text = start_launch(tmp_path, installed, params, env)
    client = RosClient(domain)
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


def launch_ctrl_c(*args: str, timeout: float = 3600) -> str:
    """`litevlm bench --study launch_ctrl_c` with this test's domain; its output (0 when every run passed)."""
    r = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "bench", "--study", "launch_ctrl_c",
                        "--setup", SETUP, "--domain", str(domain_id(21)), *args],
                       capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return r.stdout


# The default launch arguments (the shipped parameters, the bundled model), a terminal's Ctrl-C with
# 12 questions queued: every question answered once, the node's summary, one drain, launch's
# "process has finished cleanly", exit 0. Without the profile it used to die of launch's forwarded
# SIGINT (exit -2) in 4 of 4 runs; 20 runs each when slow tests run, 2 in the suite.
@pytest.mark.parametrize("profile", [False, True], ids=["no_profile", "profile"])
def test_ctrl_c_with_queued_questions(profile):
    launch_ctrl_c("--count", "2", *(["--profile"] if profile else []))


@pytest.mark.slow
@pytest.mark.parametrize("profile", [False, True], ids=["no_profile", "profile"])
def test_ctrl_c_with_queued_questions_20_times(profile):
    launch_ctrl_c("--count", "20", *(["--profile"] if profile else []))


def test_ctrl_c_and_lifecycle_shutdown_during_configure():
    """1 s into configure of the bundled model: Ctrl-C, and `ros2 lifecycle set ... shutdown`; the
    node ends within 3 s of the request with a line saying configure was cancelled, exit 0, no
    SIGTERM from launch (the script checks each)."""
    launch_ctrl_c("--count", "2", "--during-configure", "1.0")
    launch_ctrl_c("--count", "2", "--shutdown-during-configure", "1.0")


@pytest.mark.slow
def test_ctrl_c_during_configure_of_a_2b_checkpoint(tmp_path):
    """The same with a 2B-preset checkpoint (random weights, 8.8 GB of float32 shards): its configure
    would take minutes, far past launch's 5 s SIGTERM timeout."""
    model = tmp_path / "internvl2_5-2b"
    subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "make-checkpoint", "--preset", "internvl2_5-2b",
                    "--shard-mb", "1024", str(model)], check=True, timeout=3600)
    launch_ctrl_c("--count", "2", "--during-configure", "1.0", "--model", str(model))
    launch_ctrl_c("--count", "2", "--shutdown-during-configure", "1.0", "--model", str(model))


def test_a_bag_of_sequences_replayed_twice_into_ros2_launch_answers_as_bag_eval(tmp_path, tiny_model):
    """`ros2 launch litevlm drive.launch.py` as a terminal starts it, a bag of SynthDrive sequences
    (every question over 4 frame sets, `bag make --query-frames 4`) replayed into it twice in a row:
    each time every query answered once and as `bag eval` answers it (tokens, frame sets, kept
    tokens per set); then Ctrl-C ends it cleanly."""
    from helpers.ros import replayed_as_evaluated, sequence_bag

    from litevlm_runtime.bag.evaluate import evaluate
    from litevlm_runtime.ros.params_file import load_node_params

    bag = sequence_bag(tmp_path / "motion", frames=4)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=6,
                          queue_size=16, **{"decoding.mode": "greedy"})
    evaluated = [e.to_json() for e in evaluate(bag, load_node_params(params))]
    assert len(evaluated) == 6 and all(e["status"] == "ok" and e["frames"] == 4 for e in evaluated)
    installed = Path(subprocess.run(ros2_command("pkg prefix litevlm"), capture_output=True, text=True,
                                    timeout=120).stdout.strip())
    env = ros_env(domain_id(39))
    cli = Cli(env)
    launch, log, text = start_launch(tmp_path, installed, params, env)
    try:
        assert cli.wait_state("active") == "active [3]", text()[-3000:]
        for label in ("first", "second"):
            replayed_as_evaluated(tmp_path, env, bag, params, evaluated, label, text)
        os.killpg(launch.pid, signal.SIGINT)
        assert launch.wait(60) == 0, text()[-3000:]
        assert "process has finished cleanly" in text() and "summary: 12 answered (0 errors)" in text(), text()[-3000:]
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        subprocess.run(ros2_command("daemon stop"), env=env, capture_output=True, timeout=60)
        log.close()
