"""CPU threads on a shared CPU: how many, and how the idle ones wait.

A car's CPU is always shared, and torch's defaults assume an idle machine: an OpenMP team of one
thread per core whose threads spin between parallel regions (libgomp, the OpenMP runtime torch's
wheels bundle, spins about 300k iterations before it sleeps; MKL and oneDNN run on the same
runtime). Beside other busy processes a spinning thread looks like one more CPU hog to the
scheduler and gets time-sliced with them, and the team waits at each barrier for its slowest,
descheduled, member: on 2 shared cores, beside 2 more busy processes, the bundled model's median
answer went from 0.46-0.75 s to 1.1-3.1 s. A thread that sleeps when idle (OMP_WAIT_POLICY=PASSIVE)
leaves the cores to the others, and the scheduler gives a thread waking from sleep a core quickly:
with both cores in use, the same test's median stayed within 0.6-1.7x of quiet and its p99 within
1.5x in 5 of 6 runs (docs/threads.md has the tables and the price on an idle machine;
`litevlm bench --contention` measures it on any machine).

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


def apply_wait_policy(environ: dict | None = None) -> str | None:
    """OMP_WAIT_POLICY=PASSIVE in `environ` (default: this process's) unless it already chose one
    (or opts out); the policy an OpenMP runtime started there reads, None where that is its own."""
    global torch_loaded_first
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and not env.get(WAIT_POLICY_OPT_OUT):
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
        if environ is None:
            torch_loaded_first = "torch" in sys.modules
    return env.get("OMP_WAIT_POLICY")


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
