"""A fleet comparison as a folder a person opens: index.html (static, no scripts), PNG plots made
with matplotlib, camera thumbnails of the frames whose answers changed, and summary.json (the
same numbers, for machines).

Thumbnails are read from the bags themselves (their paths are in the runs), only the frames of
the answers shown, each camera once: the six cameras of the frame set in rig order, the ones each
run selected marked. A bag that is no longer where the run read it gets a note instead. Runs made
with `fleet eval --explain` carry each answer's explanation picture: a changed answer shows A's and
B's side by side (docs/explain.md).
"""

from __future__ import annotations

import html
import io
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..bag.io import read_bag
from ..cameras import CAMERAS
from ..serving.images import CompressedPayload, payload_from_msg, raw_to_rgb
from .compare import Comparison
from .storage import fetch_bag, is_uri, locate, remove_scratch, scratch_folder, upload_tree

# matplotlib and PIL are imported where plots and thumbnails are made: both are heavy, and the comparison
# itself needs neither.

THUMB_WIDTH = 176
CSS = """
body { font: 14px/1.4 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px; color: #222;
       max-width: 1340px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f5f5f5; } td.l, th.l { text-align: left; }
.pass { background: #e6f4ea; color: #137333; padding: 8px 12px; font-weight: 600; border-radius: 4px; }
.fail { background: #fce8e6; color: #a50e0e; padding: 8px 12px; font-weight: 600; border-radius: 4px; }
.worse { color: #a50e0e; font-weight: 600; } .better { color: #137333; font-weight: 600; }
.meta td { text-align: left; } .small { color: #666; font-size: 12px; }
.change { border: 1px solid #ddd; border-radius: 4px; padding: 8px 10px; margin: 10px 0; }
.thumbs { display: grid; grid-template-columns: repeat(6, 182px); gap: 4px; margin: 6px 0; }
.thumbs figure { margin: 0; } .thumbs img { width: 176px; border: 3px solid transparent; display: block; }
.thumbs img.selA { border-color: #1a73e8; } .thumbs img.selB { border-color: #e8710a; }
.thumbs img.selAB { border-color: #9334e6; } .thumbs figcaption { font-size: 11px; color: #555; }
.ans { display: grid; grid-template-columns: 110px 1fr; gap: 2px 8px; } .ans .k { color: #666; }
img.plot { max-width: 100%; border: 1px solid #eee; }
.note { background: #fef7e0; color: #7a4f01; padding: 8px 12px; border-radius: 4px; }
.pics { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; margin: 6px 0; } .pics img { width: 100%; }
.pics figure { margin: 0; } .pics figcaption { font-size: 12px; color: #555; }
"""


def _e(v) -> str:
    return html.escape("" if v is None else str(v))


def _num(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _delta(a, b, higher_is_better: bool = True, digits: int = 3) -> str:
    if a is None or b is None:
        return "-"
    d = b - a
    cls = "" if abs(d) < 10 ** -digits else ("better" if (d > 0) == higher_is_better else "worse")
    return f'<span class="{cls}">{d:+.{digits}f}</span>'


def _ratio(r, limit: float | None = None) -> str:
    if r is None:
        return "-"
    cls = "worse" if (limit is not None and r > limit) or (limit is None and r > 1.10) else (
        "better" if r < 0.95 else "")
    return f'<span class="{cls}">{r:.2f}x</span>'


# ------------------------------------------------------------------------------------ plots
def _plots(cmp: Comparison, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = {}
    colors = {"A": "#1a73e8", "B": "#e8710a"}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        made[name] = f"{name}.png"

    def side_by_side(ax, labels: list[str], values: dict[str, list[float]], ylabel: str, title: str, **ticks) -> None:
        """A's and B's bars side by side for each label."""
        x = np.arange(len(labels))
        for off, name in ((-0.2, "A"), (0.2, "B")):
            ax.bar(x + off, values[name], 0.4, label=name, color=colors[name])
        ax.set_xticks(x, labels, **ticks)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)

    # per-stage p50 / p99
    stages = [r for r in cmp.latency if r["A_p50"] is not None and r["B_p50"] is not None]
    if stages:
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        for ax, q in zip(axes, ("p50", "p99")):
            side_by_side(ax, [r["stage"] for r in stages], {n: [r[f"{n}_{q}"] for r in stages] for n in colors},
                         "ms", f"latency {q} per stage (ok answers)", rotation=20)
        save(fig, "latency_stages")
    # total latency distribution
    totals = {s.name: sorted(r["total_ms"] for r in s.rows.values() if r["status"] == "ok") for s in (cmp.a, cmp.b)}
    if all(totals.values()):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, v in totals.items():
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{name} (n={len(v)})", color=colors[name])
        ax.set_xlabel("total ms")
        ax.set_ylabel("fraction of answers")
        ax.set_title("total latency, cumulative")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "latency_cdf")
    # accuracy per category
    cats = [c for c in cmp.categories if c.get("A", {}).get("accuracy") is not None
            or c.get("B", {}).get("accuracy") is not None]
    if cats:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        side_by_side(
            ax,
            [c["category"] for c in cats],
            {n: [c.get(n, {}).get("accuracy") or 0 for c in cats] for n in colors},
            "accuracy",
            f"accuracy per question type ({cmp.rules} rules)",
        )
        ax.set_ylim(0, 1)
        save(fig, "accuracy_categories")
    # drives: p99 ratio
    drives = [d for d in cmp.drives if d["p99_ratio"] is not None][:30]
    if drives:
        fig, ax = plt.subplots(figsize=(6, max(2.4, 0.8 + 0.28 * len(drives))))
        y = np.arange(len(drives))[::-1]
        ax.barh(
            y,
            [d["p99_ratio"] for d in drives],
            color=["#a50e0e" if d["p99_ratio"] > (cmp.thresholds.max_p99_ratio or 1.10) else "#888" for d in drives],
        )
        ax.axvline(1.0, color="#222", lw=0.8)
        ax.set_yticks(y, [d["bag"] for d in drives], fontsize=8)
        ax.set_xlabel("p99 total, B / A")
        ax.set_title("drives by latency regression")
        save(fig, "drives")
    return made


