"""`litevlm fleet eval`: every bag of the plan evaluated once, on a pool of Ray actors.

Why a pool of actors fed by the driver, and not ray.util.ActorPool or Ray Data (checked against
Ray 2.60): the unit of work here is a bag (seconds to minutes of inference, hundreds of answers),
and it is also the unit of commit, of resume and of failure ("this bag failed, because ...").
- ray.util.ActorPool hands the next value to an idle actor and ray.get()s one ObjectRef per call:
  that is the ~20 lines of `feed` below that pick a bag. It has no notion of a streamed result
  (an actor method that yields answers as they come: the live count and what a killed worker
  leaves behind), and on ActorDiedError it re-raises and drops the actor for good: no waiting for
  Ray to restart it, no giving the bag to another actor, no attempt count. Those are the rest of
  this module, and would sit around ActorPool unchanged.
- Ray Data's map_batches (an actor pool over batches) cuts work into row batches, streams them
  through its own executor and retries batches; its writers (write_parquet) write files per
  block, not per bag, and a retried block may leave its first attempt's file. The guarantee
  wanted here, a bag's answers land together or not at all and exactly once across resumes,
  would be the same bookkeeping on top, and a bag that fails with its reason would be an error
  that fails the dataset (or is counted away by max_errored_blocks).
So the driver keeps the plan; one thread per actor feeds it bags; Ray restarts dead actors.

Faults, and what each leaves behind (every bag ends complete or failed with a reason, never
half-written, never twice):
- a worker process killed mid-bag: Ray restarts the actor (max_restarts=-1: it reloads the model,
  on any node with room); the driver drops that attempt's streamed answers and gives the bag to
  the pool again, up to --max-attempts times (a bag that kills every worker is then failed);
- a node lost: its actors die the same way and are restarted where resources remain; a feeder
  waits --restart-wait seconds for its actor to be placed and loaded again;
- an actor that cannot be created or restarted (its constructor raised: a --ground-truth folder
  or the package missing on that node, a runtime environment that failed): its feeder stops;
  when no actor is left the remaining bags fail with each actor's reason;
- a bag that cannot be read (corrupt, truncated, no camera topics, deleted from object storage):
  the worker reports the reason, the bag is failed at once (that is not the worker's fault, a
  retry would fail alike), the rest go on;
- the run's storage refusing a write (RunWriteError): the run stops there (every later commit
  would be refused alike), the bags finished so far stay, a rerun resumes;
- the driver itself stopped (Ctrl-C, killed): finished bags are stored; a rerun of the same RUN
  skips them and does the rest.
Exit code 0 when every bag of the plan is complete, 1 when any failed.

Threads: each actor reserves `threads` CPUs from Ray (num_cpus), runs torch with that many
intra-op threads, and Ray places actors only where their CPUs are free, so workers never
oversubscribe a node's cores. Without a cluster a local Ray instance is started with this
machine's available cores (threads.available_cores: affinity and cgroup quota); cluster.py says
how the driver finds and authenticates to a cluster.

Output: progress (the bar, retries, failures as they happen) goes to stderr; the result is the run
itself and the summary the command prints on stdout.
"""

from __future__ import annotations

import queue
import re
import socket
import sys
import threading
import time
from contextlib import ExitStack, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ..errors import InputError
from .cluster import connect
from .dataset import FORMAT, RunFolder, RunWriteError
from .groundtruth import qa_files
from .manifest import check_resume, identity, jsonable, model_checksum, model_dir_of, now_iso, project_version
from .sources import BagRef
from .worker import BagEvaluator, FleetWorker, failure_reason

# Ray (and tqdm) are imported inside the functions that run the pool: Ray takes seconds to load, and --workers
# 0 (one evaluator in this process) runs without it.

# How long a feeder waits for its lost actor to be placed and loaded again: a node lost on a
# cluster with an autoscaler takes minutes to be replaced (a GPU node: image pull, model load).
RESTART_WAIT_S = 300.0


