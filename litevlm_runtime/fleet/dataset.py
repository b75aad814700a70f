"""A fleet run: one Parquet row per answer, partitioned by bag, plus failures and a manifest, in a
local folder or under a URI on object storage (storage.py: s3://bucket/runs/rc3, gs://...).

  RUN/manifest.json              what was run: model folder checksum, parameters as given and as
                                 resolved (the effective values), project version, each
                                 invocation's start/end/hosts, every bag's state
  RUN/answers/bag=KEY/part-0.parquet
                                 a finished bag's answers, in answer order (Hive partitioning:
                                 `pyarrow.dataset.dataset(RUN/answers, partitioning="hive")`, pandas,
                                 DuckDB and Spark read it as is, from a folder or a bucket); the bag's
                                 summary (path, answers, attempts, host, wall time, transfer) is in the
                                 file's key-value metadata
  RUN/failed/KEY.json            a bag that failed, with the reason
  RUN/.lock                      held by the one `fleet eval` writing the run

A bag's partition is written once, atomically, and is what "finished" means: a reader (or a
resumed run) sees all of a bag's answers or none, a rerun skips it, and nothing writes it again.
Locally the file goes into a hidden temporary folder (`.tmp-*`, which dataset readers skip) that is
renamed to `bag=KEY`; on object storage the file is uploaded straight to its key, where it appears
whole when the upload completes or not at all (storage.py). Only the driver writes (workers
stream their answers to it), and the lock keeps a second driver out: locally an flock; on object
storage, which has no locks, a lease object the driver renews every LEASE_RENEW_S seconds and
another driver respects while it is younger than LEASE_S (advisory: two drivers started within
the same second could both pass the check; even then a bag's partition is one object at one key,
so its rows cannot be there twice).

The row schema (SCHEMA, row_from_record, record_json) is kept here, in one place.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import threading
import time
import typing
import uuid
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ..errors import InputError
from ..objects import ObjectRef
from ..pipeline.answer import STAGES
from ..serving.record import json_types
from .groundtruth import Reference
from .sources import BagRef
from .storage import Location, locate, reason

FORMAT = "litevlm-fleet-run/1"
PART_FILE = "part-0.parquet"
BAG_META_KEY = b"litevlm.bag"
LEASE_S = 120.0             # an object-storage lock not renewed for this long is stale
LEASE_RENEW_S = 30.0
MANIFEST_EVERY_S = 15.0     # on object storage, the manifest is rewritten at most this often (and at the end)


class RunWriteError(InputError):
    """The run's storage refused a write (permission revoked, quota, bucket gone): the run stops,
    finished bags stay, a rerun resumes."""


ARROW = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_(),
         list[str]: pa.list_(pa.string()), list[int]: pa.list_(pa.int64()),
         list[float]: pa.list_(pa.float64()),
         dict[str, int]: pa.map_(pa.string(), pa.int64()), dict[str, float]: pa.map_(pa.string(), pa.float64())}


def struct_of(cls) -> pa.DataType:
    """A dataclass's fields as an Arrow struct of the same names (ObjectRef: object_id, camera, x, y ...)."""
    hints = typing.get_type_hints(cls)
    return pa.struct([(f.name, ARROW[hints[f.name]]) for f in fields(cls)])


ARROW[list[ObjectRef]] = pa.list_(struct_of(ObjectRef))      # Answer.objects, question_objects


def answer_columns() -> list[tuple[str, pa.DataType]]:
    """The answer's columns, derived from the record's JSON form (serving/record.py: every field
    of the answer and its envelope, plus the derived ones): each stage's milliseconds as its own
    column `ms_<stage>` (null: the stage did not run, an error answer)."""
    out = []
    for name, kind in json_types().items():
        if name == "stage_ms":
            out += [(f"ms_{s}", pa.float64()) for s in STAGES]
        else:
            out.append((name, ARROW[kind]))
    return out


SCHEMA = pa.schema([
    ("bag_path", pa.string()),
    ("seq", pa.int32()),                       # answer order within the bag
    *answer_columns(),
    # the DriveLM reference, where a --ground-truth folder has this frame and question (else null)
    ("gt_answer", pa.string()),
    ("gt_question_id", pa.string()),           # the challenge's scene_frame_i
    ("gt_frame", pa.string()),
    ("gt_index", pa.int32()),                  # place in its frame (the graph filter's order)
    ("gt_category", pa.string()),
    ("gt_tags", pa.list_(pa.int32())),
    ("gt_source", pa.string()),
    # the answer's explanation picture (JPEG, explain/picture.py), with `fleet eval --explain` (else null)
    ("explanation_jpeg", pa.binary()),
    # who answered, with what
    ("worker_host", pa.string()),
    ("worker_pid", pa.int32()),
    ("attempt", pa.int16()),
    ("model_sha256", pa.string()),             # manifest.model_checksum of the model folder the worker loaded
    ("project_version", pa.string()),          # litevlm_runtime.__version__ of the worker
    ("project_commit", pa.string()),           # its git commit (+ "-dirty" with uncommitted changes), or null
])
# The columns a reader adds: the partition key.
READ_SCHEMA = SCHEMA.append(pa.field("bag", pa.string()))