# ------------------------------------------------------------------------------------ thumbnails
def _thumbnails(cmp: Comparison, changes: list[dict], out: Path) -> dict[tuple[str, str, int], str]:
    """(bag, camera, stamp) -> thumbnail path relative to the report, for the changes shown."""
    from PIL import Image


    topics = list(cmp.a.manifest.get("params", {}).get("camera_topics", []))
    camera_of = dict(zip(topics, CAMERAS))
    wanted: dict[str, set[tuple[str, int]]] = defaultdict(set)
    paths = {}
    for c in changes:
        for cam, stamp in (c.get("frame_stamps_ns") or {}).items():
            wanted[c["bag"]].add((cam, int(stamp)))
        paths[c["bag"]] = c["bag_path"]
    made: dict[tuple[str, str, int], str] = {}
    (out / "thumbs").mkdir(exist_ok=True)
    for bag, need in wanted.items():
        scratch = scratch_folder() if is_uri(paths[bag]) else None
        try:
            local = fetch_bag(paths[bag], scratch).path if scratch else paths[bag]      # a bag on object storage
            for _, topic, msgtype, raw, reader in read_bag(local, list(camera_of)):
                msg = reader.deserialize(raw, msgtype)
                cam = camera_of[topic]
                stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
                if (cam, stamp) not in need or (bag, cam, stamp) in made:
                    continue
                payload = payload_from_msg(msg)
                if isinstance(payload, CompressedPayload):
                    img = Image.open(io.BytesIO(bytes(payload.data)))
                    img.draft("RGB", (THUMB_WIDTH * 2, THUMB_WIDTH * 2))
                else:
                    img = Image.fromarray(raw_to_rgb(cam, payload))
                img = img.convert("RGB")
                img.thumbnail((THUMB_WIDTH, THUMB_WIDTH))
                name = f"thumbs/{bag}_{cam}_{stamp}.jpg"
                img.save(out / name, quality=85)
                made[(bag, cam, stamp)] = name
        except Exception:  # noqa: BLE001 - a bag gone or unreadable: the report says so per change
            continue
        finally:
            if scratch:
                remove_scratch(scratch)
    return made


def _pictures(cmp: Comparison, changes: list[dict], out: Path) -> dict[tuple[str, str], tuple]:
    """(bag, query id) -> (A's, B's) explanation picture path relative to the report (None: that run has
    none), for the changes shown whose runs stored pictures (fleet eval --explain)."""
    made = {}
    for c in changes:
        key = (c["bag"], c["query_id"])
        pair = []
        for side in (cmp.a, cmp.b):
            data = side.rows.get(key, {}).get("explanation_jpeg")
            name = None
            if data:
                name = f"explain/{c['bag']}_{c['query_id']}_{side.name}.jpg"
                (out / "explain").mkdir(exist_ok=True)
                (out / name).write_bytes(data)
            pair.append(name)
        if any(pair):
            made[key] = tuple(pair)
    return made