@dataclass
class FleetConfig:
    bags: list[BagRef]
    out: str | Path                      # a local folder or a URI (storage.py)
    params: dict                         # the node's parameters, resolved (ros.params_file.load_node_params)
    params_file: str = ""
    overrides: dict = field(default_factory=dict)
    ground_truth: list[str] = field(default_factory=list)
    ray_address: str | None = None       # --ray (cluster.target: None reads RAY_ADDRESS, else a local instance)
    workers: int | None = None           # None: one per `threads` CPUs of the cluster; 0: in-process, no Ray
    threads: int | None = None           # per worker; None: the cores divided among the workers
    gpus_per_worker: float = 0.0
    max_attempts: int = 3
    restart_wait_s: float = RESTART_WAIT_S
    progress: bool = True


@dataclass
class FleetResult:
    complete: list[str]                  # keys finished in this invocation
    skipped: list[str]                   # keys found finished already (resume)
    failed: dict[str, str]               # key -> reason
    answers: int
    wall_s: float
    workers: int
    threads: int

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def check_ground_truth(folders: list[str]) -> None:
    for f in folders:
        if not Path(f).is_dir():
            raise InputError(f"--ground-truth {f}: no such folder")
        if not qa_files(Path(f)):
            raise InputError(f"--ground-truth {f}: no DriveLM QA json file in it")


