"""litevlm fleet on the cluster a team already has: a real Ray cluster started as a user starts one
(`ray start --head`, token authentication as Ray 2.60 sets it up: helpers/ray.py) and a real S3
API server (moto's server mode, with IAM authorization: helpers/s3.py).

In CI (one module-scoped cluster and S3 server): bags on S3 evaluated by the workers (the driver's
credentials cannot read a bag's data, so none went through it) into a run folder on S3 that reads
back with pyarrow.dataset, connecting by the address `ray start` printed; a worker killed mid-bag
with the cluster named by RAY_ADDRESS; wrong token, refused port and dashboard address named as
such; actors that cannot start named with their reason; `fleet submit` running `fleet regress` as
a Ray job that writes its report to S3. Slow: resume, a bag deleted and a write refused mid-run on
S3; a Ray Client (ray://) run.
"""

import io
import json
import os
import signal
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from helpers.fleet import answers, bag_eval, rows_of
from helpers.ray import environment, free_ports, ray_cluster
from helpers.s3 import s3_server

from litevlm_runtime import __version__
from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.fleet import run as fleet_run
from litevlm_runtime.fleet.cluster import ClusterError
from litevlm_runtime.fleet.dataset import RunFolder, RunWriteError
from litevlm_runtime.fleet.run import FleetConfig, run_fleet
from litevlm_runtime.fleet.sources import bag_ref, expand_bags

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """Two CPUs, the Jobs API, a Ray Client server; the nodes have the `node` user's S3
    credentials (as nodes have theirs: an instance role, a pod's secret) and the venv on PATH."""
    env = {**s3.env("node"), "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with ray_cluster(cpus=2, auth=True, dashboard=True, env=env, parent=tmp_path_factory.mktemp("c")) as c:
        yield c


@pytest.fixture(scope="module")
def release(s3, bags):
    """The release's bags on S3: a rosbag2 folder, a bare MCAP object, and a list naming both and a
    bag that is not there."""
    s3.upload(bags["small"], "s3://bags/drives/small")
    s3.upload(bags["two"], "s3://bags/drives/two.mcap")
    s3.client().put_object(Bucket="bags", Key="drives/release.txt",
                           Body=b"# the release set\nsmall\ntwo.mcap\nmissing\n")
    return "s3://bags/drives/release.txt"


def cli(*argv) -> int:
    return main(["fleet", *map(str, argv)])


def model_flags(model) -> list[str]:
    return ["--set", f"model_dir={model}", "--set", "max_new_tokens=4"]


@pytest.fixture(scope="module")
def run_a(cluster, s3, release, tiny_model):
    """`fleet eval` of the release on the cluster, by the address `ray start` printed, into S3:
    (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with environment(s3.env("driver")), redirect_stdout(out), redirect_stderr(err):
        code = cli("eval", release, "--ray", cluster.address, "--out", "s3://runs/a", "--workers", 2, "--threads", 1,
                   "--quiet", *model_flags(tiny_model))
    return code, out.getvalue(), err.getvalue()


def test_bags_on_s3_evaluated_on_a_token_cluster(run_a, cluster, s3, bags, params):
    code, out, err = run_a
    assert code == 1                                       # one bag of the list is not there
    assert "Token authentication is enabled" in cluster.head.output    # the cluster Ray set up: with a token
    lines = out.strip().splitlines()
    assert lines[0].startswith("fleet eval: 2 bag(s) evaluated, 0 already finished, 1 failed") and len(lines) == 2
    assert "s3://bags/drives/missing: no such bag (nothing at that URI)" in lines[1]
    assert "(raylet)" not in out and "FAILED" in err      # progress on stderr, results on stdout
    with environment(s3.env("driver")):
        run = RunFolder("s3://runs/a")
        rows, manifest = run.read_rows(), run.read_manifest()
        table = pads.dataset("s3://runs/a/answers", format="parquet", partitioning="hive").to_table()
        failures = run.failures()
    plan = {b.name: b for b in map(bag_ref, ["s3://bags/drives/small", "s3://bags/drives/two.mcap"])}
    for name, local in (("small", bags["small"]), ("two.mcap", bags["two"])):
        mine = rows_of(rows, plan[name].key)
        assert [r["seq"] for r in mine] == list(range(len(mine))) and mine    # each answer once, in order
        assert answers(mine) == bag_eval(local, params)                        # exactly bag eval's answers
        assert manifest["bags"][plan[name].key]["fetch_bytes"] > 0             # fetched by the worker
    assert table.num_rows == len(rows) and set(table.column("bag").to_pylist()) == {b.key for b in plan.values()}
    assert {r["model_sha256"] for r in rows} == {manifest["model"]["sha256"]}
    assert {r["project_version"] for r in rows} == {__version__}
    assert manifest["params"]["tokens.keep_ratio"] == 0.0 and manifest["resolved_options"]["tokens.keep_ratio"] == 0.8
    assert manifest["resolved_options"]["backend.threads"] == 1
    assert list(failures) == [bag_ref("s3://bags/drives/missing").key]


def test_connection_errors_name_their_cause(cluster, tiny_model, bags, tmp_path, capsys):
    """Each answered by a probe in seconds, not by ray.init's 20 s of retries and a bare ConnectionError."""
    cases = [({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}, cluster.address,
              "authentication failed: the cluster at", "rejected the token from RAY_AUTH_TOKEN"),
             ({"RAY_AUTH_MODE": "disabled"}, cluster.address, "authentication required", "RAY_AUTH_MODE=token"),
             ({}, f"127.0.0.1:{free_ports(1)[0]}", "connection refused at 127.0.0.1", "ray start --head"),
             ({}, cluster.head.dashboard, "that is a dashboard address", "fleet submit")]
    for env, address, *said in cases:
        t0 = time.monotonic()
        with environment(env):
            code = cli("eval", bags["small"], "--ray", address, "--out", tmp_path / "run", *model_flags(tiny_model))
        err = capsys.readouterr().err
        assert code == 2 and all(s in err for s in said), err
        assert "f" * 64 not in err and time.monotonic() - t0 < 30      # the token is never printed
    with pytest.raises(ClusterError) as caught, environment({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}):
        with fleet_run.connect(cluster.address):
            pass
    assert caught.value.cause == "authentication"


def test_a_worker_killed_mid_bag_with_the_cluster_in_RAY_ADDRESS(cluster, tmp_path, bags, params, drivelm_dir, capfd):
    """Two actors; one is SIGKILLed right after the first answer of the bigger bag: Ray restarts it,
    the bag is redone, and every bag's answers are there once. The cluster is the one RAY_ADDRESS
    names (as Ray tools are pointed at one)."""
    plan = expand_bags([bags["long"], bags["small"], bags["corrupt"]])
    big, small, corrupt = (b.key for b in plan)
    events, killed = [], []
    lock = threading.Lock()

    def kill_mid_bag(event):
        with lock:
            events.append(event)
            if event["event"] == "row" and event["bag"] == big and not killed:
                os.kill(event["pid"], signal.SIGKILL)
                killed.append(event["pid"])

    with environment({"RAY_ADDRESS": cluster.address}):
        cfg = FleetConfig(plan, tmp_path / "run", params, ground_truth=[str(drivelm_dir)], workers=2, progress=False)
        result = run_fleet(cfg, kill_mid_bag)
    out, err = capfd.readouterr()
    assert out == ""                                    # Ray's "(raylet) A worker died ..." is not a result
    died = [e for e in events if e["event"] == "died"]
    assert killed and died and died[0]["bag"] == big and died[0]["attempt"] == 1
    assert f"worker process {killed[0]}: SYSTEM_ERROR" in died[0]["reason"]       # why it died, from Ray
    assert set(result.complete) == {big, small} and list(result.failed) == [corrupt]
    assert result.exit_code == 1 and "cannot read" in result.failed[corrupt]
    rows = RunFolder(tmp_path / "run").read_rows()
    for bag, key in ((bags["long"], big), (bags["small"], small)):
        mine = rows_of(rows, key)
        assert [r["seq"] for r in mine] == list(range(len(mine)))          # none lost, none twice
        assert answers(mine) == bag_eval(bag, params)
    assert {r["attempt"] for r in rows if r["bag"] == big} == {2} and killed[0] not in {
        r["worker_pid"] for r in rows if r["bag"] == big}
    assert died[0]["discarded"] < len(rows_of(rows, big))                  # it was killed mid-bag
    manifest = RunFolder(tmp_path / "run").read_manifest()
    assert manifest["bags"][big]["attempts"] == 2 and manifest["invocations"][0]["workers"] == 2
    assert manifest["invocations"][0]["ray"] == cluster.address and manifest["hosts"]


def test_actors_that_cannot_start_are_named(cluster, tmp_path, bags, params, monkeypatch):
    """A worker node without the --ground-truth folder (the driver has it): every actor's
    constructor raises, and the bags fail naming that; an actor that cannot be placed (a GPU asked
    of a CPU cluster) fails them after --restart-wait, naming what it asked for."""
    monkeypatch.setattr(fleet_run, "check_ground_truth", lambda folders: None)    # (the driver's machine has it)
    plan = expand_bags([bags["small"]])
    cfg = FleetConfig(plan, tmp_path / "a", params, ground_truth=[str(tmp_path / "only-on-the-driver")],
                      ray_address=cluster.address, workers=1, threads=1, progress=False)
    result = run_fleet(cfg)
    (reason,) = result.failed.values()
    assert reason.startswith("no worker left (actor 0: its constructor raised InputError: --ground-truth")
    assert "only-on-the-driver: no such folder" in reason and "FleetWorker.__init__" in reason
    t0 = time.monotonic()
    cfg = FleetConfig(plan, tmp_path / "b", params, ray_address=cluster.address, workers=1, threads=1,
                      gpus_per_worker=1, restart_wait_s=3, progress=False)
    (reason,) = run_fleet(cfg).failed.values()
    assert "not placed and loaded within --restart-wait 3 s" in reason and "1 GPU(s)" in reason
    assert time.monotonic() - t0 < 120


def test_a_job_on_the_cluster_writes_its_report(run_a, cluster, s3, release, tiny_model, capsys):
    """`fleet submit -- regress ...`: the Ray Jobs API runs eval + compare on the cluster (its
    driver there, with the nodes' credentials); the report lands on S3; the exit code is the job's."""
    capsys.readouterr()
    with environment(s3.env("driver")):
        code = cli("submit", "--address", cluster.head.dashboard, "--", "regress", release, "--baseline",
                   "s3://runs/a", "--out", "s3://runs/job-b", "--report", "s3://reports/job", "--workers", 1,
                   "--threads", 1, "--quiet", *model_flags(tiny_model))
        summary = json.loads(s3.client().get_object(Bucket="reports", Key="job/summary.json")["Body"].read())
        html = s3.client().get_object(Bucket="reports", Key="job/index.html")["Body"].read().decode()
        b_rows = RunFolder("s3://runs/job-b").read_rows()
        a_rows = RunFolder("s3://runs/a").read_rows()
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert out.strip().splitlines()[-1].startswith("fleet submit: job ") and "SUCCEEDED (exit code 0)" in out
    assert "fleet compare: A s3://runs/a" in err                          # the job's own output, streamed
    assert summary["passed"] and summary["matched_answers"] == len(a_rows) == len(b_rows)
    assert not summary["changed_answers"] and summary["lost_bags"] == {}
    assert "Fleet regression: A vs B" in html and "latency_stages.png" in html
    assert answers(b_rows) == answers(a_rows)


@pytest.mark.slow
def test_resume_a_deleted_bag_and_a_refused_write_on_s3(cluster, s3, bags, params, tiny_model):
    """On S3, one worker (bags in plan order): the driver stopped after the first bag, then resumed
    (only the unfinished bags are redone); a bag deleted after the plan was made fails with its
    reason; the run's bucket refusing writes mid-run stops the run without a partial bag, and a
    rerun after the refusal ends finishes it with every bag's rows exactly once."""
    names = ("r1", "r2", "r3", "r4")
    for n, local in zip(names, (bags["small"], bags["two"], bags["small"], bags["long"])):
        s3.upload(local, f"s3://bags/resume/{n}" + (".mcap" if local.is_file() else ""))
    uris = [f"s3://bags/resume/{n}" + (".mcap" if n == "r2" else "") for n in names]
    plan = [bag_ref(u) for u in uris]
    keys = [b.key for b in plan]
    cfg = FleetConfig(plan, "s3://runs/resume", params, ray_address=cluster.address, workers=1, threads=1,
                      progress=False)
    started = []

    def stop_after_first(event):
        started.append(event["bag"]) if event["event"] == "start" else None
        if event["event"] == "done":
            raise KeyboardInterrupt            # the driver stopped (Ctrl-C) after one bag

    with environment(s3.env("driver")):
        with pytest.raises(KeyboardInterrupt):
            run_fleet(cfg, stop_after_first)
        run = RunFolder("s3://runs/resume")
        assert run.complete_keys() == {keys[0]} and started == keys[:1]

        def delete_then_refuse(event):         # (one worker: the next bag is handed out when this one ends)
            if event["event"] == "start":
                started.append(event["bag"])
            if event["event"] == "start" and event["bag"] == keys[1]:
                s3.delete(uris[2])                 # r3 deleted after the plan was made, before it is fetched
            if event["event"] == "start" and event["bag"] == keys[3]:
                s3.refuse_writes("runs")           # r4's commit will be refused

        started.clear()
        with pytest.raises(RunWriteError, match="refused .*ACCESS_DENIED"):
            run_fleet(cfg, delete_then_refuse)
        assert started == keys[1:]                  # the finished bag was not redone
        s3.refuse_writes("runs", on=False)
        assert run.complete_keys() == {keys[0], keys[1]}                  # r4: nothing, not a partial file
        assert "no such bag" in run.failures()[keys[2]]["reason"]
        started.clear()
        result = run_fleet(cfg, lambda e: started.append(e["bag"]) if e["event"] == "start" else None)
        assert started == keys[2:] and result.complete == [keys[3]]       # r3 tried again, still missing
        rows = run.read_rows()
    for key, local in zip(keys, (bags["small"], bags["two"], None, bags["long"])):
        mine = rows_of(rows, key)
        if local is None:
            assert not mine
        else:
            assert [r["seq"] for r in mine] == list(range(len(mine))) and answers(mine) == bag_eval(local, params)


@pytest.mark.slow
def test_a_ray_client_address(cluster, tmp_path, bags, params):
    """ray://HOST:PORT (Ray Client): no streaming generators there, so whole bags come back."""
    cfg = FleetConfig(expand_bags([bags["small"]]), tmp_path / "run", params, ray_address=cluster.head.client,
                      workers=1, threads=1, progress=False)
    result = run_fleet(cfg)
    assert result.exit_code == 0
    rows = RunFolder(tmp_path / "run").read_rows()
    assert answers(rows) == bag_eval(bags["small"], params)
    with pytest.raises(InputError, match="authentication failed"), \
            environment({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}):
        run_fleet(FleetConfig(expand_bags([bags["small"]]), tmp_path / "run2", params,
                              ray_address=cluster.head.client, workers=1, progress=False))