def row_from_record(rec: dict, bag: BagRef, seq: int, ref: Reference | None, worker: dict, attempt: int) -> dict:
    """An AnswerRecord's JSON form (what `bag eval` writes per line) as one dataset row. `worker`:
    host, pid, model_sha256, project_version, project_commit of the worker that answered."""
    q = ref.question if ref else None
    stage = rec.get("stage_ms", {})
    return {
        "bag_path": bag.path, "seq": seq,
        **{k: rec[k] for k in json_types() if k != "stage_ms"},
        **{f"ms_{s}": stage.get(s) for s in STAGES},
        "gt_answer": q.answer if q else None, "gt_question_id": q.id if q else None,
        "gt_frame": q.frame if q else None, "gt_index": ref.index if ref else None,
        "gt_category": q.category if q else None, "gt_tags": list(q.tags) if q else None,
        "gt_source": ref.source if ref else None, "explanation_jpeg": None,
        "worker_host": worker["host"], "worker_pid": worker["pid"], "attempt": attempt,
        "model_sha256": worker.get("model_sha256"), "project_version": worker.get("project_version"),
        "project_commit": worker.get("project_commit"),
    }


def record_json(row: dict) -> dict:
    """A dataset row back in `bag eval`'s JSON form (every key: the columns are that form's)."""
    out = {k: (dict(row[k]) if isinstance(row[k], list) and json_types()[k] in (dict[str, int], dict[str, float])
               else row[k]) for k in json_types() if k != "stage_ms"}
    out["stage_ms"] = {s: row[f"ms_{s}"] for s in STAGES if row.get(f"ms_{s}") is not None}
    return out