# ------------------------------------------------------------------------------------ html
def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{h}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{v}</td>' for i, v in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _side_meta(cmp: Comparison) -> str:
    rows = []
    for s in (cmp.a, cmp.b):
        m = s.manifest
        proj = m.get("project", {})
        rows.append(
            [
                f"<b>{s.name}</b>",
                _e(s.path),
                _e(m.get("model", {}).get("sha256", "")[:16]),
                _e(
                    f"{proj.get('version')} {(proj.get('git_commit') or '')[:10]}"
                    f"{' dirty' if proj.get('git_dirty') else ''}"
                ),
                str(len({k[0] for k in s.rows})),
                str(len(s.failures)),
                str(len(s.rows)),
                _e(", ".join(m.get("hosts", []))),
                _e(f"{m.get('started')} .. {m.get('finished')}"),
            ]
        )
    return _table(["run", "folder", "model sha256", "project", "bags", "failed", "answers", "hosts", "time"],
                  rows, left=9)


def _pictures_html(pair: tuple | None) -> str:
    if not pair:
        return ""
    figs = [f'<figure><a href="{_e(p)}"><img src="{_e(p)}" alt="{n} explanation"></a><figcaption>{n}: what the '
            f"answer was based on</figcaption></figure>" if p else f"<figure><figcaption>{n}: no picture (run without "
            "--explain)</figcaption></figure>" for n, p in zip("AB", pair)]
    return f'<div class="pics">{"".join(figs)}</div>'


def _change_html(c: dict, thumbs: dict, kind: str, pictures: dict | None = None) -> str:
    cams_a, cams_b = set(c.get("A_cameras") or []), set(c.get("B_cameras") or [])
    figs = []
    stamps = c.get("frame_stamps_ns") or {}
    for cam in CAMERAS:
        t = thumbs.get((c["bag"], cam, int(stamps[cam]))) if cam in stamps else None
        sel = (
            "selAB" if cam in cams_a and cam in cams_b else "selA" if cam in cams_a else "selB" if cam in cams_b else ""
        )
        mark = {"selAB": " (A, B)", "selA": " (A)", "selB": " (B)"}.get(sel, "")
        figs.append(
            f'<figure><img class="{sel}" src="{_e(t)}" alt="{cam}"><figcaption>{cam}{mark}</figcaption></figure>'
            if t
            else f"<figure><figcaption>{cam}{mark}: no image</figcaption></figure>"
        )
    # a verdict only where the rules scored the answer for accuracy (compare.py); else "changed"
    said = {n: ("right" if c.get(f"{n}_correct") else "wrong") for n in "AB" if c.get(f"{n}_correct") is not None}
    verdict = (" &nbsp; " + ", ".join(f"{n} {said[n]}" if n in said else f"{n} not scored" for n in "AB")
               if said else (" &nbsp; changed" if kind == "answer" else ""))
    a_label = f"A [{_e(c['A_status'])}]" if kind == "status" else "A"
    b_label = f"B [{_e(c['B_status'])}]" if kind == "status" else "B"
    return (f'<div class="change"><div><b>{_e(c["bag"])}</b> / {_e(c["query_id"])} '
            f'<span class="small">{_e(c.get("gt_category") or "")}{verdict}</span></div>'
            f'<div class="ans"><span class="k">question</span><span>{_e(c["question"])}</span>'
            f'<span class="k">{a_label}</span><span>{_e(c["A"])}</span>'
            f'<span class="k">{b_label}</span><span>{_e(c["B"])}</span>'
            + (f'<span class="k">reference</span><span>{_e(c["gt_answer"])}</span>' if c.get("gt_answer") else "")
            + "</div>" + (f'<div class="thumbs">{"".join(figs)}</div>' if stamps else "")
            + _pictures_html((pictures or {}).get((c["bag"], c["query_id"]))) + "</div>")


