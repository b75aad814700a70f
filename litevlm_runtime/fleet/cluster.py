"""Connecting the fleet's driver to Ray as Ray users do, and saying why when it cannot.

Where (`target`): `--ray ADDRESS`, else the RAY_ADDRESS environment variable, else a local Ray
instance sized to this machine (`--ray local` forces one). ADDRESS is what Ray tools take:
`auto` (the cluster `ray start` last started on this machine), `HOST:PORT` (the GCS: what
`ray start --head` prints), or `ray://HOST:PORT` (a Ray Client server, port 10001 by default).

Authentication: Ray 2.52+ has token authentication (Ray 2.59+ turns it on for clusters started
on a machine that has a token). Ray reads the token itself, in this order: RAY_AUTH_TOKEN,
the file named by RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token; RAY_AUTH_MODE=token|disabled says whether
to send it. The fleet passes that through (it never reads, copies or prints the token: Ray's own
AuthenticationTokenLoader hands it to the probe below as a header), with one addition to Ray's
rule. Ray sends the token unasked only when it found the cluster itself (`auto`), never to an
address given explicitly, so `ray.init("127.0.0.1:6379")` against a token cluster started with
plain `ray start --head` fails after 20 s with a bare ConnectionError ("InvalidAuthToken" only in
a C++ log line). The fleet also sends it when the address is a cluster this user runs on this
machine (a gcs_server process of our uid listening on that port: ours_here): the same trust as `auto`, the
case a user of `ray start --head` is in. To any other address it is sent only with
RAY_AUTH_MODE=token, as Ray does.

Why a probe before ray.init: ray.init answers every failure to connect with the same
ConnectionError after 20 s of retries. One gRPC call to the GCS (the internal KV read that
ray.init itself starts with, for the cluster's versions) tells in well under a second whether
the address refuses connections, cannot be reached, rejects the token (or wants one), or runs
another Ray or Python than this driver (Ray's own check_version_info decides, as ray.init would).
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..threads import available_cores

# Ray, its generated gRPC stubs and grpc are imported inside the functions that use them: Ray takes seconds to
# load, and the modules importing this one (the run, the job) load it only when they reach a cluster.

PROBE_TIMEOUT_S = 5.0
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


class ClusterError(InputError):
    """The cluster cannot be used; `cause` is one of: address, unreachable, refused,
    authentication, version."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class Target:
    kind: str            # "local" (start one), "gcs" (HOST:PORT), "client" (ray://HOST:PORT)
    address: str         # HOST:PORT ("" for local)
    given: str           # how the user named it, for messages: "--ray 10.0.0.5:6379", "RAY_ADDRESS=auto"
    auto: bool = False   # found by Ray's `auto` (the token may be sent, as Ray does)


