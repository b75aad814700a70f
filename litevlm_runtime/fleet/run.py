"""`litevlm fleet eval`: every bag of the plan evaluated once, on a pool of Ray actors.

Why actors and not Ray Data's map_batches: the unit of work here is a bag (seconds to minutes of
inference, hundreds of answers), and it is also the unit of commit, of resume and of failure
("this bag failed, because ..."). A pool of actors, each loading the model once, fed one bag at a
time by the driver, maps that one to one: the driver knows which bag each actor holds, commits a
bag's rows only when its stream ended complete, retries exactly that bag when its actor died, and
is the only writer of the run. Ray Data would cut the work into row batches, stream them through
its own executor and retry batches, which fits many small rows (Ray Data's case), not a few long
bags whose answers must land together or not at all; the per-bag bookkeeping would sit on top.

Faults, and what each leaves behind (every bag ends complete or failed with a reason, never
half-written, never twice):
- a worker process killed mid-bag: Ray restarts the actor (max_restarts=-1: it reloads the model,
  on any node with room); the driver drops that attempt's streamed answers and gives the bag to
  the pool again, up to --max-attempts times (a bag that kills every worker is then failed);
- a node lost: its actors die the same way and are restarted where resources remain;
- a bag that cannot be read (corrupt, truncated, no camera topics): the worker reports the
  reason, the bag is failed at once (that is not the worker's fault, a retry would fail alike),
  the rest go on;
- the driver itself stopped (Ctrl-C, killed): finished bags are on disk; a rerun of the same RUN
  skips them and does the rest.
Exit code 0 when every bag of the plan is complete, 1 when any failed.

Threads: each actor reserves `threads` CPUs from Ray (num_cpus), runs torch with that many
intra-op threads, and Ray places actors only where their CPUs are free, so workers never
oversubscribe a node's cores. Without --ray a local Ray instance is started with this machine's
available cores (threads.available_cores: affinity and cgroup quota).
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InputError
from ..threads import available_cores
from .dataset import FORMAT, RunFolder
from .groundtruth import qa_files
from .manifest import check_resume, identity, jsonable, model_checksum, model_dir_of, now_iso, project_version
from .sources import BagRef
from .worker import BagEvaluator, FleetWorker, failure_reason

RESTART_WAIT_S = 600.0     # how long a feeder waits for its lost actor to be placed and loaded again


@dataclass
class FleetConfig:
    bags: list[BagRef]
    out: Path
    params: dict                         # the node's parameters, resolved (ros.params_file.load_node_params)
    params_file: str = ""
    overrides: dict = field(default_factory=dict)
    ground_truth: list[str] = field(default_factory=list)
    ray_address: str | None = None       # None: a local Ray instance; "auto": the running cluster
    workers: int | None = None           # None: one per `threads` CPUs of the cluster; 0: in-process, no Ray
    threads: int | None = None           # per worker; None: the cores divided among the workers
    gpus_per_worker: float = 0.0
    max_attempts: int = 3
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
                self.bar.write(f"fleet eval: {skipped} bag(s) already finished in this run, skipped")
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
            self.bar.write(text)
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
        self.progress = _Progress(len(todo), len(invocation["skipped"]), cfg.progress)
        for b in todo:
            self.pending.put((b, 1))

    def _bag_entry(self, bag: BagRef, **kv) -> None:
        self.manifest["bags"][bag.key] = {"path": bag.path, **kv}
        self.run.write_manifest(self.manifest)

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
            self.on_event({"event": "start", "bag": key, "attempt": attempt, **payload})
        elif kind == "row":
            self.buffers.setdefault((key, attempt), []).append(payload)
            self.progress.answer()
            self.on_event({"event": "row", "bag": key, "attempt": attempt, "pid": payload["worker_pid"],
                           "seq": payload["seq"]})
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
                            finished=now_iso(payload["finished"]))
            self.progress.bag()
            self.on_event({"event": "done", "bag": key, "attempt": attempt, "answers": len(rows)})
        elif kind in ("failed", "died"):
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


def _ray_pool(cfg: FleetConfig, driver: _Driver, workers: int, threads: int) -> None:
    """One thread per actor feeds it bags from the queue and forwards its stream to the driver's
    event queue; the main thread handles every event (commits, retries, the bar)."""
    import ray

    Worker = ray.remote(FleetWorker).options(num_cpus=threads, num_gpus=cfg.gpus_per_worker,
                                             max_restarts=-1, max_task_retries=0)
    actors = [Worker.remote(cfg.params, threads, cfg.ground_truth) for _ in range(workers)]
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def back(actor) -> bool:
        """Wait until a restarted actor has its model loaded again (a bag sent to an actor that is
        still restarting fails at once and would spend an attempt); False: it will not come back."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                ray.get(actor.info.remote(), timeout=30)
                return True
            except ray.exceptions.GetTimeoutError:
                continue                 # still being placed (a node lost: waiting for room) or loading
            except ray.exceptions.ActorDiedError:
                return False
            except ray.exceptions.RayActorError:
                time.sleep(1.0)          # unavailable: restarting
        return False

    def feed(actor) -> None:
        while not stop.is_set():
            try:
                job = driver.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            if job is None:
                return
            bag, attempt = job
            try:
                for ref in actor.evaluate_bag.remote(bag, attempt):
                    kind, payload = ray.get(ref)
                    events.put((kind, bag, attempt, payload))
                    if kind in ("done", "failed"):
                        break
            except Exception as exc:  # noqa: BLE001 - sorted below: the worker lost, or our bug
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
                lost = _is_worker_loss(exc)
                events.put(("died" if lost else "failed", bag, attempt, reason if lost else failure_reason(exc)))
                if lost and not back(actor):
                    return               # this actor is gone for good; the others go on

    feeders = [threading.Thread(target=feed, args=(a,), name=f"fleet-feed-{i}", daemon=True)
               for i, a in enumerate(actors)]
    for t in feeders:
        t.start()
    try:
        while driver.outstanding:
            try:
                kind, bag, attempt, payload = events.get(timeout=0.5)
            except queue.Empty:
                if not any(t.is_alive() for t in feeders):     # every actor gone for good
                    for key in sorted(driver.outstanding):
                        driver.handle("failed", driver.todo[key], 0, "no worker left: the pool's actors could "
                                      f"not be restarted within {RESTART_WAIT_S:.0f} s")
                continue
            driver.handle(kind, bag, attempt, payload)
    finally:
        stop.set()
        for _ in feeders:
            driver.pending.put(None)
        for a in actors:
            try:
                ray.kill(a, no_restart=True)      # its cores and its model go back to the cluster
            except Exception:  # noqa: BLE001 - the cluster may be gone already (the reason we stop)
                pass
        for t in feeders:
            t.join(timeout=10)