class _Progress:
    """The bar: bags done of the plan (ETA from their pace), answers streamed, failures."""

    def __init__(self, total: int, skipped: int, enabled: bool):
        self.bar = None
        self.answers = self.failed = self.retries = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="bag", desc="fleet eval", file=sys.stderr, dynamic_ncols=True)
            if skipped:
                self.bar.write(f"fleet eval: {skipped} bag(s) already finished in this run, skipped", file=sys.stderr)
            self._show()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"answers {self.answers}, failed {self.failed}"
                                     + (f", retried {self.retries}" if self.retries else ""))

    def answer(self, n: int = 1) -> None:
        self.answers += n
        self._show()

    def bag(self, failed: bool = False) -> None:
        self.failed += failed
        if self.bar is not None:
            self.bar.update(1)
        self._show()

    def retry(self) -> None:
        self.retries += 1
        self._show()

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)      # tqdm.write's default is stdout
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Driver:
    """The driver's state: the plan, the attempt each bag is in, the buffered answers of each
    running attempt, and the commits. Only this object writes the run."""

    def __init__(self, cfg: FleetConfig, run: RunFolder, manifest: dict, invocation: dict, todo: list[BagRef],
                 on_event: Callable[[dict], None] | None):
        self.cfg, self.run, self.manifest, self.invocation = cfg, run, manifest, invocation
        self.todo = {b.key: b for b in todo}
        self.outstanding = set(self.todo)
        self.buffers: dict[tuple[str, int], list[dict]] = {}
        self.pending: queue.Queue = queue.Queue()
        self.on_event = on_event or (lambda event: None)
        self.completed: list[str] = []
        self.failed: dict[str, str] = {}
        self.answers = 0
        self.died: dict[str, list[str]] = {}
        self.refused: dict[tuple[str, int], str] = {}      # attempts whose worker may not commit, and why
        self.progress = _Progress(len(todo), len(invocation["skipped"]), cfg.progress)
        for b in todo:
            self.pending.put((b, 1))

    def _bag_entry(self, bag: BagRef, **kv) -> None:
        self.manifest["bags"][bag.key] = {"path": bag.path, **kv}
        self.run.write_manifest(self.manifest, force=False)

    def _check_worker(self, key: str, attempt: int, info: dict) -> None:
        """A worker must run the model the run was planned with (the manifest's checksum): a node
        whose copy of the folder differs would mix two models in one run. The first worker's
        resolved options become the run's effective parameters (the report's table)."""
        planned = self.manifest["model"]["sha256"]
        if info.get("model_sha256") and info["model_sha256"] != planned:
            self.refused[(key, attempt)] = (f"the worker on {info['host']} loaded another model (sha256 "
                                            f"{info['model_sha256'][:16]}) than the run's ({planned[:16]}, "
                                            f"{self.manifest['model']['dir']}): its copy of the folder differs")
        resolved = info.get("resolved_options")
        if resolved and self.manifest.get("resolved_options") is None:
            self.manifest["resolved_options"] = resolved
        elif resolved and resolved != self.manifest.get("resolved_options"):
            differ = sorted(k for k in resolved if resolved[k] != self.manifest["resolved_options"].get(k))
            notes = self.manifest.setdefault("resolved_options_differ", {})
            if info["host"] not in notes:
                notes[info["host"]] = {k: resolved[k] for k in differ}
                self.progress.write(f"fleet eval: the worker on {info['host']} resolved {', '.join(differ)} "
                                    f"differently from the first worker")

    def handle(self, kind: str, bag: BagRef, attempt: int, payload) -> None:
        """One event of a worker's stream, or of the thread driving it ("died": the worker went away)."""
        key = bag.key
        if key not in self.outstanding:
            return                       # (cannot happen: one attempt per bag at a time; a guard)
        if kind == "start":
            self.buffers[(key, attempt)] = []
            hosts = self.invocation["hosts"]
            if payload["host"] not in hosts:
                hosts.append(payload["host"])
            self._check_worker(key, attempt, payload)
            self.on_event({"event": "start", "bag": key, "attempt": attempt, **payload})
        elif kind == "row":
            self.buffers.setdefault((key, attempt), []).append(payload)
            self.progress.answer()
            self.on_event({"event": "row", "bag": key, "attempt": attempt, "pid": payload["worker_pid"],
                           "seq": payload["seq"]})
        elif kind == "done" and (key, attempt) in self.refused:
            self.handle("failed", bag, attempt, self.refused.pop((key, attempt)))
        elif kind == "done":
            rows = self.buffers.pop((key, attempt), [])
            if len(rows) != payload["answers"]:
                raise RuntimeError(f"{key}: {payload['answers']} answers evaluated, {len(rows)} received")
            meta = {"key": key, "path": bag.path, "answers": len(rows), "attempts": attempt, **payload}
            self.run.write_bag(key, rows, meta)
            self.outstanding.discard(key)
            self.completed.append(key)
            self.answers += len(rows)
            self._bag_entry(bag, status="complete", answers=len(rows), attempts=attempt, host=payload["host"],
                            wall_s=round(payload["wall_s"], 3), cpu_s=round(payload["cpu_s"], 3),
                            finished=now_iso(payload["finished"]),
                            **{k: payload[k] for k in ("fetch_bytes", "fetch_s") if k in payload})
            self.progress.bag()
            self.on_event({"event": "done", "bag": key, "attempt": attempt, "answers": len(rows)})
        elif kind in ("failed", "died"):
            self.refused.pop((key, attempt), None)
            streamed = self.buffers.pop((key, attempt), [])
            self.progress.answer(-len(streamed))             # those answers are thrown away
            if kind == "died":
                self.died.setdefault(key, []).append(payload)
                self.on_event({"event": "died", "bag": key, "attempt": attempt, "reason": payload,
                               "discarded": len(streamed)})
                if attempt < self.cfg.max_attempts:
                    self.progress.retry()
                    self.progress.write(f"fleet eval: {bag.name}: worker lost on attempt {attempt} ({payload}); "
                                        f"{len(streamed)} streamed answers dropped, retrying")
                    self.pending.put((bag, attempt + 1))
                    return
                payload = (f"the worker died in each of {attempt} attempts (last: {payload})")
            self.outstanding.discard(key)
            self.failed[key] = payload
            info = {"key": key, "path": bag.path, "reason": payload, "attempts": attempt, "failed": now_iso()}
            self.run.mark_failed(key, info)
            self._bag_entry(bag, status="failed", reason=payload, attempts=attempt)
            self.progress.bag(failed=True)
            self.progress.write(f"fleet eval: {bag.name}: FAILED: {payload}")
            self.on_event({"event": "failed", "bag": key, "attempt": attempt, "reason": payload})

    def finish(self, interrupted: str | None, stopped: str | None) -> None:
        """The invocation's end in the manifest: when, which bags completed and failed, and why it
        ended early (`interrupted`: Ctrl-C; `stopped`: the run's storage refused a write)."""
        self.progress.close()
        self.invocation.update(finished=now_iso(), complete=self.completed, failed=sorted(self.failed),
                               **({"interrupted": interrupted} if interrupted else {}),
                               **({"stopped": stopped} if stopped else {}))
        self.manifest["finished"] = self.invocation["finished"]
        self.manifest["hosts"] = sorted(set(self.manifest["hosts"]) | set(self.invocation["hosts"]))
        try:
            self.run.write_manifest(self.manifest)
        except RunWriteError:
            if not stopped:          # (when the storage refused already, that error is the one to tell)
                raise