def _host_port(text: str, given: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{given}: not a Ray address (auto, HOST:PORT, or ray://HOST:PORT)", "address")
    return host.strip("[]"), int(port)


def target(ray_option: str | None) -> Target:
    """The cluster the driver should use (module docstring)."""
    if ray_option:
        raw, given = ray_option.strip(), f"--ray {ray_option}"
    else:
        raw = os.environ.get("RAY_ADDRESS", "").strip()
        given = f"RAY_ADDRESS={raw}"
    if not raw or raw == "local":
        return Target("local", "", given if raw else "a local Ray instance")
    if raw.startswith(("http://", "https://")):
        raise ClusterError(f"{given}: that is a dashboard address (the Ray Jobs API, for `litevlm fleet submit`); "
                           "fleet eval connects to the cluster itself: HOST:PORT as `ray start --head` printed it "
                           "(port 6379 by default), ray://HOST:10001, or auto", "address")
    if raw.startswith("ray://"):
        host, port = _host_port(raw[len("ray://"):], given)
        return Target("client", f"{host}:{port}", given)
    if raw == "auto":
        from ray._private import services

        try:
            found = services.canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError as exc:
            raise ClusterError(f"{given}: no Ray cluster is running on this machine ({str(exc).splitlines()[0]}); "
                               "start one with `ray start --head`, or give its HOST:PORT", "refused") from None
        host, port = _host_port(found, given)
        return Target("gcs", f"{host}:{port}", given, auto=True)
    host, port = _host_port(raw, given)
    return Target("gcs", f"{host}:{port}", given)


# ------------------------------------------------------------------------------ the token
def _token_loader():
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()          # the environment may have changed since it last looked (tests, a job)
    return loader


def token_source() -> str:
    """Where Ray takes the token from, in its order (never the token itself)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return str(Path.home() / ".ray" / "auth_token")


def auth_metadata(send: bool) -> list[tuple[str, str]]:
    """[("authorization", "Bearer ...")] from Ray's loader (which hands a token out only while
    token mode is on), or [] when not sending."""
    if not send:
        return []
    with token_mode(True):
        return list(_token_loader().get_token_for_http_header().items())


def ours_here(host: str, port: int | str, kind: str = "gcs") -> bool:
    """Whether a Ray process of this user, on this machine, serves `port` at `host` (loopback, or
    the address it was started on): kind "gcs" (gcs_server --gcs_server_port=PORT), "dashboard"
    (dashboard.py --port=PORT) or "client" (the Ray Client server, ray.util.client.server --port=PORT)."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return False
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or proc.stat().st_uid != os.getuid():
                continue
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        args = dict(a.lstrip("-").split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
        if kind == "gcs":
            mine = argv[0].endswith("gcs_server") and args.get("gcs_server_port") == str(port)
            hosts = {args.get("node-ip-address")}
        else:
            program = "dashboard/dashboard.py" if kind == "dashboard" else "ray.util.client.server"
            mine = any(a.endswith(program) for a in argv) and args.get("port") == str(port)
            hosts = {args.get("host")}
        if mine and (ip.startswith("127.") or ip in hosts or "0.0.0.0" in hosts):
            return True
    return False


# ------------------------------------------------------------------------------ the probe
def _classify(exc, t: Target, sent: bool) -> ClusterError:
    import grpc

    code, details = exc.code(), (exc.details() or "").strip()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if sent:
            return ClusterError(f"{t.given}: authentication failed: the cluster at {t.address} rejected the token "
                                f"from {token_source()} ({details}); give the cluster's token (on its head node: "
                                "`ray get-auth-token`) in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH", "authentication")
        return ClusterError(f"{t.given}: authentication required: the cluster at {t.address} uses Ray token "
                            f"authentication ({details}) and no token was sent; set RAY_AUTH_MODE=token and give its "
                            "token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (on its head node: "
                            "`ray get-auth-token`)", "authentication")
    if code == grpc.StatusCode.UNAVAILABLE and "refused" in details.lower():
        return ClusterError(f"{t.given}: connection refused at {t.address}: no Ray cluster listens there (start one "
                            "with `ray start --head`; the address is the one it prints)", "refused")
    if code == grpc.StatusCode.UNAVAILABLE and ("dns" in details.lower() or "resolve" in details.lower()):
        return ClusterError(f"{t.given}: unknown host in {t.address} ({details})", "unreachable")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ClusterError(f"{t.given}: {t.address} cannot be reached within {PROBE_TIMEOUT_S:.0f} s ({code.name}: "
                            f"{details or 'no answer'}); check the address, the network and firewalls", "unreachable")
    return ClusterError(f"{t.given}: the cluster at {t.address} answered {code.name}: {details}", "unreachable")


def _call(t: Target, send: bool):
    """One cheap RPC the cluster answers only to an authenticated caller: the GCS's cluster
    metadata (versions), or a Ray Client server's ping."""
    import grpc

    with grpc.insecure_channel(t.address) as channel:
        metadata = auth_metadata(send)
        if t.kind == "client":
            from ray.core.generated import ray_client_pb2 as pb
            from ray.core.generated import ray_client_pb2_grpc as stubs

            stubs.RayletDriverStub(channel).ClusterInfo(pb.ClusterInfoRequest(type=pb.ClusterInfoType.PING),
                                                        metadata=metadata, timeout=PROBE_TIMEOUT_S)
            return None
        from ray.core.generated import gcs_service_pb2 as pb
        from ray.core.generated import gcs_service_pb2_grpc as stubs

        reply = stubs.InternalKVGcsServiceStub(channel).InternalKVGet(
            pb.InternalKVGetRequest(namespace=b"cluster", key=b"CLUSTER_METADATA"), metadata=metadata,
            timeout=PROBE_TIMEOUT_S)
        return json.loads(reply.value) if reply.value else None


def check_versions(metadata: dict | None, t: Target) -> None:
    """Ray's own rule (ray._private.utils.check_version_info, as ray.init applies it)."""
    if not metadata:
        return
    from ray._private.utils import check_version_info, compute_version_info

    try:
        check_version_info(metadata, "this driver")
    except Exception:  # noqa: BLE001 - Ray raises a bare Exception (or RuntimeError) naming both versions
        ray_v, py_v = compute_version_info()
        raise ClusterError(f"{t.given}: version mismatch: the cluster at {t.address} runs Ray "
                           f"{metadata.get('ray_version')} on Python {metadata.get('python_version')}, this driver "
                           f"Ray {ray_v} on Python {py_v}; use the same versions on both (requirements.txt pins "
                           "Ray; the container image in deploy/ has both)", "version") from None


def probe(t: Target) -> bool:
    """Check the cluster answers, authenticates us and runs our versions; returns whether the
    token must be sent (module docstring). Raises ClusterError naming the cause."""
    import grpc

    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    send = mode == "token"
    if send and not _token_loader().has_token(ignore_auth_mode=True):
        raise ClusterError(f"{t.given}: RAY_AUTH_MODE=token but no token was found (RAY_AUTH_TOKEN, "
                           f"RAY_AUTH_TOKEN_PATH, {Path.home() / '.ray' / 'auth_token'}); `ray get-auth-token` on "
                           "the cluster's head node prints it", "authentication")
    try:
        metadata = _call(t, send)
    except grpc.RpcError as exc:
        may_send = (not mode and _token_loader().has_token(ignore_auth_mode=True)
                    and (t.auto or ours_here(*t.address.rsplit(":", 1), "client" if t.kind == "client" else "gcs")))
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED or not may_send:
            raise _classify(exc, t, send) from None
        send = True
        try:
            metadata = _call(t, send)
        except grpc.RpcError as exc2:
            raise _classify(exc2, t, send) from None
    check_versions(metadata, t)
    return send


# ------------------------------------------------------------------------------ connect
@contextmanager
def token_mode(on: bool):
    """RAY_AUTH_MODE=token for this process while connected (Ray's own
    authentication_token_setup._enable_token_auth does the same: the variable, then RayConfig
    re-read), restored afterwards so that the next connection decides afresh."""
    if not on or os.environ.get("RAY_AUTH_MODE") == "token":
        yield
        return
    old = os.environ.get("RAY_AUTH_MODE")
    _set_auth_mode("token")
    try:
        yield
    finally:
        _set_auth_mode(old)


def _set_auth_mode(value: str | None) -> None:
    """RAY_AUTH_MODE = value (None: unset), and Ray's cached RayConfig re-read, as Ray does."""
    from ray._raylet import Config

    if value is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = value
    Config.initialize("")


@dataclass
class Connection:
    target: Target
    started_here: bool       # a local instance this process started (and stops)
    client: bool             # Ray Client: no streaming generators (run.py asks for whole bags)


@contextmanager
def connect(ray_option: str | None, log_to_driver: bool = False):
    """ray.init for the fleet's driver; yields a Connection, shuts Ray down after when it
    connected here. Ray already initialised in this process (a caller's own ray.init): used as is."""
    import ray

    if ray.is_initialized():
        yield Connection(Target("gcs", "", "the Ray this process is connected to"), False,
                         ray.util.client.ray.is_connected())
        return
    t = target(ray_option)
    kwargs = dict(log_to_driver=log_to_driver, configure_logging=False)
    if t.kind == "local":
        # A local instance sized to this machine (RAY_TMPDIR, if set, keeps its files out of /tmp).
        # address="local": RAY_ADDRESS, if set, is not read a second time by ray.init. Ray turns
        # token authentication on for it by setting RAY_AUTH_MODE in this process: undone after.
        saved = os.environ.get("RAY_AUTH_MODE")
        ray.init(address="local", num_cpus=available_cores(), include_dashboard=False, **kwargs)
        try:
            yield Connection(t, True, False)
        finally:
            ray.shutdown()
            if os.environ.get("RAY_AUTH_MODE") != saved:
                _set_auth_mode(saved)
        return
    send = probe(t)
    with token_mode(send):
        try:
            if t.kind == "client":
                ray.init(address=f"ray://{t.address}", **kwargs)
            else:
                ray.init(address=t.address, **kwargs)
        except (ConnectionError, RuntimeError, TimeoutError) as exc:
            text = " ".join(str(exc).split())
            cause = "version" if "version" in text.lower() else "unreachable"
            raise ClusterError(f"{t.given}: ray.init failed after the cluster answered ({text[:300]})", cause) from None
        try:
            yield Connection(t, False, t.kind == "client")
        finally:
            ray.shutdown()
