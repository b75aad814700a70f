"""A real Ray cluster for a test, started as a user starts one (`ray start --head`), on free ports,
with its files in a folder of the test's own (RAY_TMPDIR), and stopped by killing exactly its
processes: `ray stop` would stop every Ray process of the user on the machine, someone else's too.

Authentication as the installed Ray sets it up (Ray 2.60): the user has a token in
~/.ray/auth_token (`ray get-auth-token --generate` makes one; so does the first plain ray.init()),
and `ray start --head` then turns token authentication on by itself. The test's HOME is a folder
of its own, so that the user's real ~/.ray is neither read nor replaced; the test process uses the
same HOME while the cluster runs (the user who started it drives it).

Also a script: `cd tests && python -m helpers.ray start|stop DIR [CPUS]` for benchmarks run by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


@dataclass
class Head:
    address: str         # HOST:PORT, as `ray start --head` printed it (`ray start --address='...'`)
    dashboard: str       # http://127.0.0.1:PORT (the Ray Jobs API), "" without a dashboard
    client: str          # ray://127.0.0.1:PORT (the Ray Client server)
    output: str          # what `ray start` printed


def start_head(temp_dir: Path, cpus: int = 2, tries: int = 3, dashboard: bool = False,
               env: dict | None = None) -> Head:
    """`ray start --head` with every port it listens on chosen free. A port taken by someone else
    between choosing and binding fails the start: it is retried."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or os.environ, RAY_TMPDIR=str(temp_dir))
    for attempt in range(tries):
        port, *ports = free_ports(9)
        # worker processes: a range below Linux's ephemeral ports (32768+), where the ones above come from
        workers_from = 10000 + (port * 7919 + attempt * 211) % 20000
        cmd = [str(RAY), "start", "--head", "--num-cpus", str(cpus), "--port", str(port), "--include-dashboard",
               "true" if dashboard else "false", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
               "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
               "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
               "--metrics-export-port", str(ports[4]), "--runtime-env-agent-port", str(ports[5]),
               "--ray-client-server-port", str(ports[6]),
               "--min-worker-port", str(workers_from), "--max-worker-port", str(workers_from + 200)]
        if dashboard:
            cmd += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports[7])]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            text = out.stdout + out.stderr
            printed = re.search(r"ray start --address='([^']+)'", ANSI.sub("", text))
            return Head(printed.group(1) if printed else f"127.0.0.1:{port}",
                        f"http://127.0.0.1:{ports[7]}" if dashboard else "", f"ray://127.0.0.1:{ports[6]}", text)
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


# Ray's longest unix socket path under RAY_TMPDIR (the dashboard's modules), and the limit of one
SOCKET_ROOM = 107 - len("/ray/session_2026-12-03_16-45-48_680747_1234567/sockets/dash_MetricsHead")


def short_folder(parent: Path | None) -> Path:
    """A fresh folder for RAY_TMPDIR under `parent` (the test's tmp) when Ray's unix socket paths
    fit there (107 bytes at most), else under the system's temp folder (pytest's own temp folders
    are usually too deep: a socket path over the limit fails the dashboard's modules, not the start)."""
    if parent is not None and len(str(parent)) + len("/rXXXXXXXX") <= SOCKET_ROOM:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="r", dir=parent))
    return Path(tempfile.mkdtemp(prefix="lvray-"))


def make_token(home: Path) -> None:
    """A token in HOME/.ray/auth_token, made as a user makes one: `ray get-auth-token --generate`."""
    env = dict(os.environ, HOME=str(home))
    env.pop("RAY_AUTH_MODE", None)
    out = subprocess.run([str(RAY), "get-auth-token", "--generate"], env=env, capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0 or not (home / ".ray" / "auth_token").is_file():
        raise RuntimeError(f"ray get-auth-token --generate failed: {out.stderr[-2000:]}")


@dataclass
class LocalCluster:
    head: Head
    temp_dir: Path
    home: Path           # the HOME the cluster was started with (its ~/.ray/auth_token)

    @property
    def address(self) -> str:
        return self.head.address


@contextmanager
def ray_cluster(cpus: int = 2, auth: bool = True, dashboard: bool = False, env: dict | None = None,
                parent: Path | None = None):
    """A cluster in a folder of its own (under `parent`, the test's tmp, when Ray's socket paths fit
    there), removed afterwards. auth: token authentication as the installed Ray sets it up (module
    docstring): HOME is a folder of the cluster's own, for the cluster and for this process while it
    runs. env: more environment for the cluster's processes (storage credentials, PATH)."""
    import ray

    temp_dir = short_folder(parent)
    home = temp_dir / "home"
    home.mkdir()
    cluster_env = dict(os.environ, **(env or {}), HOME=str(home))
    if auth:
        make_token(home)
        cluster_env.pop("RAY_AUTH_MODE", None)        # Ray's default: on, because a token exists
    else:
        cluster_env["RAY_AUTH_MODE"] = "disabled"
    try:
        with environment({"HOME": str(home), "RAY_AUTH_MODE": None if auth else "disabled"}):
            head = start_head(temp_dir, cpus, dashboard=dashboard, env=cluster_env)
            try:
                yield LocalCluster(head, temp_dir, home)
            finally:
                if ray.is_initialized():
                    ray.shutdown()
                stop_cluster(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def environment(values: dict[str, str | None]):
    """os.environ with `values` set (None: removed), restored afterwards."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _put_environment(values)
        yield
    finally:
        _put_environment(old)


def _put_environment(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


if __name__ == "__main__":
    what, folder = sys.argv[1], Path(sys.argv[2]).absolute()
    if what == "start":
        print(start_head(folder, int(sys.argv[3]) if len(sys.argv) > 3 else 2).address)
    else:
        stop_cluster(folder)
        print(f"stopped; left: {cluster_pids(folder)}")