def _in_process(cfg: FleetConfig, driver: _Driver, threads: int) -> None:
    """--workers 0: one BagEvaluator in this process, no Ray (for debugging)."""
    evaluator = BagEvaluator(cfg.params, threads, cfg.ground_truth)
    while driver.outstanding:
        bag, attempt = driver.pending.get_nowait()
        for kind, payload in evaluator.stream(bag, attempt):
            driver.handle(kind, bag, attempt, payload)


def _is_worker_loss(exc: BaseException) -> bool:
    """An exception from a Ray call that means the worker (process, actor or node) went away, as
    opposed to an error raised by our own code in the worker (RayTaskError)."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        return isinstance(exc.cause, (rex.RayActorError, rex.WorkerCrashedError))
    return isinstance(exc, rex.RayError)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def death_reason(exc: BaseException) -> str:
    """Why an actor died, in one line: its constructor's exception (Ray puts the traceback's last
    line at the end of the message), or Ray's own exit detail (killed, out of memory, node lost)."""
    text = ANSI.sub("", str(exc)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    if getattr(exc, "actor_init_failed", False) and lines:
        where = re.search(r"ray::([\w.]+)\(\) \(pid=(\d+), ip=([^,)]+)", text)
        at = f" ({where.group(1)} in pid {where.group(2)} on {where.group(3)})" if where else ""
        last = re.sub(r"^(?:\w+\.)+(\w+):", r"\1:", lines[-1])         # litevlm_runtime.errors.InputError -> InputError
        return f"its constructor raised {last}{at}"
    detail = re.search(r"(Worker exit detail:.*?)(?:\n|$)", text)
    if detail:
        return detail.group(1).strip()
    return " ".join(text.split())[:300] or type(exc).__name__


def worker_exit(pid: int, tries: int = 3) -> str:
    """How Ray recorded the end of worker process `pid` ("NODE_OUT_OF_MEMORY: Task was killed due
    to the node running low on memory", "SYSTEM_ERROR: ...": its exit type and the first sentence of
    its exit detail), from Ray's state API; "" where that is not to be had (no dashboard, Ray
    Client, not recorded yet after `tries` seconds). Why a lost worker's own exception is not
    enough: a restarted actor's pending call fails with "The actor was restarted", whatever killed it."""
    try:
        import ray
        from ray.util.state import list_workers

        address = ray.get_runtime_context().gcs_address
        for attempt in range(tries):
            found = list_workers(address=address, filters=[("pid", "=", int(pid))], detail=True, timeout=5,
                                 raise_on_missing_output=False)
            ended = [w for w in found if w.get("exit_type")]
            if ended:
                detail = " ".join(str(ended[-1].get("exit_detail") or "").split())
                first = detail.split(". ")[0].rstrip(".")
                return f"{ended[-1]['exit_type']}: {first}" if detail else ended[-1]["exit_type"]
            time.sleep(1.0)
    except Exception:  # noqa: BLE001 - an explanation that cannot be had is left out, never an error
        pass
    return ""


class _RayPool:
    """The run's Ray actors and one feeder thread per actor: a feeder takes bags from the driver's
    queue, gives them to its actor and puts the actor's stream on `events`; the main thread hands
    every event to the driver (commits, retries, the bar). `client`: Ray Client has no streaming
    generators (ObjectRefGenerator), so each bag's events come back whole when it ends (the bar
    then counts answers per bag, not as they come). A class because the feeders and the main
    thread share `events`, `stop` and `gone`."""

    def __init__(self, cfg: FleetConfig, driver: _Driver, workers: int, threads: int, client: bool):
        import ray

        self.cfg, self.driver, self.client = cfg, driver, client
        Worker = ray.remote(FleetWorker).options(num_cpus=threads, num_gpus=cfg.gpus_per_worker,
                                                 max_restarts=-1, max_task_retries=0)
        self.actors = [Worker.remote(cfg.params, threads, cfg.ground_truth) for _ in range(workers)]
        self.events: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.gone: dict[int, str] = {}            # actor index -> why it will not come back
        self.ask = f"{threads} CPU(s)" + (f" and {cfg.gpus_per_worker:g} GPU(s)" if cfg.gpus_per_worker else "")
        self.feeders = [threading.Thread(target=self.feed, args=(i, a), name=f"fleet-feed-{i}", daemon=True)
                        for i, a in enumerate(self.actors)]

    def ready(self, i: int, actor, first: bool) -> bool:
        """Wait until the actor is placed and has its model loaded (first), or has been restarted
        and loaded it again (a bag sent to an actor still restarting fails at once and would spend
        an attempt); False: it will not come (back), and gone[i] says why."""
        import ray

        deadline = time.monotonic() + self.cfg.restart_wait_s
        last = "waiting to be placed, or loading the model"
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                ray.get(actor.info.remote(), timeout=min(30.0, max(1.0, deadline - time.monotonic())))
                return True
            except ray.exceptions.GetTimeoutError:
                continue                 # not placed yet (no node with room: a lost node's replacement) or loading
            except ray.exceptions.ActorDiedError as exc:
                self.gone[i] = death_reason(exc)
                return False
            except ray.exceptions.RayActorError as exc:
                last = death_reason(exc)
                time.sleep(1.0)          # unavailable: restarting
        if not self.stop.is_set():
            have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            self.gone[i] = (f"not {'placed and loaded' if first else 'back'} within --restart-wait "
                            f"{self.cfg.restart_wait_s:g} s ({last}; each worker asks for {self.ask}, "
                            f"the cluster has {have})")
        return False

    def stream(self, actor, bag: BagRef, attempt: int):
        import ray

        if self.client:
            yield from ray.get(actor.evaluate_bag_whole.remote(bag, attempt))
            return
        for ref in actor.evaluate_bag.remote(bag, attempt):
            yield ray.get(ref)

    def feed(self, i: int, actor) -> None:
        """Feeder thread i: bags from the driver's queue to actor i until the run stops or the
        actor is gone for good."""
        if not self.ready(i, actor, first=True):
            return
        while not self.stop.is_set():
            try:
                job = self.driver.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            if job is None:
                return
            bag, attempt = job
            if not self.evaluate(i, actor, bag, attempt):
                return                   # this actor is gone for good; the others go on

    def evaluate(self, i: int, actor, bag: BagRef, attempt: int) -> bool:
        """One attempt at `bag` on actor i, its events forwarded as they come; an exception ends
        the attempt as "died" (the worker went away) or "failed" (an error of our own code).
        False: the actor was lost and will not come back."""
        pid = None
        try:
            for kind, payload in self.stream(actor, bag, attempt):
                self.events.put((kind, bag, attempt, payload))
                pid = payload["pid"] if kind == "start" else pid
                if kind in ("done", "failed"):
                    break
        except Exception as exc:  # noqa: BLE001 - sorted below: the worker lost, or our bug
            lost = _is_worker_loss(exc)
            why = f"{type(exc).__name__}: {death_reason(exc)}" if lost else failure_reason(exc)
            ended = worker_exit(pid) if lost and pid and not self.client else ""
            self.events.put(("died" if lost else "failed", bag, attempt,
                             f"worker process {pid}: {ended} ({why})" if ended else why))
            if lost and not self.ready(i, actor, first=False):
                return False
        return True

    def handle_events(self) -> None:
        """The main thread: every event to the driver until each bag of the plan is complete or
        failed; when every feeder has stopped (each actor gone for good), the bags left fail with
        the actors' reasons."""
        driver = self.driver
        while driver.outstanding:
            try:
                kind, bag, attempt, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                if not any(t.is_alive() for t in self.feeders) and self.events.empty():     # every actor gone for good
                    why = "; ".join(f"actor {i}: {r}" for i, r in sorted(self.gone.items())) or "no reason recorded"
                    for key in sorted(driver.outstanding):
                        driver.handle("failed", driver.todo[key], 0, f"no worker left ({why})")
                continue
            driver.handle(kind, bag, attempt, payload)

    def close(self) -> None:
        """Stop the feeders and give every actor back."""
        import ray

        self.stop.set()
        for _ in self.feeders:
            self.driver.pending.put(None)
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)      # its cores and its model go back to the cluster
            except Exception:  # noqa: BLE001 - the cluster may be gone already (the reason we stop)
                pass
        for t in self.feeders:
            t.join(timeout=10)


