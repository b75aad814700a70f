"""A real Ray cluster for a test, started as a user starts one (`ray start --head`), on free ports,
with its files in a folder of the test's own (RAY_TMPDIR), and stopped by killing exactly its
processes: `ray stop` would stop every Ray process of the user on the machine, someone else's too.

Also a script: `python tests/ray_helpers.py start|stop DIR [CPUS]` for benchmarks run by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all bound at once, so the kernel cannot hand out one twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_head(temp_dir: Path, cpus: int = 2, tries: int = 3) -> str:
    """`ray start --head` with every port it listens on chosen free; returns the address. A port
    taken by someone else between choosing and binding fails the start: it is retried."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RAY_TMPDIR=str(temp_dir))      # (RAY_AUTH_MODE: see ray_cluster)
    for attempt in range(tries):
        port, *ports = free_ports(7)
        # worker processes: a range below Linux's ephemeral ports (32768+), where the ones above come from
        workers_from = 10000 + (port * 7919 + attempt * 211) % 20000
        cmd = [str(RAY), "start", "--head", "--num-cpus", str(cpus), "--port", str(port), "--include-dashboard",
               "false", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
               "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
               "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
               "--metrics-export-port", str(ports[4]), "--runtime-env-agent-port", str(ports[5]),
               "--min-worker-port", str(workers_from), "--max-worker-port", str(workers_from + 200)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if out.returncode == 0:
            return f"127.0.0.1:{port}"
        stop_cluster(temp_dir)
    raise RuntimeError(f"ray start failed {tries} times; last:\n{out.stdout}\n{out.stderr}")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process we can read."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(p.name)] = (ppid, cmdline)
    return out


def cluster_pids(temp_dir: Path) -> list[int]:
    """The cluster's processes: those naming its temp folder, and all their descendants (the
    workers, whose command line Ray rewrites to ray::Class)."""
    procs = _processes()
    mine = {pid for pid, (_, cmd) in procs.items() if str(temp_dir) in cmd and pid != os.getpid()}
    grown = True
    while grown:
        kids = {pid for pid, (ppid, _) in procs.items() if ppid in mine and pid not in mine}
        mine |= kids
        grown = bool(kids)
    return sorted(mine)


def stop_cluster(temp_dir: Path, timeout: float = 15.0) -> None:
    pids = cluster_pids(temp_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        if not pids:
            return


@contextmanager
def ray_cluster(cpus: int = 2):
    """A cluster in a short temporary folder of its own (Ray's unix sockets live under it, and a
    socket path may not exceed 107 bytes: pytest's tmp_path is too deep), removed afterwards."""
    temp_dir = Path(tempfile.mkdtemp(prefix="lvray-"))
    # Ray 2.60 turns token authentication on by default, with one token per user in ~/.ray; a test
    # cluster on loopback does without, so that it neither reads nor replaces the user's token.
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        address = start_head(temp_dir, cpus)
        try:
            yield address
        finally:
            import ray

            if ray.is_initialized():
                ray.shutdown()
            stop_cluster(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth


if __name__ == "__main__":
    what, folder = sys.argv[1], Path(sys.argv[2]).absolute()
    if what == "start":
        print(start_head(folder, int(sys.argv[3]) if len(sys.argv) > 3 else 2))
    else:
        stop_cluster(folder)
        print(f"stopped; left: {cluster_pids(folder)}")