# ------------------------------------------------------------------------------ the run folder
class RunFolder:
    def __init__(self, path: str | Path):
        self.loc = locate(str(path))
        self.path = self.loc.uri                  # as a person reads it (for messages)
        self.answers = self.loc.child("answers")
        self.failed_dir = self.loc.child("failed")
        self.manifest_loc = self.loc.child("manifest.json")
        self._manifest_written = 0.0

    def _write(self, where: Location, data: bytes) -> None:
        try:
            where.write_bytes(data)
        except OSError as exc:
            raise RunWriteError(f"{self.path}: writing {where.path[len(self.loc.path):].lstrip('/')} was refused "
                                f"({reason(exc)}); the bags finished so far are kept: rerun the same command to "
                                "resume") from None

    # ---- the writer's lock ----
    @contextmanager
    def lock(self):
        """Held while a `fleet eval` writes this run; a second one is refused, naming the run."""
        if self.loc.local:
            with self._local_lock():
                yield self
        else:
            with self._lease():
                yield self

    @contextmanager
    def _local_lock(self):
        root = self.loc.local_path()
        root.mkdir(parents=True, exist_ok=True)
        fh = open(root / ".lock", "w")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise InputError(f"{self.path}: another `litevlm fleet eval` is writing this run") from None
        try:
            answers = self.answers.local_path()
            answers.mkdir(exist_ok=True)
            self.failed_dir.local_path().mkdir(exist_ok=True)
            for stale in answers.glob(".tmp-*"):       # a driver killed between write and rename
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()

    @contextmanager
    def _lease(self):
        """The object-storage lock (module docstring): a lease object renewed by a thread."""
        lease = self.loc.child(".lock")
        me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if lease.exists():
            try:
                held = json.loads(lease.read_bytes())
            except (OSError, ValueError):
                held = {}
            age = time.time() - float(held.get("renewed", 0))
            if age < LEASE_S:
                raise InputError(f"{self.path}: another `litevlm fleet eval` is writing this run ({held.get('owner')}, "
                                 f"lease renewed {age:.0f} s ago; a lease not renewed for {LEASE_S:.0f} s is stale)")
        stop = threading.Event()

        def renew() -> bool:
            try:
                lease.write_bytes(json.dumps({"owner": me, "renewed": time.time()}).encode())
                return True
            except OSError:
                return False      # a refused write stops the run where it matters (a bag's commit)

        def keep_renewing() -> None:
            while not stop.wait(LEASE_RENEW_S):
                renew()

        if not renew():
            self._write(lease, b"")            # raises RunWriteError naming the refusal
        thread = threading.Thread(target=keep_renewing, name="fleet-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
            try:
                lease.delete()
            except OSError:
                pass

    # ---- bags ----
    def partition(self, key: str) -> Location:
        return self.answers.child(f"bag={key}")

    def part_file(self, key: str) -> Location:
        return self.partition(key).child(PART_FILE)

    def complete_keys(self) -> set[str]:
        keys = set()
        for info in self.answers.files():
            rel = info.path[len(self.answers.path):].strip("/").split("/")
            if len(rel) == 2 and rel[0].startswith("bag=") and rel[1] == PART_FILE:
                keys.add(rel[0][len("bag="):])
        return keys

    def write_bag(self, key: str, rows: list[dict], meta: dict) -> Location:
        """All of a bag's rows, atomically; refuses a bag that is already there (never twice)."""
        final = self.part_file(key)
        if final.exists():
            raise FileExistsError(f"{final}: this bag's answers are already written")
        table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(
            {BAG_META_KEY: json.dumps(meta).encode()})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        if self.loc.local:
            answers = self.answers.local_path()
            tmp = answers / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                locate(str(tmp / PART_FILE)).write_bytes(data)
                os.rename(tmp, self.partition(key).local_path())    # atomic; the lock and the check keep it absent
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RunWriteError(f"{self.path}: writing bag {key} was refused ({reason(exc)}); the bags finished "
                                    "so far are kept: rerun the same command to resume") from None
        else:
            self._write(final, data)
        self.clear_failed(key)
        return final

    def bag_meta(self, key: str) -> dict:
        part = self.part_file(key)
        meta = pq.read_schema(part.path, filesystem=part.fs).metadata or {}
        return json.loads(meta.get(BAG_META_KEY, b"{}"))

    def mark_failed(self, key: str, info: dict) -> None:
        self._write(self.failed_dir.child(f"{key}.json"), (json.dumps(info, indent=1) + "\n").encode())

    def clear_failed(self, key: str) -> None:
        try:
            self.failed_dir.child(f"{key}.json").delete()
        except OSError:
            pass           # a stale failure note next to a finished bag: the partition is what counts

    def failures(self) -> dict[str, dict]:
        out = {}
        for info in sorted(self.failed_dir.files(), key=lambda i: i.path):
            name = info.path.rsplit("/", 1)[-1]
            if name.endswith(".json") and not name.startswith("."):
                loc = self.failed_dir.child(name)
                out[name[:-len(".json")]] = json.loads(loc.read_bytes())
        done = self.complete_keys() if out else set()
        return {k: v for k, v in out.items() if k not in done}

    def read_table(self) -> pa.Table:
        """Every finished bag's rows, with the `bag` key as a column, in bag key then answer order.
        Read as any reader reads the dataset (pyarrow.dataset, Hive partitioning); runs written
        before a column existed read it as null."""
        if not self.complete_keys():
            return READ_SCHEMA.empty_table()
        dataset = ds.dataset(self.answers.path, filesystem=self.answers.fs, format="parquet", schema=READ_SCHEMA,
                             partitioning=ds.partitioning(pa.schema([("bag", pa.string())]), flavor="hive"))
        return dataset.to_table().sort_by([("bag", "ascending"), ("seq", "ascending")]).replace_schema_metadata(None)

    def read_rows(self) -> list[dict]:
        rows = self.read_table().to_pylist()
        for r in rows:                     # a Parquet map reads back as (key, value) pairs
            r["frame_stamps_ns"] = dict(r["frame_stamps_ns"] or [])
        return rows

    # ---- manifest ----
    def read_manifest(self) -> dict | None:
        if not self.manifest_loc.exists():
            return None
        data = json.loads(self.manifest_loc.read_bytes())
        if data.get("format") != FORMAT:
            raise InputError(f"{self.manifest_loc}: not a fleet run manifest ({data.get('format')!r})")
        return data

    def write_manifest(self, manifest: dict, force: bool = True) -> None:
        """On object storage an unforced write is skipped when the last one is younger than
        MANIFEST_EVERY_S (a manifest of 1,000 bags is ~200 KB: rewriting it per bag would move
        ~100 MB); the partitions, not the manifest, say which bags are finished."""
        if not self.loc.local and not force and time.monotonic() - self._manifest_written < MANIFEST_EVERY_S:
            return
        self._write(self.manifest_loc, (json.dumps(manifest, indent=1, sort_keys=False) + "\n").encode())
        self._manifest_written = time.monotonic()


def open_run(path: str | Path) -> tuple[RunFolder, dict]:
    """A finished (or partly finished) run for reading: its folder and manifest."""
    run = RunFolder(path)
    manifest = run.read_manifest()
    if manifest is None:
        raise InputError(f"{path}: not a fleet run (no manifest.json; made by `litevlm fleet eval --out`)")
    return run, manifest