def write_report(cmp: Comparison, out: str | Path, thumbnails: bool = True, max_changes: int = 200) -> dict[str, str]:
    """The report in folder `out`; a URI (s3://...) gets the same files, made in a temporary folder
    and uploaded."""
    if is_uri(str(out)):
        target = locate(str(out))
        with tempfile.TemporaryDirectory(prefix="litevlm-report-") as tmp:
            write_report(cmp, tmp, thumbnails, max_changes)
            upload_tree(Path(tmp), target)
        return {"html": str(target.child("index.html")), "summary": str(target.child("summary.json"))}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = cmp.summary()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    plots = _plots(cmp, out)
    shown = cmp.changed[:max_changes]
    thumbs = _thumbnails(cmp, shown, out) if thumbnails and shown else {}
    pictures = _pictures(cmp, shown, out)
    t = cmp.thresholds
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fleet compare</title><style>{CSS}</style>"
             "</head><body>", "<h1>Fleet regression: A vs B</h1>", _side_meta(cmp)]
    if cmp.no_accuracy_scored:
        parts.append(f'<p class="note">Under the {_e(cmp.rules)} rules no answer was scored for accuracy: the '
                     "graph filter keeps none of the accuracy questions of these frames, so the accuracy cells are "
                     "\"-\" and changed answers are labelled <b>changed</b>, not right or wrong. "
                     "<code>fleet compare --lenient</code> scores every question.</p>")
    if cmp.lost_bags or cmp.only_a:
        parts.append(f'<p class="fail">B lost {len(cmp.lost_bags)} bag(s) and {len(cmp.only_a)} answer(s) that A '
                     "has" + "".join(f"<br>{_e(k)}: {_e(v)}" for k, v in sorted(cmp.lost_bags.items())) + "</p>")
    if cmp.violations:
        parts.append('<p class="fail">FAILED: ' + "<br>".join(_e(v) for v in cmp.violations) + "</p>")
    else:
        given = {k: v for k, v in t.__dict__.items() if v is not None}
        parts.append('<p class="pass">PASSED' + (f" ({_e(', '.join(f'{k} {v}' for k, v in given.items()))})"
                                                 if given else " (no thresholds given)") + "</p>")
    changed_frac = summary["changed_fraction"]
    parts.append(f"<p>{len(cmp.common)} answers matched by bag and query id; <b>{len(cmp.changed)}</b> answers "
                 f"changed, <b>{len(cmp.status_changes)}</b> status changes ({changed_frac:.1%}); "
                 f"{len(cmp.only_a)} only in A, {len(cmp.only_b)} only in B.</p>")
    as_given = [n for n, ok in cmp.params_resolved.items() if not ok]
    source = ("each run's effective values (the options its workers resolved)" if not as_given else
              f"parameters as given for {', '.join(as_given)} (its manifest has no resolved options)")
    if cmp.params:
        parts.append("<h2>What differs between the runs</h2>" + f'<p class="small">{_e(source)}</p>' + _table(
            ["parameter", "A", "B"], [[_e(p["name"]), _e(p["A"]), _e(p["B"])] for p in cmp.params], left=3))
    else:
        parts.append(f'<p class="small">No parameter differs ({_e(source)}).</p>')

    parts += _scores_html(cmp, plots)
    parts += _latency_html(cmp, plots)
    parts += _changes_html(cmp, shown, thumbs, pictures, max_changes)
    parts.append("</body></html>")
    (out / "index.html").write_text("\n".join(parts))
    return {"html": str(out / "index.html"), "summary": str(out / "summary.json")}


def _scores_html(cmp: Comparison, plots: dict) -> list[str]:
    """Overall scores, per question type and per closed-form template."""
    parts = []
    parts.append(f"<h2>Scores ({_e(cmp.rules)} rules)</h2>")
    sa, sb = cmp.scores.get("A", {}), cmp.scores.get("B", {})
    if sa.get("questions"):
        rows = []
        for key, label in (("accuracy", "accuracy"), ("language", "language"), ("match_f1", "match F1"),
                           ("final_renormalized", "final without GPT (renormalized)")):
            rows.append([label, _num(sa.get(key)), _num(sb.get(key)), _delta(sa.get(key), sb.get(key))])
        scored = (f" (scored under the challenge's graph filter: A {sa['scored']}, B {sb['scored']}; "
                  "--lenient scores every one)" if cmp.rules == "challenge" else "")
        parts.append(f"<p>{sa['questions']} questions with a DriveLM reference, the same for both runs{scored}.</p>")
        parts.append(_table(["score", "A", "B", "B - A"], rows))
        rows = []
        for c in cmp.categories:
            ca, cb = c.get("A", {}), c.get("B", {})
            rows.append([_e(c["category"]), str(ca.get("questions", 0)),
                         f"{_num(ca.get('accuracy'))} ({ca.get('accuracy_questions', 0)})",
                         f"{_num(cb.get('accuracy'))} ({cb.get('accuracy_questions', 0)})",
                         _delta(ca.get("accuracy"), cb.get("accuracy")),
                         f"{_num(ca.get('language'))} ({ca.get('language_questions', 0)})",
                         f"{_num(cb.get('language'))} ({cb.get('language_questions', 0)})",
                         _delta(ca.get("language"), cb.get("language"))])
        parts.append("<h3>Per question type</h3>" + _table(
            ["type", "questions", "accuracy A (n)", "accuracy B (n)", "B - A", "language A (n)", "language B (n)",
             "B - A"], rows))
        if "accuracy_categories" in plots:
            parts.append(f'<img class="plot" src="{plots["accuracy_categories"]}" alt="accuracy per type">')
        if cmp.templates:
            rows = [[_e(r["template"]), f"{r['questions'].get('A', 0)} / {r['questions'].get('B', 0)}",
                     _num(r["accuracy"].get("A")),
                     _num(r["accuracy"].get("B")), _delta(r["accuracy"].get("A"), r["accuracy"].get("B"))]
                    for r in cmp.templates if r["questions"].get("A") or r["questions"].get("B")][:15]
            parts.append("<h3>Closed-form accuracy per question template</h3>"
                         + _table(["template", "scored A / B", "A", "B", "B - A"], rows))
    else:
        parts.append("<p>No reference answers in these runs (fleet eval --ground-truth DIR adds DriveLM's).</p>")

    return parts


