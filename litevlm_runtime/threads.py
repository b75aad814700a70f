"""CPU threads on a shared CPU: how many, and how the idle ones wait.

A car's CPU is always shared, and torch's defaults assume an idle machine: an OpenMP team of one
thread per core whose threads spin between parallel regions (libgomp, the OpenMP runtime torch's
wheels bundle, spins about 300k iterations before it sleeps; MKL and oneDNN run on the same
runtime). Beside other busy processes a spinning thread looks like one more CPU hog to the
scheduler and gets time-sliced with them, and the team waits at each barrier for its slowest,
descheduled, member: on 2 cores beside 2 busy processes the bundled model's median answer went
from 0.5 s to 2.6 s. A thread that sleeps when idle (OMP_WAIT_POLICY=PASSIVE) leaves the cores to
the others, and the scheduler, which favours a thread waking from sleep over one that has been
running, gives it a core back as soon as the next region starts: the same test stays within
1.3-1.6x of its quiet latency, with every core in use (README, "Threads on a shared CPU", has
the table; `litevlm bench --contention` measures it on any machine).

So: OMP_WAIT_POLICY=PASSIVE (set at package import, before torch loads libgomp, which reads it
once) and one thread per core this process may use (its CPU affinity, capped by a cgroup CPU
quota, since a container limited to 2 CPUs on a 16-core host is a 2-core machine to its threads).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

WAIT_POLICY = "PASSIVE"
# Set to 1 to leave OMP_WAIT_POLICY unset (the OpenMP runtime's own default), e.g. to measure it.
WAIT_POLICY_OPT_OUT = "LITEVLM_OMP_DEFAULT_WAIT"

# Whether torch was imported before this package set the wait policy (then it cannot apply).
torch_loaded_first = False


def apply_wait_policy(environ=os.environ) -> str | None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment already chose one (or opts out); the policy
    this process's OpenMP runtime will read, None where that is its own default."""
    global torch_loaded_first
    if "OMP_WAIT_POLICY" not in environ and not environ.get(WAIT_POLICY_OPT_OUT):
        environ["OMP_WAIT_POLICY"] = WAIT_POLICY
        torch_loaded_first = "torch" in sys.modules
    return environ.get("OMP_WAIT_POLICY")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs a cgroup quota allows this process (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), None
    when unlimited or unreadable. Written here because neither os nor torch reads the quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def default_threads() -> int:
    """backend.threads = 0: one thread per available core (passive waiting makes the full team
    safe on a shared CPU; `litevlm bench --contention` compares it with fewer)."""
    return available_cores()
