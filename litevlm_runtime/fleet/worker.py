"""One fleet worker: the model loaded once, then bag after bag through `bag.evaluate.evaluate`, the very
function `litevlm bag eval` runs (the node's QueryServer and Pipeline in bag time), so each bag's
answers are those `bag eval` gives it.

What loading once must not change: `bag eval` starts every bag in a fresh process, so before each
bag the worker empties the pipeline's visual feature cache (a frame of an earlier bag must not
serve a later one); evaluate() warms the pipeline up per bag exactly as `bag eval` does (the
speculation cost table is re-measured); and a model that fails to load fails the same way for
every bag (each query answered pipeline_error with the load error), as in `bag eval`.

A bag on object storage (a URI) is fetched by the worker itself into a scratch folder of its
own machine, evaluated from there and deleted after (storage.fetch_bag): the driver never reads a
bag's bytes, and each node reads only the bags it evaluates. The summary says how many bytes the
fetch moved and how long it took.

A bag is evaluated on a thread of its own and its answers are streamed (a generator) as they
come: the Ray actor method is that generator (a Ray streaming generator), so the driver counts
answers live and holds them; a worker that dies mid-bag leaves the driver with a partial stream
that it throws away. torch's intra-op thread count is per calling thread under OpenMP, hence
set_threads on the bag's thread.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import traceback
from typing import Callable, Iterator

from ..bag.evaluate import evaluate
from ..bag.io import read_bag
from ..bundled import DEFAULT_MODEL
from ..cameras import CAMERAS
from ..errors import InputError
from ..options import flat_from_options
from ..pipeline.pipeline import Pipeline
from ..pipeline.runtime import set_threads
from ..ros.parameters import pipeline_options_from
from ..serving.explainer import Explainer
from .dataset import row_from_record
from .groundtruth import GroundTruth, Reference
from .manifest import jsonable, model_checksum, model_dir_of, project_version
from .sources import BagRef
from .storage import fetch_bag, remove_scratch, scratch_folder

# Ray is imported in the actor's constructor: BagEvaluator runs without Ray (`fleet eval --workers 0`: one
# evaluator in the driver's process).

PICTURE_WIDTH = 960            # explanation pictures in a run (explain=always): ~100 kB each as JPEG


def failure_reason(exc: BaseException) -> str:
    """One line: what went wrong with a bag (an InputError's own message names the culprit; anything
    else also says where)."""
    if isinstance(exc, InputError):
        return str(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def front_references(bag: str, params: dict, truth: GroundTruth) -> dict[int, dict[str, Reference]]:
    """CAM_FRONT frame stamp -> the references of its DriveLM key frame (by question text), for the
    bag's CAM_FRONT frames that a ground-truth folder has."""

    topic = params["camera_topics"][CAMERAS.index("CAM_FRONT")]
    out: dict[int, dict[str, Reference]] = {}
    for _, _, msgtype, raw, reader in read_bag(bag, [topic]):
        if not msgtype.endswith("CompressedImage"):
            return {}                   # raw pixels: no byte-exact tie to the QA folder's JPEGs
        msg = reader.deserialize(raw, msgtype)
        refs = truth.frame(bytes(msg.data))
        if refs is not None:
            out[msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec] = refs
    return out