def _latency_html(cmp: Comparison, plots: dict) -> list[str]:
    """Per stage and per drive latency, with the p99 gate's cells marked."""
    t = cmp.thresholds
    parts = []
    parts.append("<h2>Latency (ms, ok answers)</h2>")
    parts.append(
        '<p class="small">Each answer\'s own stage times, as <code>bag eval</code> reports them. With the visual '
        "feature cache on, a frame set's cameras are encoded while the worker is idle after its first "
        "question (prefetch), outside any answer, so later questions show a vision stage near 0 ms.</p>"
    )
    rows = [[_e(r["stage"]), _num(r["A_p50"], 1), _num(r["B_p50"], 1), _ratio(r["p50_ratio"]),
             _num(r["A_p99"], 1), _num(r["B_p99"], 1),
             _ratio(r["p99_ratio"], t.max_p99_ratio if r["stage"] == cmp.stage else None), f"{r['A_n']} / {r['B_n']}"]
            for r in cmp.latency]
    parts.append(_table(["stage", "A p50", "B p50", "B/A", "A p99", "B p99", "B/A", "n A / B"], rows))
    for name in ("latency_stages", "latency_cdf"):
        if name in plots:
            parts.append(f'<img class="plot" src="{plots[name]}" alt="{name}"> ')
    if cmp.drives:
        rows = [[_e(d["bag"]), str(d["answers"]), _num(d["A_p50"], 1), _num(d["B_p50"], 1), _num(d["A_p99"], 1),
                 _num(d["B_p99"], 1), _ratio(d["p99_ratio"], t.max_p99_ratio)] for d in cmp.drives[:15]]
        parts.append("<h3>Drives where latency regressed most</h3>"
                     + _table(["bag", "answers", "A p50", "B p50", "A p99", "B p99", "p99 B/A"], rows))
        if "drives" in plots:
            parts.append(f'<img class="plot" src="{plots["drives"]}" alt="drives">')

    return parts


def _changes_html(cmp: Comparison, shown: list, thumbs: dict, pictures: dict, max_changes: int) -> list[str]:
    """Failed bags, status changes, then the changed answers with their thumbnails and pictures."""
    parts = []
    failed = [(s.name, k, f) for s in (cmp.a, cmp.b) for k, f in s.failures.items()]
    if failed:
        parts.append("<h2>Failed bags</h2>" + _table(
            ["run", "bag", "reason"], [[n, _e(k), _e(f.get("reason"))] for n, k, f in failed], left=3))
    parts.append(f"<h2>Status changes ({len(cmp.status_changes)})</h2>")
    parts.extend(_change_html(c, {}, "status") for c in cmp.status_changes[:max_changes])
    parts.append(f"<h2>Answers that changed ({len(cmp.changed)})</h2>")
    parts.append('<p class="small">Camera frames of the query; border: selected by A (blue), B (orange), both '
                 "(purple).</p>")
    if len(cmp.changed) > len(shown):
        parts.append(f"<p class='small'>The first {len(shown)} are shown; all are in summary.json.</p>")
    parts.extend(_change_html(c, thumbs, "answer", pictures) for c in shown)
    return parts
