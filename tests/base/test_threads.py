"""The thread defaults (threads.py): the wait policy reaches torch's OpenMP runtime, as that
runtime itself reports it (libgomp's OMP_DISPLAY_ENV), and the core count honours a CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from litevlm_runtime.threads import WAIT_POLICY_OPT_OUT, apply_wait_policy, available_cores, cgroup_cpu_limit

ROOT = Path(__file__).resolve().parents[2]


def openmp_report(code: str, **env) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with the OpenMP runtime printing its settings as it loads."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", WAIT_POLICY_OPT_OUT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          env={**base, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "VERBOSE", **env})


def spin_count(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    if not lines:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in its report)")
    return lines[0].split("=", 1)[1].strip().strip("'")


def test_importing_the_package_first_makes_torchs_openmp_threads_sleep_when_idle():
    assert spin_count(openmp_report("import litevlm_runtime, torch").stderr) == "0"          # PASSIVE
    # the OpenMP runtime's own default (what torch alone gets): spin 300k iterations before sleeping
    assert spin_count(openmp_report("import litevlm_runtime, torch", **{WAIT_POLICY_OPT_OUT: "1"}).stderr) == "300000"
    # a policy the user chose is kept
    assert int(spin_count(openmp_report("import litevlm_runtime, torch", OMP_WAIT_POLICY="ACTIVE").stderr)) > 300000


def test_torch_imported_first_keeps_spinning_and_says_so():
    run = openmp_report(
        "import torch, litevlm_runtime\nfrom litevlm_runtime.pipeline.runtime import set_threads\nset_threads(2)"
    )
    assert spin_count(run.stderr) == "300000"
    assert "RuntimeWarning: torch was imported before litevlm_runtime" in run.stderr
    assert "OMP_WAIT_POLICY=PASSIVE" in run.stderr


def test_apply_wait_policy_sets_only_what_is_not_chosen():
    from litevlm_runtime import threads

    env: dict[str, str] = {}
    assert apply_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "active"}
    assert apply_wait_policy(env) == "active"
    env = {WAIT_POLICY_OPT_OUT: "1"}
    assert apply_wait_policy(env) is None and "OMP_WAIT_POLICY" not in env
    assert not threads.torch_loaded_first      # the tests import the package first (conftest.py)


def test_cpu_quota_caps_the_cores(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert cgroup_cpu_limit(tmp_path) is None and available_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")                       # cgroup v2, unlimited
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("50000 100000\n")                     # half a CPU: still one thread
    assert cgroup_cpu_limit(tmp_path) == 0.5 and available_cores(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()                                               # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5 and available_cores(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_threads_setting_zero_means_every_available_core():
    from litevlm_runtime.options import options_from_flat

    assert options_from_flat({}).threads() == available_cores()
    assert options_from_flat({"backend.threads": 1}).threads() == 1
