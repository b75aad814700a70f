"""`litevlm fleet submit`: a fleet command run as a Ray job on the cluster (the Ray Jobs API),
the way teams run work on a shared cluster, instead of a driver on a laptop.

The job's entrypoint is the same command line a person would type (`litevlm fleet regress ...`),
checked against this version's parser before it is sent; the job's driver runs on the head node
with RAY_ADDRESS set by Ray, so the fleet connects to its own cluster (cluster.py), and bags and
runs are best given as URIs every node reads (s3://...). What the job needs on the cluster:
- the package and its dependencies on every node: the container image (deploy/Dockerfile), or
  with --ship-code this checkout's litevlm_runtime uploaded as the job's `py_modules` (its
  dependencies must still be on the nodes: a runtime environment's pip install would fetch a
  CUDA torch of several GB);
- storage credentials as the nodes' own (instance role, a Kubernetes secret in the pod
  environment: deploy/rayjob.yaml), not sent from here.
`ray job submit --address http://HEAD:8265 -- litevlm fleet regress ...` is the same without this
command's checks; deploy/rayjob.yaml runs it under KubeRay.

Token authentication as in cluster.py: the Jobs API is the dashboard's HTTP server, which wants
the token as an `Authorization: Bearer` header when the cluster uses tokens; Ray's
JobSubmissionClient adds it when RAY_AUTH_MODE=token, and this command turns that on for a
dashboard this user runs on this machine, as it does for a GCS.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cluster import ClusterError, auth_metadata, ours_here, token_mode, token_source

# Ray and requests are imported where a job is submitted or the dashboard probed: Ray takes seconds to load,
# and `litevlm fleet --help` or a job's runtime environment needs neither.

POLL_S = 2.0
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass
class JobResult:
    job_id: str
    status: str
    exit_code: int           # the entrypoint's, or 1 when the job failed without one (never ran)
    message: str


def dashboard_address(option: str | None) -> tuple[str, str]:
    """(http://host:port, how it was given): --address, else RAY_API_SERVER_ADDRESS, else an
    http(s) RAY_ADDRESS: what `ray job submit` reads."""
    for value, given in ((option, "--address"), (os.environ.get("RAY_API_SERVER_ADDRESS"), "RAY_API_SERVER_ADDRESS"),
                         (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")):
        if value and (given != "RAY_ADDRESS" or value.startswith("http")):
            value = value if value.startswith(("http://", "https://")) else f"http://{value}"
            return value.rstrip("/"), f"{given} {value}"
    raise ClusterError("fleet submit: no dashboard address: give --address http://HEAD:8265 (the Ray Jobs API, "
                       "which `ray start --head --include-dashboard true` serves on port 8265) or set "
                       "RAY_API_SERVER_ADDRESS", "address")


def probe_dashboard(address: str, given: str) -> bool:
    """The Jobs API answers, authenticates us, runs our Ray; returns whether to send the token."""
    import ray
    import requests

    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()

    def get(send: bool):
        try:
            return requests.get(f"{address}/api/version", headers=dict(auth_metadata(send)), timeout=10)
        except requests.ConnectionError as exc:
            cause = "refused" if "refused" in str(exc).lower() else "unreachable"
            raise ClusterError(f"{given}: {'connection refused' if cause == 'refused' else 'cannot reach it'} "
                               f"({type(exc).__name__}); is the dashboard on (ray start --head --include-dashboard "
                               "true) and the port right (8265 by default)?", cause) from None
        except requests.Timeout:
            raise ClusterError(f"{given}: no answer within 10 s", "unreachable") from None

    send = mode == "token"
    reply = get(send)
    host_port = re.match(r"https?://\[?([^/\]]+?)\]?:(\d+)", address)
    if (reply.status_code in (401, 403) and not mode and host_port
            and ours_here(host_port.group(1), host_port.group(2), "dashboard")):
        send = True
        reply = get(send)
    if reply.status_code in (401, 403):
        what = (f"rejected the token from {token_source()}" if send else
                "wants a token and none was sent (set RAY_AUTH_MODE=token and the cluster's token in "
                "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
        raise ClusterError(f"{given}: authentication failed: the Jobs API {what} (HTTP {reply.status_code})",
                           "authentication")
    if reply.status_code != 200:
        raise ClusterError(f"{given}: the Jobs API answered HTTP {reply.status_code}: {reply.text[:200]}",
                           "unreachable")
    theirs = reply.json().get("ray_version")
    if theirs and theirs != ray.__version__:
        raise ClusterError(f"{given}: version mismatch: the cluster runs Ray {theirs}, this machine Ray "
                           f"{ray.__version__}; use the same version (requirements.txt pins it)", "version")
    return send


def runtime_env(ship_code: bool, extra: dict | None = None) -> dict:
    """The job's runtime environment: this checkout's package as py_modules with --ship-code."""
    env = dict(extra or {})
    if ship_code:       # the package folder: the one this module is in
        env["py_modules"] = [*env.get("py_modules", []), str(Path(__file__).parent.parent)]
    return env


def _to_stderr(text: str) -> None:
    print(text, end="", file=sys.stderr)


def submit(address: str, given: str, argv: list[str], env: dict, wait: bool = True, submission_id: str | None = None,
           entrypoint_num_cpus: float | None = None, log=_to_stderr) -> JobResult:
    """Submit `litevlm fleet ARGV...` as a job; with `wait`, stream its logs through `log` until it
    ends."""
    from ray.job_submission import JobSubmissionClient

    send = probe_dashboard(address, given)
    entrypoint = shlex.join(["litevlm", "fleet", *argv])
    with token_mode(send):
        client = JobSubmissionClient(address)        # takes the Authorization header now, when token mode is on
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=env or None, submission_id=submission_id,
                               entrypoint_num_cpus=entrypoint_num_cpus)
    log(f"fleet submit: job {job_id} submitted to {address}: {entrypoint}\n")
    if not wait:
        return JobResult(job_id, "PENDING", 0, "not waited for")
    shown = 0
    while True:
        status = str(client.get_job_status(job_id).value)
        logs = client.get_job_logs(job_id)
        if len(logs) > shown:
            log(logs[shown:])
            shown = len(logs)
        if status in TERMINAL:
            break
        time.sleep(POLL_S)
    info = client.get_job_info(job_id)
    code = info.driver_exit_code
    if code is None:
        code = 0 if status == "SUCCEEDED" else 1
    return JobResult(job_id, status, int(code), info.message or "")