class BagEvaluator:
    """The model of one worker process, and bag after bag evaluated on it."""

    def __init__(self, params: dict, threads: int = 0, ground_truth: list[str] | tuple = ()):
        self.params = dict(params)
        if threads and not self.params.get("backend.threads"):
            self.params["backend.threads"] = threads      # the pool's share of the cores, not all of them
        self.threads = int(self.params.get("backend.threads") or 0)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.node = ""                                    # the Ray node id, in an actor
        self.truth = GroundTruth(list(ground_truth)) if ground_truth else None
        t0 = time.perf_counter()
        self.pipeline, self.load_error = None, None
        try:
            model_dir = self.params.get("model_dir") or str(DEFAULT_MODEL)    # "": the bundled model, as bag eval
            self.pipeline = Pipeline.from_pretrained(model_dir, pipeline_options_from(self.params))
        except Exception as exc:  # noqa: BLE001 - every bag reports it, as bag eval does
            self.load_error = exc
        self.load_s = time.perf_counter() - t0
        self._set_threads = set_threads
        # What this worker runs, as its rows say it: the model bytes it loaded (this node's copy of
        # the folder) and the code (this node's package), which need not be the driver's.
        try:
            self.model_sha256 = model_checksum(model_dir_of(self.params))["sha256"]
        except InputError:
            self.model_sha256 = None
        project = project_version()
        self.project = {"project_version": project["version"],
                        "project_commit": (project["git_commit"] + ("-dirty" if project["git_dirty"] else ""))
                        if project["git_commit"] else None}
        # The options the pipeline resolved (every `auto` and 0-means-default replaced): what ran.
        self.resolved = jsonable(flat_from_options(self.pipeline.options)) if self.pipeline is not None else None

    def info(self) -> dict:
        return {"host": self.host, "pid": self.pid, "node": self.node, "threads": self.threads, "load_s": self.load_s,
                "load_error": failure_reason(self.load_error) if self.load_error else "",
                "model_sha256": self.model_sha256, **self.project, "resolved_options": self.resolved}

    def _pipeline(self):
        if self.load_error is not None:
            raise self.load_error
        if self.pipeline.rt.features is not None:
            self.pipeline.rt.features.clear()           # a fresh `bag eval` starts with an empty cache
        return self.pipeline

    def evaluate(self, bag: BagRef, on_row: Callable[[dict], None], attempt: int = 1) -> dict:
        """Evaluate one bag; on_row(row) per answer in answer order; returns the bag's summary.
        Raises when the bag cannot be evaluated (unreadable, no camera topics)."""

        if self.threads:
            self._set_threads(self.threads)
        started, cpu0 = time.time(), time.process_time()     # CPU: every thread of this process
        if not bag.remote:
            return self._evaluate(bag, bag.path, on_row, attempt, started, cpu0, {})
        scratch = scratch_folder()
        try:
            fetched = fetch_bag(bag.path, scratch)
            transfer = {"fetch_bytes": fetched.bytes, "fetch_s": fetched.seconds, "fetch_files": fetched.files}
            try:
                return self._evaluate(bag, str(fetched.path), on_row, attempt, started, cpu0, transfer)
            except Exception as exc:        # the reason names the bag as the user gave it, not its scratch copy
                raise InputError(failure_reason(exc).replace(str(fetched.path), bag.path)) from exc
        finally:
            remove_scratch(scratch)

    def _evaluate(self, bag: BagRef, local: str, on_row: Callable[[dict], None], attempt: int, started: float,
                  cpu0: float, transfer: dict) -> dict:
        refs = front_references(local, self.params, self.truth) if self.truth is not None else {}
        worker = {"host": self.host, "pid": self.pid, "model_sha256": self.model_sha256, **self.project}
        seq, held = [0], []           # held: the last row while its explanation may follow (explain=always)
        explain = self.params.get("explain") == "always"

        def on_record(rec) -> None:
            row = rec.to_json()
            frame_refs = refs.get(rec.frame_stamps_ns.get("CAM_FRONT", -1))
            ref = frame_refs.get(rec.question) if frame_refs else None
            row = row_from_record(row, bag, seq[0], ref, worker, attempt)
            seq[0] += 1
            while held:                   # (an inline explanation comes right after its record, or not at all)
                on_row(held.pop())
            if explain:
                held.append(row)
            else:
                on_row(row)

        def on_explained(done) -> None:
            if held and held[-1]["query_id"] == done.record.query_id:
                held[-1]["explanation_jpeg"] = done.picture

        explainer = Explainer(on_explained, threaded=False, width=PICTURE_WIDTH) if explain else None
        evaluate(local, self.params, on_record, load=self._pipeline, explainer=explainer)
        while held:
            on_row(held.pop())
        return {"answers": seq[0], "host": self.host, "pid": self.pid, "started": started,
                "finished": time.time(), "wall_s": time.time() - started, "cpu_s": time.process_time() - cpu0,
                "with_ground_truth": bool(refs), **transfer}

    def stream(self, bag: BagRef, attempt: int = 1) -> Iterator[tuple]:
        """("start", info), then ("row", row) per answer, then ("done", summary) or
        ("failed", reason): the bag on its own thread, its answers as they come."""
        items: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                items.put(("done", self.evaluate(bag, lambda row: items.put(("row", row)), attempt)))
            except BaseException as exc:  # noqa: BLE001 - the bag's failure, reported with its reason
                items.put(("failed", failure_reason(exc)))

        yield ("start", self.info())
        thread = threading.Thread(target=work, name=f"bag-{bag.key}", daemon=True)
        thread.start()
        while True:
            item = items.get()
            yield item
            if item[0] in ("done", "failed"):
                break
        thread.join()


class FleetWorker:
    """The Ray actor (run.py wraps it with ray.remote): one BagEvaluator per actor process."""

    def __init__(self, params: dict, threads: int, ground_truth: list[str]):
        import ray

        self.evaluator = BagEvaluator(params, threads, ground_truth)
        self.evaluator.node = ray.get_runtime_context().get_node_id()

    def info(self) -> dict:
        return self.evaluator.info()

    def evaluate_bag(self, bag: BagRef, attempt: int):
        """A Ray streaming generator: the bag's events as they come."""
        yield from self.evaluator.stream(bag, attempt)

    def evaluate_bag_whole(self, bag: BagRef, attempt: int) -> list[tuple]:
        """The same events in one list when the bag ends: Ray Client (ray://) has no streaming
        generators."""
        return list(self.evaluator.stream(bag, attempt))
