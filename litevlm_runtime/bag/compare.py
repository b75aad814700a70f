"""Comparing two JSON-lines runs of a bag (`bag compare`) and summarising one (`bag summary`)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..pipeline.answer import STAGES
from ..serving.server import STATUS_CODES
from .ids import split

STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}


ANSWER_FIELDS = ("status", "answer", "token_ids", "cameras")
# Compared where both rows have them (runs recorded before frame sets over time lack them): how many
# frame sets the answer used, its kept tokens per set, and the sets' offsets from the query's stamp
# (which survive a replay's re-stamping), to the microsecond.
OVER_TIME_FIELDS = ("frames", "kept_per_frame", "frame_set_offsets_ms")


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{i}: not JSON ({exc})") from None
    return rows


@dataclass
class Comparison:
    differences: list[str]
    latency_rows: list[tuple[str, float, float, float, float]]   # stage, A p50, B p50, A p90, B p90
    matched: int

    @property
    def ok(self) -> bool:
        return not self.differences


def compare_runs(a_rows: list[dict], b_rows: list[dict]) -> Comparison:
    diffs = []
    by_id: list[dict[str, list[dict]]] = []
    for name, rows in (("A", a_rows), ("B", b_rows)):
        d = defaultdict(list)
        for r in rows:
            d[split(r["query_id"])[0]].append(r)      # a replay's tagged id is its bag's id (ids.py)
        for qid, rs in d.items():
            if len(rs) > 1:
                diffs.append(f"{qid}: answered {len(rs)} times in {name}")
        by_id.append(d)
    a, b = by_id
    for qid in sorted(set(a) - set(b)):
        diffs.append(f"{qid}: only in A")
    for qid in sorted(set(b) - set(a)):
        diffs.append(f"{qid}: only in B")
    common = [q for q in a if q in b]
    for qid in common:
        ra, rb = a[qid][0], b[qid][0]
        for f in ANSWER_FIELDS:
            if ra.get(f) != rb.get(f):
                diffs.append(f"{qid}: {f} differs: A {ra.get(f)!r} / B {rb.get(f)!r}")
        for f in OVER_TIME_FIELDS:
            if f in ra and f in rb and _rounded(ra[f]) != _rounded(rb[f]):
                diffs.append(f"{qid}: {f} differs: A {ra[f]!r} / B {rb[f]!r}")
    rows = []
    for stage in (*STAGES, "total"):
        def vals(d):
            out = []
            for q in common:
                r = d[q][0]
                if r.get("status") == "ok":
                    out.append(r["total_ms"] if stage == "total" else r.get("stage_ms", {}).get(stage, 0.0))
            return out
        va, vb = vals(a), vals(b)
        if va and vb:
            rows.append((stage, float(np.median(va)), float(np.median(vb)),
                         float(np.percentile(va, 90)), float(np.percentile(vb, 90))))
    return Comparison(diffs, rows, len(common))


def _rounded(value):
    return [round(v, 3) if isinstance(v, float) else v for v in value] if isinstance(value, list) else value


def reuse_summary(rows: list[dict]) -> dict | None:
    """Visual reuse over ok answers: the vision stage of the first question asked on each frame
    set (its stamps; questions in the order of their stamps, since batched answers are published
    as they finish, a short later answer before a long first one) against the later ones on the
    same set; None without a later question."""
    first, later, seen = [], [], set()
    reused = 0
    for r in sorted(rows, key=lambda r: r.get("query_stamp_ns", 0)):
        if r.get("status") != "ok" or "vision" not in r.get("stage_ms", {}):
            continue
        key = tuple(sorted(r.get("frame_stamps_ns", {}).items()))
        (later if key in seen else first).append(r["stage_ms"]["vision"])
        seen.add(key)
        reused += bool(r.get("reused_cameras"))
    if not first or not later:
        return None
    return {"first": len(first), "first_ms": float(np.median(first)), "later": len(later),
            "later_ms": float(np.median(later)), "answers_reusing": reused}


def latency_table(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """Median and p90 per stage (and total, queue, end-to-end and transport when recorded) over ok answers."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out = []
    for stage in (*STAGES, "total", "queue", "e2e", "transport"):
        if stage in STAGES:
            v = [r["stage_ms"][stage] for r in ok if stage in r.get("stage_ms", {})]
        elif stage == "total":
            v = [r["total_ms"] for r in ok]
        elif stage == "queue":
            v = [r.get("queue_ms", 0.0) for r in ok]
        elif stage == "e2e":
            v = [r["e2e_ms"] for r in ok if "e2e_ms" in r]
        else:   # transport: end-to-end minus what the node spent (queue wait + pipeline)
            v = [r["e2e_ms"] - r["total_ms"] - r.get("queue_ms", 0.0) for r in ok if "e2e_ms" in r]
        if v:
            out.append((stage, float(np.median(v)), float(np.percentile(v, 90)), len(v)))
    return out
