"""The contention benchmark's machinery (contention.py): configurations, the hog, the per-config
worker processes and the table. Correctness of the harness only; no timing is asserted."""

from __future__ import annotations

import json
import os
import time

import pytest

from litevlm_runtime.bench.contention import Hog, ThreadConfig, parse_configs
from litevlm_runtime.errors import InputError, LiteVLMError


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")      # utime + stime


def test_configurations_parse_and_bad_ones_are_named():
    configs = parse_configs("default, torch,1,torch+passive,2+active,1+spin")
    assert [(c.name, c.threads, c.wait_policy) for c in configs] == [
        ("default", "default", None), ("torch", "torch", None), ("1", "1", None),
        ("torch+passive", "torch", "PASSIVE"), ("2+active", "2", "ACTIVE"), ("1+spin", "1", "")]
    for bad, named in (
        ("all", "'all'"),
        ("0", "'0'"),
        ("torch+lazy", "'lazy'"),
        ("1,1", "'1'"),
        ("", "no configuration"),
    ):
        with pytest.raises(InputError, match=named):
            parse_configs(bad)


def test_worker_environment_carries_the_wait_policy_and_drops_thread_counts():
    from litevlm_runtime.threads import WAIT_POLICY_OPT_OUT

    base = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"}
    passive = ThreadConfig("torch+passive", "torch", "PASSIVE").worker_env(base)
    assert passive == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    runtime_default = ThreadConfig("1+spin", "1", "").worker_env(base)
    assert "OMP_WAIT_POLICY" not in runtime_default and runtime_default[WAIT_POLICY_OPT_OUT] == "1"
    inherited = ThreadConfig("1", "1", None).worker_env(base)
    assert inherited == {"OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"}


def test_hog_processes_are_busy_inside_and_gone_after():
    with pytest.raises(InputError, match="--hog-kind 'idle'"):
        Hog(1, "idle")
    for kind in ("spin", "matmul"):
        with Hog(2, kind) as hog:
            pids = [p.pid for p in hog.procs]
            assert len(pids) == 2
            before = [cpu_seconds(pid) for pid in pids]
            time.sleep(0.5)
            # busy, not sleeping: each burnt CPU time while this process slept
            assert all(cpu_seconds(pid) > b for pid, b in zip(pids, before)), kind
        assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
                   for pid in pids)


@pytest.mark.slow      # a benchmark run (2-3 min on 2 cores); its parts are tested above
def test_contention_command_prints_the_table_for_each_configuration(tiny_model, capsys):
    from litevlm_runtime.cli import main

    args = ["bench", "--model", str(tiny_model), "--contention", "--hog", "1", "--questions", "2", "--frame-sets", "1",
            "--threads-configs", "default,1+passive,1+spin", "--max_new_tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("config"))
    for column in ("threads", "OMP wait", "quiet p50", "quiet p99", "loaded p50", "loaded p99", "p50 x", "p99 x",
                   "p99 x <= 1.5"):
        assert column in header
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("default", "1+passive", "1+spin")}
    assert set(rows) == {"default", "1+passive", "1+spin"}
    assert rows["1+passive"][1] == "1" and rows["1+passive"][2] == "PASSIVE"
    assert "hog: 1 x spin" in out and "queries per condition: 2" in out

    assert main(args + ["--json", "--rounds", "2", "--threads-configs", "1+passive"]) == 0
    summary = json.loads(capsys.readouterr().out)
    c = summary["configs"]["1+passive"]
    assert summary["queries_per_condition"] == 4 and len(c["quiet_ms"]) == len(c["loaded_ms"]) == 4
    assert c["threads"] == 1 and summary["openmp"] != "unknown"
    assert c["p99_ratio"] == pytest.approx(c["loaded_p99"] / c["quiet_p99"])


def test_a_worker_that_cannot_build_its_pipeline_is_an_error_naming_the_configuration(tmp_path):
    from litevlm_runtime.bench.contention import Workload, run_contention
    from litevlm_runtime.options import PipelineOptions

    with pytest.raises(LiteVLMError, match=r"thread configuration 1\+passive: .*missing"):
        run_contention(tmp_path / "missing", PipelineOptions(), parse_configs("1+passive"), Workload(["Is it?"]), hog=0,
                       progress=lambda m: None)