def _ray_init(address: str | None) -> bool:
    """Connect to (address) or start (None) Ray; True when this call did, so we shut it down."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as exc:
            raise InputError(f"--ray {address}: no Ray cluster there ({str(exc).splitlines()[0]}); start one with "
                             "`ray start --head`, or leave --ray out for a local instance") from None
    else:
        # A local instance sized to this machine (RAY_TMPDIR, if set, keeps its files out of /tmp).
        ray.init(num_cpus=available_cores(), **kwargs)
    return True


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


def run_fleet(cfg: FleetConfig, on_event: Callable[[dict], None] | None = None) -> FleetResult:
    """Evaluate every bag of cfg.bags not finished in cfg.out yet; see the module docstring."""
    t_start = time.time()
    check_ground_truth(cfg.ground_truth)
    if cfg.max_attempts < 1:
        raise InputError(f"--max-attempts must be >= 1, got {cfg.max_attempts}")
    model = model_checksum(model_dir_of(cfg.params))
    ident = identity(cfg.params, model, cfg.ground_truth)
    run = RunFolder(cfg.out)
    with run.lock():
        manifest = run.read_manifest()
        if manifest is None:
            manifest = {"format": FORMAT, "identity": ident, "model": model, "params": jsonable(cfg.params),
                        "params_file": cfg.params_file, "overrides": cfg.overrides,
                        "ground_truth": ident["ground_truth"], "project": project_version(),
                        "started": now_iso(t_start), "finished": None, "hosts": [], "invocations": [], "bags": {}}
        else:
            check_resume(manifest, ident, run.path)
        done = run.complete_keys()
        todo = [b for b in cfg.bags if b.key not in done]
        skipped = [b.key for b in cfg.bags if b.key in done]
        in_process = cfg.workers == 0
        started_ray = False
        if in_process:
            workers, threads = 0, cfg.threads or 0
            where = "in-process"
        else:
            started_ray = _ray_init(cfg.ray_address) if todo else False
            workers, threads = pool_size(cfg, len(todo)) if todo else (cfg.workers or 0, cfg.threads or 0)
            where = cfg.ray_address or "local"
        invocation = {"started": now_iso(t_start), "finished": None, "driver": socket.gethostname(),
                      "ray": where, "workers": workers, "threads_per_worker": threads,
                      "project": project_version(), "planned": [b.key for b in todo], "skipped": skipped,
                      "hosts": [], "complete": [], "failed": []}
        manifest["invocations"].append(invocation)
        for b in todo:
            manifest["bags"].setdefault(b.key, {"path": b.path, "status": "pending"})
        run.write_manifest(manifest)
        driver = _Driver(cfg, run, manifest, invocation, todo, on_event)
        interrupted = None
        try:
            if todo:
                if in_process:
                    _in_process(cfg, driver, threads)
                else:
                    _ray_pool(cfg, driver, workers, threads)
        except KeyboardInterrupt:
            interrupted = "interrupted (Ctrl-C)"
        finally:
            driver.progress.close()
            if started_ray:
                import ray

                ray.shutdown()
            invocation.update(finished=now_iso(), complete=driver.completed, failed=sorted(driver.failed),
                              **({"interrupted": interrupted} if interrupted else {}))
            manifest["finished"] = invocation["finished"]
            manifest["hosts"] = sorted(set(manifest["hosts"]) | set(invocation["hosts"]))
            run.write_manifest(manifest)
        if interrupted:
            raise KeyboardInterrupt
    return FleetResult(driver.completed, skipped, driver.failed, driver.answers, time.time() - t_start,
                       workers, threads)
