"""A fleet run on disk: one Parquet row per answer, partitioned by bag, plus failures and a manifest.

  RUN/manifest.json              what was run: model folder checksum, parameters, project version,
                                 each invocation's start/end/hosts, every bag's state
  RUN/answers/bag=KEY/part-0.parquet
                                 a finished bag's answers, in answer order (Hive partitioning:
                                 `pyarrow.dataset.dataset(RUN/answers, partitioning="hive")`, pandas,
                                 DuckDB and Spark read it as is); the bag's summary (path, answers,
                                 attempts, host, wall time) is in the file's key-value metadata
  RUN/failed/KEY.json            a bag that failed, with the reason
  RUN/.lock                      held by the one `fleet eval` writing the run

A bag's partition is written once, atomically: the file goes into a hidden temporary folder
(`.tmp-*`, which dataset readers skip) and the folder is renamed to `bag=KEY`, so a reader (or a
resumed run) sees all of a bag's answers or none. The partition existing is what "finished" means:
a rerun skips it, and nothing ever writes it again. Only the driver writes (workers stream their
answers to it), and the lock keeps a second driver out, so no two writers can race for a bag.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from ..pipeline.answer import STAGES
from .groundtruth import Reference
from .sources import BagRef

FORMAT = "litevlm-fleet-run/1"
PART_FILE = "part-0.parquet"
BAG_META_KEY = b"litevlm.bag"

SCHEMA = pa.schema([
    ("bag_path", pa.string()),
    ("seq", pa.int32()),                       # answer order within the bag
    ("query_id", pa.string()),
    ("question", pa.string()),
    ("answer", pa.string()),
    ("status", pa.string()),
    ("status_code", pa.int16()),
    ("status_message", pa.string()),
    ("pipeline", pa.string()),
    ("cameras", pa.list_(pa.string())),
    ("token_ids", pa.list_(pa.int32())),
    ("visual_tokens", pa.int32()),
    ("kept_tokens", pa.int32()),
    ("input_tokens", pa.int32()),
    ("decode_steps", pa.int32()),
    ("accepted_length", pa.float64()),
    *[(f"ms_{s}", pa.float64()) for s in STAGES],      # null: the stage did not run (an error answer)
    ("total_ms", pa.float64()),
    ("queue_ms", pa.float64()),
    ("cpu_ms", pa.float64()),
    ("gc_ms", pa.float64()),
    ("reused_cameras", pa.list_(pa.string())),
    ("degraded", pa.list_(pa.string())),
    ("budget_ms", pa.float64()),
    ("budget_met", pa.bool_()),
    ("query_stamp_ns", pa.int64()),
    ("frame_stamps_ns", pa.map_(pa.string(), pa.int64())),
    # the DriveLM reference, where a --ground-truth folder has this frame and question (else null)
    ("gt_answer", pa.string()),
    ("gt_question_id", pa.string()),           # the challenge's scene_frame_i
    ("gt_frame", pa.string()),
    ("gt_index", pa.int32()),                  # place in its frame (the graph filter's order)
    ("gt_category", pa.string()),
    ("gt_tags", pa.list_(pa.int32())),
    ("gt_source", pa.string()),
    # who answered
    ("worker_host", pa.string()),
    ("worker_pid", pa.int32()),
    ("attempt", pa.int16()),
])


def row_from_record(rec: dict, bag: BagRef, seq: int, ref: Reference | None, host: str, pid: int,
                    attempt: int) -> dict:
    """An AnswerRecord's JSON form (what `bag eval` writes per line) as one dataset row."""
    q = ref.question if ref else None
    stage = rec.get("stage_ms", {})
    return {
        "bag_path": bag.path, "seq": seq,
        **{k: rec[k] for k in ("query_id", "question", "answer", "status", "status_code", "status_message",
                               "pipeline", "cameras", "token_ids", "visual_tokens", "kept_tokens", "input_tokens",
                               "decode_steps", "accepted_length", "total_ms", "queue_ms", "cpu_ms", "gc_ms",
                               "reused_cameras", "degraded", "budget_ms", "budget_met", "query_stamp_ns")},
        **{f"ms_{s}": stage.get(s) for s in STAGES},
        "frame_stamps_ns": dict(rec.get("frame_stamps_ns", {})),
        "gt_answer": q.answer if q else None, "gt_question_id": q.id if q else None,
        "gt_frame": q.frame if q else None, "gt_index": ref.index if ref else None,
        "gt_category": q.category if q else None, "gt_tags": list(q.tags) if q else None,
        "gt_source": ref.source if ref else None,
        "worker_host": host, "worker_pid": pid, "attempt": attempt,
    }