def _ray_pool(cfg: FleetConfig, driver: _Driver, workers: int, threads: int, client: bool = False) -> None:
    """The bags of the plan on a pool of Ray actors (_RayPool), until each is complete or failed."""
    pool = _RayPool(cfg, driver, workers, threads, client)
    for t in pool.feeders:
        t.start()
    try:
        pool.handle_events()
    finally:
        pool.close()


def pool_size(cfg: FleetConfig, bags: int) -> tuple[int, int]:
    """(workers, threads per worker) for a Ray pool: the cluster's CPUs divided among the workers
    (never more workers than bags: an idle actor would only hold a model and cores)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 0))
    if cfg.gpus_per_worker:
        gpus = ray.cluster_resources().get("GPU", 0)
        workers = cfg.workers or max(1, int(gpus // cfg.gpus_per_worker))
    else:
        workers = cfg.workers or max(1, cpus // (cfg.threads or 1))
    workers = max(1, min(workers, bags))
    threads = cfg.threads or max(1, cpus // workers)
    return workers, threads


def _resolve_config(cfg: FleetConfig) -> None:
    """Refuse what cannot run, and rewrite cfg's paths as the workers must read them (a worker's
    working folder is not the driver's)."""
    check_ground_truth(cfg.ground_truth)
    cfg.ground_truth = [str(Path(g).absolute()) for g in cfg.ground_truth]
    if cfg.params.get("model_dir"):
        cfg.params = {**cfg.params, "model_dir": str(model_dir_of(cfg.params))}
    if cfg.max_attempts < 1:
        raise InputError(f"--max-attempts must be >= 1, got {cfg.max_attempts}")
    if cfg.restart_wait_s <= 0:
        raise InputError(f"--restart-wait must be > 0 seconds, got {cfg.restart_wait_s}")


