"""The installed package is the tested package: the project built as a wheel and installed
non-editably into a scratch prefix (what colcon's ament_python install and `pip install .`
contain: only what find_packages and data_files take), then the installed `litevlm_drive_node`
started with that prefix first on the path (the runtime venv only for the dependencies), taken
through the lifecycle services, answering a question over DDS on the bundled model it carries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers.ros import Proc, Rig, RosClient, domain_id, ros_env

from litevlm_runtime.ros.topics import SHIPPED_REMAPS

ROOT = Path(__file__).resolve().parents[2]


def source_copy(dest: Path) -> Path:
    """The files git would commit (tracked, and untracked but not ignored), as a fresh clone has
    them: no build/, egg-info or venv of this checkout leaks into the wheel."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if name == ".venv" or not (src.is_file() or src.is_symlink()):
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name, follow_symlinks=False)
    return dest


def install(tmp: Path) -> Path:
    """pip wheel + pip install --prefix with the venv's own pip and setuptools (no index)."""
    src, dist, prefix = source_copy(tmp / "src"), tmp / "dist", tmp / "prefix"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True,
                   capture_output=True, timeout=120)
    wheel, = dist.glob("litevlm-*.whl")
    # --ignore-installed: without it pip removes the litevlm this venv has installed (the developer's
    # editable one) before installing into the prefix.
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--ignore-installed", "--prefix", str(prefix), str(wheel)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return prefix


def test_installed_node_answers_over_dds(tmp_path):
    prefix = install(tmp_path)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    share = prefix / "share" / "litevlm"

    # What data_files and package_data must have installed.
    for rel in ("package.xml", "launch/drive.launch.py", "config/drive.yaml", "config/fastdds_large_data.xml"):
        assert (share / rel).is_file(), rel
    assert (prefix / "share/ament_index/resource_index/packages/litevlm").is_file()
    bundled = ROOT / "litevlm_runtime" / "bundled"
    for f in bundled.rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            installed = site / "litevlm_runtime" / "bundled" / f.relative_to(bundled)
            assert installed.is_file() and installed.stat().st_size == f.stat().st_size, installed
    for pkg in (ROOT / "litevlm_runtime").rglob("__init__.py"):
        assert (site / pkg.relative_to(ROOT)).is_file(), pkg        # every package, ros/ included
    node_exe = prefix / "bin" / "litevlm_drive_node"
    assert node_exe.is_file()

    # Only the prefix on the path (and the venv for the dependencies), started away from the repo.
    domain = domain_id(7)
    env = ros_env(domain, PYTHONPATH=str(site), AMENT_PREFIX_PATH=f"{prefix}{os.pathsep}{sys.prefix}")
    where = subprocess.run([sys.executable, "-c", "import litevlm_runtime.ros.params_file as n; print(n.__file__); "
                            "print(n.config_dir())"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    module_file, config = where.stdout.split()
    assert Path(module_file).is_relative_to(site) and Path(config) == share / "config", where.stdout

    # As launch_ros starts it: the installed params file, the shipped remaps, no self-driving.
    remaps = [a for src, dst in SHIPPED_REMAPS for a in ("-r", f"{src}:={dst}")]
    cmd = [
        str(node_exe),
        "--ros-args",
        "-r",
        "__node:=litevlm_drive",
        "--params-file",
        str(share / "config/drive.yaml"),
        "-p",
        "warmup:=false",
        "-p",
        "max_new_tokens:=4",
        *remaps,
    ]
    node = Proc([], env, tmp_path / "node.log", cmd=cmd, cwd=tmp_path)
    client = RosClient(domain)
    try:
        rig = Rig(client)
        assert client.lifecycle_set("/litevlm_drive", "configure"), node.text()[-3000:]
        assert client.lifecycle_set("/litevlm_drive", "activate")
        assert client.spin_until(rig.connected, 30), node.text()[-3000:]
        client.spin_for(0.5)
        stamps = []
        for attempt in range(20):                      # best-effort cameras: resend until a set is there
            stamps.append(rig.frames(seed=attempt))
            client.spin_for(0.1)
            rig.ask(f"installed{attempt}", "What is in front of the ego car?")
            if client.spin_until(lambda: len(rig.answers) > attempt, 3) and rig.answers[-1].status != 1:  # no_frames
                break
        ans = rig.answers[-1]
        assert ans.status == 0, (ans.status_message, node.text()[-3000:])
        assert ans.answer and len(ans.token_ids) > 0 and ans.query_id.startswith("installed")
        matched = {s.sec * 10 ** 9 + s.nanosec for s in ans.frame_stamps}
        assert len(ans.frame_stamps) == 6 and len(matched) == 1 and matched <= set(stamps)
        assert f"loading {site / 'litevlm_runtime' / 'bundled'}" in node.text()   # the installed bundled model
    finally:
        client.close()
        node.stop()
