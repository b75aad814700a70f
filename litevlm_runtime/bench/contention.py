"""Latency on a shared CPU: the same questions answered quiet, then beside N busy processes, for
each thread configuration asked for, in one run; p50/p99 of both conditions and their ratios.

A car's CPU is always shared (perception, planning, logging), and an OpenMP team sized for an
idle machine collapses beside them: when one of its threads is descheduled, the others reach the
next barrier and wait for it, spinning, on the cores the other processes wanted.

    configuration = THREADS[+passive|+active|+spin]
      default       backend.threads = 0: threads.default_threads(), the shipped setting
      torch         torch's own choice at import (one thread per physical core)
      half          half the available cores, at least one (the default before passive waiting)
      N             N intra-op threads
      +passive      OMP_WAIT_POLICY=PASSIVE: an OpenMP thread with no work sleeps at once
      +active       OMP_WAIT_POLICY=ACTIVE: it spins until there is work
      +spin         the OpenMP runtime's own default (libgomp: spin a while, then sleep), i.e.
                    what a process got before litevlm_runtime chose a wait policy
    no suffix: the wait policy litevlm_runtime applies by default (threads.py: PASSIVE)

Each configuration runs in its own Python process (a worker), because the wait policy is read
once, when torch loads its OpenMP runtime, and cannot change inside a process. The worker keeps
one pipeline, warmed up, across both conditions, so that quiet and loaded differ by the load
alone; with `rounds` > 1 the conditions alternate (quiet, loaded, quiet, loaded, ...) so that a
slow drift of the machine's other load hits both. OMP_NUM_THREADS and MKL_NUM_THREADS are removed
from a worker's environment: the configuration, not the caller's shell, says how many threads.

The hog: N processes, each a plain Python loop (`spin`, pure CPU) or single-threaded numpy
matmuls (`matmul`, which also loads the vector units and the memory bus), started before a
loaded phase and stopped after it. They also stop by themselves past a deadline or when their
parent is gone, so none outlives the benchmark.
"""

# Imports inside functions here are deliberate: this module is also the entry point of the worker
# and hog processes (`python -m litevlm_runtime.bench.contention worker|hog`), and a spinning hog
# must start, and a worker must set its thread configuration, before torch is loaded.
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, LiteVLMError
from ..options import flat_from_options
from ..report import table
from ..threads import WAIT_POLICY_OPT_OUT, available_cores

WAIT_POLICIES = {"passive": "PASSIVE", "active": "ACTIVE", "spin": ""}   # "": the runtime's own default
HOG_KINDS = ("spin", "matmul")
GOAL_P99_RATIO = 1.5          # the goal: loaded p99 <= 1.5 x quiet p99
HOG_DEADLINE_S = 3600.0       # a hog's own limit, should its parent fail to stop it
WORKER_ENV_DROPPED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadConfig:
    name: str                 # as given, e.g. "torch+passive"
    threads: str              # "default" | "torch" | "half" | a positive integer, as text
    wait_policy: str | None   # None: the package's default; "": the OpenMP runtime's; else OMP_WAIT_POLICY

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in WORKER_ENV_DROPPED}
        if self.wait_policy is None:
            return env
        env.pop("OMP_WAIT_POLICY", None)
        if self.wait_policy:
            env["OMP_WAIT_POLICY"] = self.wait_policy
        else:
            env[WAIT_POLICY_OPT_OUT] = "1"     # litevlm_runtime sets none: the OpenMP runtime's own
        return env