def record_json(row: dict) -> dict:
    """A dataset row back in `bag eval`'s JSON form (the fields both have), e.g. to diff against it."""
    out = {k: row[k] for k in ("query_id", "question", "status", "status_code", "status_message", "answer",
                               "token_ids", "cameras", "total_ms", "queue_ms", "visual_tokens", "kept_tokens",
                               "input_tokens", "decode_steps", "accepted_length", "pipeline", "reused_cameras",
                               "degraded", "budget_ms", "budget_met", "cpu_ms", "gc_ms", "query_stamp_ns")}
    out["stage_ms"] = {s: row[f"ms_{s}"] for s in STAGES if row.get(f"ms_{s}") is not None}
    stamps = row.get("frame_stamps_ns") or {}
    out["frame_stamps_ns"] = dict(stamps) if isinstance(stamps, dict) else dict(stamps)
    return out


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.answers = self.path / "answers"
        self.failed_dir = self.path / "failed"
        self.manifest_path = self.path / "manifest.json"

    # ---- the writer's lock ----
    @contextmanager
    def lock(self):
        """Held while a `fleet eval` writes this run; a second one is refused, naming the run."""
        self.path.mkdir(parents=True, exist_ok=True)
        fh = open(self.path / ".lock", "w")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise InputError(f"{self.path}: another `litevlm fleet eval` is writing this run") from None
        try:
            self.answers.mkdir(exist_ok=True)
            self.failed_dir.mkdir(exist_ok=True)
            for stale in self.answers.glob(".tmp-*"):       # a driver killed between write and rename
                shutil.rmtree(stale, ignore_errors=True)
            yield self
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()

    # ---- bags ----
    def partition(self, key: str) -> Path:
        return self.answers / f"bag={key}"

    def complete_keys(self) -> set[str]:
        if not self.answers.is_dir():
            return set()
        return {p.name[len("bag="):] for p in self.answers.iterdir()
                if p.name.startswith("bag=") and (p / PART_FILE).is_file()}

    def write_bag(self, key: str, rows: list[dict], meta: dict) -> Path:
        """All of a bag's rows, atomically; refuses a bag that is already there (never twice)."""
        final = self.partition(key)
        if final.exists():
            raise FileExistsError(f"{final}: this bag's answers are already written")
        tmp = self.answers / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(
            {BAG_META_KEY: json.dumps(meta).encode()})
        with open(tmp / PART_FILE, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, final)            # atomic; the lock and the check above keep `final` absent
        self.clear_failed(key)
        return final

    def bag_meta(self, key: str) -> dict:
        meta = pq.read_schema(self.partition(key) / PART_FILE).metadata or {}
        return json.loads(meta.get(BAG_META_KEY, b"{}"))

    def mark_failed(self, key: str, info: dict) -> None:
        self.failed_dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(self.failed_dir / f"{key}.json", info)

    def clear_failed(self, key: str) -> None:
        (self.failed_dir / f"{key}.json").unlink(missing_ok=True)

    def failures(self) -> dict[str, dict]:
        if not self.failed_dir.is_dir():
            return {}
        return {p.stem: json.loads(p.read_text()) for p in sorted(self.failed_dir.glob("*.json"))}

    def read_table(self) -> pa.Table:
        """Every finished bag's rows, with the `bag` key as a column, bags in key order."""
        tables = []
        for key in sorted(self.complete_keys()):
            t = pq.read_table(self.partition(key) / PART_FILE).replace_schema_metadata(None)
            tables.append(t.append_column("bag", pa.array([key] * t.num_rows, pa.string())))
        if not tables:
            return SCHEMA.empty_table().append_column("bag", pa.array([], pa.string()))
        return pa.concat_tables(tables)

    def read_rows(self) -> list[dict]:
        rows = self.read_table().to_pylist()
        for r in rows:                     # a Parquet map reads back as (key, value) pairs
            r["frame_stamps_ns"] = dict(r["frame_stamps_ns"] or [])
        return rows

    # ---- manifest ----
    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        data = json.loads(self.manifest_path.read_text())
        if data.get("format") != FORMAT:
            raise InputError(f"{self.manifest_path}: not a fleet run manifest ({data.get('format')!r})")
        return data

    def write_manifest(self, manifest: dict) -> None:
        _write_json_atomic(self.manifest_path, manifest)


def open_run(path: str | Path) -> tuple[RunFolder, dict]:
    """A finished (or partly finished) run for reading: its folder and manifest."""
    run = RunFolder(path)
    manifest = run.read_manifest()
    if manifest is None:
        raise InputError(f"{path}: not a fleet run (no manifest.json; made by `litevlm fleet eval --out`)")
    return run, manifest