def _new_manifest(cfg: FleetConfig, ident: dict, model: dict, t_start: float) -> dict:
    """The manifest of a run started now: what it evaluates, with which model and parameters."""
    return {"format": FORMAT, "identity": ident, "model": model, "params": jsonable(cfg.params),
            "resolved_options": None, "params_file": cfg.params_file, "overrides": cfg.overrides,
            "ground_truth": ident["ground_truth"], "project": project_version(),
            "started": now_iso(t_start), "finished": None, "hosts": [], "invocations": [], "bags": {}}


class _Placement(NamedTuple):
    """Where an invocation evaluates its bags."""
    workers: int                 # 0: one evaluator in this process, no Ray
    threads: int                 # per worker
    where: str                   # the invocation's "ray": the cluster, "in-process" or "nothing to do"
    client: bool = False         # connected through Ray Client (no streaming generators)


def _placement(cfg: FleetConfig, todo: list[BagRef], stack: ExitStack) -> _Placement:
    """The pool for the bags left to do; Ray is connected only when there are some, for as long as
    `stack` is open."""
    if cfg.workers == 0:
        return _Placement(0, cfg.threads or 0, "in-process")
    if not todo:
        return _Placement(cfg.workers or 0, cfg.threads or 0, "nothing to do")
    # While Ray runs, this process's stdout carries nothing but progress: Ray's driver prints
    # the raylet's error messages ("(raylet) A worker died ...") to sys.stdout whatever
    # log_to_driver says (ray._private.worker.listen_error_messages), and stdout is for results.
    stack.enter_context(redirect_stdout(sys.stderr))
    conn = stack.enter_context(connect(cfg.ray_address))      # shut down when the run ends
    workers, threads = pool_size(cfg, len(todo))
    where = conn.target.given if conn.target.kind == "local" else conn.target.address
    return _Placement(workers, threads, where, conn.client)