def parse_configs(spec: str) -> list[ThreadConfig]:
    """'default,torch,1,torch+passive' -> ThreadConfigs; an unknown item is an error naming it."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        threads, plus, policy = item.partition("+")
        if threads not in ("default", "torch", "half") and not (threads.isdigit() and int(threads) > 0):
            raise InputError(f"--threads-configs {item!r}: threads must be default, torch, half or a positive integer")
        if plus and policy not in WAIT_POLICIES:
            raise InputError(f"--threads-configs {item!r}: unknown wait policy {policy!r} "
                             f"(one of {', '.join(WAIT_POLICIES)})")
        if any(c.name == item for c in out):
            raise InputError(f"--threads-configs {item!r}: given twice")
        out.append(ThreadConfig(item, threads, WAIT_POLICIES[policy] if plus else None))
    if not out:
        raise InputError("--threads-configs: no configuration given")
    return out


# ---------------------------------------------------------------------- the hog
def hog_main(kind: str, seconds: float, parent: int) -> None:
    """One busy process: work until `seconds` pass or the parent is gone."""
    end = time.monotonic() + seconds
    if kind == "matmul":
        import numpy as np

        a = np.random.default_rng(0).random((256, 256))
        work = lambda: a @ a        # noqa: E731  (~1 ms of single-threaded BLAS)
    else:
        work = lambda: sum(range(20000))   # noqa: E731  (~0.3 ms of the interpreter)
    print("busy", flush=True)
    while time.monotonic() < end and os.getppid() == parent:
        work()


class Hog:
    """N busy processes while the `with` block runs (each has started working when it is entered)."""

    def __init__(self, count: int, kind: str = "spin"):
        if kind not in HOG_KINDS:
            raise InputError(f"--hog-kind {kind!r}: one of {', '.join(HOG_KINDS)}")
        if count < 0:
            raise InputError(f"--hog {count}: must be 0 or more")
        self.count, self.kind = count, kind
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hog":
        # one BLAS thread per hog: N hogs are N busy cores, not N teams
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "litevlm_runtime.bench.contention", "hog", self.kind, str(HOG_DEADLINE_S),
               str(os.getpid())]
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True))
            for p in self.procs:
                if p.stdout.readline().strip() != "busy":
                    raise LiteVLMError(f"hog process {p.pid} ({self.kind}) did not start (exit {p.poll()})")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        self.procs = []


# ---------------------------------------------------------------------- the worker
def openmp_runtime() -> str:
    """The OpenMP library this process loaded (libgomp, libiomp5 or libomp), from its memory map:
    which one decides whether OMP_WAIT_POLICY / GOMP_SPINCOUNT or KMP_BLOCKTIME apply."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    names = sorted({Path(line.split()[-1]).name for line in maps.splitlines()
                    if any(k in line for k in ("libgomp", "libiomp", "libomp"))})
    return ",".join(names) or "none"


def worker_main() -> None:
    """Reads a spec line, builds and warms the pipeline, then answers 'run' commands on stdin
    with one JSON line of wall-clock milliseconds per query; 'quit' ends it."""
    spec = json.loads(sys.stdin.readline())
    out = sys.stdout
    sys.stdout = sys.stderr           # nothing but replies on the reply channel
    reply = lambda obj: (out.write(json.dumps(obj) + "\n"), out.flush())   # noqa: E731
    try:
        import torch

        from ..frames import load_frame_sets
        from ..options import options_from_flat
        from ..pipeline.pipeline import Pipeline

        torch_threads = torch.get_num_threads()       # torch's own choice (no OMP_NUM_THREADS here)
        flat = dict(spec["options"])
        named = {"default": 0, "torch": torch_threads, "half": max(1, available_cores() // 2)}
        flat["backend.threads"] = named[spec["threads"]] if spec["threads"] in named else int(spec["threads"])
        pipe = Pipeline.from_pretrained(spec["model"], options_from_flat(flat))
        frame_sets = load_frame_sets(Path(spec["frames"]) if spec["frames"] else None, spec["frame_sets"])
        pairs = [(f, q) for _ in range(spec["repeat"]) for f in frame_sets for q in spec["questions"]]
        pipe.warm_up()
        for f, q in pairs[:2]:
            pipe.answer(f, q)
    except LiteVLMError as exc:
        reply({"error": str(exc)})
        return
    reply({"ready": True, "threads": torch.get_num_threads(), "torch_default_threads": torch_threads,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "openmp": openmp_runtime(),
           "pipeline": pipe.rt.options.label(), "queries": len(pairs)})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        ms = []
        for frames, question in pairs:
            t0 = time.perf_counter()
            pipe.answer(frames, question)
            ms.append((time.perf_counter() - t0) * 1000)
        reply({"ms": ms})


class Worker:
    """One configuration's worker process, spoken to over its stdin/stdout."""

    def __init__(self, config: ThreadConfig, spec: dict):
        self.config = config
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "litevlm_runtime.bench.contention", "worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=config.worker_env(dict(os.environ)))
        self.info = self.request(json.dumps({**spec, "threads": config.threads}))

    def request(self, line: str) -> dict:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if not reply:
            self.stderr.seek(0)
            tail = "\n".join(self.stderr.read().strip().splitlines()[-15:])
            raise LiteVLMError(f"thread configuration {self.config.name}: the worker exited "
                               f"({self.proc.wait()}):\n{tail}")
        obj = json.loads(reply)
        if "error" in obj:
            raise LiteVLMError(f"thread configuration {self.config.name}: {obj['error']}")
        return obj

    def run(self) -> list[float]:
        return self.request("run")["ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


# ---------------------------------------------------------------------- the run and its table
@dataclass
class ConfigResult:
    name: str
    info: dict
    quiet_ms: list[float] = field(default_factory=list)
    loaded_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        from ..timing import percentile

        q50, q99 = statistics.median(self.quiet_ms), percentile(self.quiet_ms, 99)
        l50, l99 = statistics.median(self.loaded_ms), percentile(self.loaded_ms, 99)
        return {"threads": self.info["threads"], "omp_wait_policy": self.info["omp_wait_policy"] or "(runtime's own)",
                "quiet_p50": q50, "quiet_p99": q99, "loaded_p50": l50, "loaded_p99": l99,
                "p50_ratio": l50 / q50, "p99_ratio": l99 / q99, "meets_goal": l99 / q99 <= GOAL_P99_RATIO,
                "quiet_ms": self.quiet_ms, "loaded_ms": self.loaded_ms}


@dataclass(frozen=True)
class Workload:
    """The queries every worker answers in each condition: each question on each frame set, `repeat` times."""
    questions: tuple[str, ...]
    frames: Path | None = None          # a folder of frame sets (None: random frames)
    frame_sets: int = 1
    repeat: int = 1

    def __post_init__(self):
        object.__setattr__(self, "questions", tuple(self.questions))


def run_contention(model_dir: Path, options, configs: list[ThreadConfig], workload: Workload, hog: int | None = None,
                   hog_kind: str = "spin", rounds: int = 1, progress=print) -> dict:
    """Every configuration's worker answers the workload quiet and beside `hog` busy processes of
    `hog_kind` (None: one per available core), `rounds` times each; configurations run one after
    another (an idle worker with ACTIVE waiting would spin beside the others)."""
    cores = available_cores()
    hog = cores if hog is None else hog
    Hog(hog, hog_kind)                # validates before any worker starts
    spec = {"model": str(model_dir), "options": {k: v for k, v in flat_from_options(options).items()},
            "frames": str(workload.frames) if workload.frames else None, "frame_sets": workload.frame_sets,
            "questions": list(workload.questions), "repeat": workload.repeat}
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = []
    for config in configs:
        worker = Worker(config, spec)
        try:
            result = ConfigResult(config.name, worker.info)
            for r in range(rounds):
                result.quiet_ms += worker.run()
                with Hog(hog, hog_kind):
                    result.loaded_ms += worker.run()
                progress(
                    f"{config.name} round {r + 1}/{rounds}: quiet p50 {statistics.median(result.quiet_ms):.1f} ms, "
                    f"loaded p50 {statistics.median(result.loaded_ms):.1f} ms"
                )
        finally:
            worker.close()
        results.append(result)
    first = results[0].info
    return {"model": str(model_dir), "cores": cores, "hog": hog, "hog_kind": hog_kind, "rounds": rounds,
            "queries_per_condition": first["queries"] * rounds, "pipeline": first["pipeline"],
            "openmp": first["openmp"], "torch_default_threads": first["torch_default_threads"],
            "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
            "configs": {r.name: r.summary() for r in results}}


def contention_table(summary: dict) -> str:
    headers = ["config", "threads", "OMP wait", "quiet p50", "quiet p99", "loaded p50", "loaded p99",
               "p50 x", "p99 x", f"p99 x <= {GOAL_P99_RATIO:g}"]
    rows = [[name, c["threads"], c["omp_wait_policy"], c["quiet_p50"], c["quiet_p99"], c["loaded_p50"],
             c["loaded_p99"], f"{c['p50_ratio']:.2f}x", f"{c['p99_ratio']:.2f}x", "yes" if c["meets_goal"] else "no"]
            for name, c in summary["configs"].items()]
    return (f"model {summary['model']}  pipeline {summary['pipeline']}  {summary['cores']} cores  "
            f"OpenMP {summary['openmp']}  torch default threads {summary['torch_default_threads']}\n"
            f"hog: {summary['hog']} x {summary['hog_kind']}  queries per condition: {summary['queries_per_condition']} "
            f"({summary['rounds']} round(s))  1-min load average before {summary['load_average_before']:.2f}, "
            f"after {summary['load_average_after']:.2f} (other processes add their own load)\n\n"
            + table(headers, rows)
            + "\n\nms per answer (wall clock, all stages); x = loaded / quiet in the same worker process")


if __name__ == "__main__":
    if sys.argv[1:2] == ["hog"]:
        hog_main(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["worker"]:
        worker_main()
    else:
        sys.exit("usage: python -m litevlm_runtime.bench.contention worker | hog spin|matmul SECONDS PARENT_PID")