def _invocation(placement: _Placement, todo: list[BagRef], skipped: list[str], t_start: float) -> dict:
    """This invocation's entry in the manifest (the driver fills in hosts, complete and failed)."""
    return {"started": now_iso(t_start), "finished": None, "driver": socket.gethostname(),
            "ray": placement.where, "workers": placement.workers, "threads_per_worker": placement.threads,
            "project": project_version(), "planned": [b.key for b in todo], "skipped": skipped,
            "hosts": [], "complete": [], "failed": []}


def run_fleet(cfg: FleetConfig, on_event: Callable[[dict], None] | None = None) -> FleetResult:
    """Evaluate every bag of cfg.bags not finished in cfg.out yet; see the module docstring."""
    t_start = time.time()
    _resolve_config(cfg)
    model = model_checksum(model_dir_of(cfg.params))
    ident = identity(cfg.params, model, cfg.ground_truth)
    run = RunFolder(cfg.out)
    with run.lock(), ExitStack() as stack:
        manifest = run.read_manifest()
        if manifest is None:
            manifest = _new_manifest(cfg, ident, model, t_start)
        else:
            check_resume(manifest, ident, run.path)
        done = run.complete_keys()
        todo = [b for b in cfg.bags if b.key not in done]
        skipped = [b.key for b in cfg.bags if b.key in done]
        placement = _placement(cfg, todo, stack)
        invocation = _invocation(placement, todo, skipped, t_start)
        manifest["invocations"].append(invocation)
        for b in todo:
            manifest["bags"].setdefault(b.key, {"path": b.path, "status": "pending"})
        run.write_manifest(manifest)
        driver = _Driver(cfg, run, manifest, invocation, todo, on_event)
        interrupted, refused = None, None
        try:
            if todo:
                if cfg.workers == 0:
                    _in_process(cfg, driver, placement.threads)
                else:
                    _ray_pool(cfg, driver, placement.workers, placement.threads, placement.client)
        except KeyboardInterrupt:
            interrupted = "interrupted (Ctrl-C)"
        except RunWriteError as exc:
            refused = str(exc)
            raise
        finally:
            driver.finish(interrupted, refused)
        if interrupted:
            raise KeyboardInterrupt
    return FleetResult(driver.completed, skipped, driver.failed, driver.answers, time.time() - t_start,
                       placement.workers, placement.threads)
