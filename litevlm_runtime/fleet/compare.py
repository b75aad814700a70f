"""`litevlm fleet compare RUN_A RUN_B`: what changed between two fleet runs, and whether it passes.

Answers are matched by (bag key, query id). Scores use evaluation/ as `litevlm eval` does, the
challenge's rules by default (metrics.score: graph filter, exact-match accuracy, match F1,
pycocoevalcap language scores), over the questions that have a reference in both runs: each
bag's DriveLM key frame is its own frame for the graph filter, and an answer that is an error
(status not ok) is scored as the empty prediction, i.e. wrong. Per question type: the DriveLM
category (perception, prediction, planning, behavior) with accuracy and language scores, and
accuracy per question template (evaluation.breakdown).

Latency: per stage and total, p50 and p99 over each run's ok answers, and B / A. Drives: each
bag's p99 total in both runs, sorted by how much it regressed.

Right and wrong: a changed answer is called right or wrong only where the rules score it for
accuracy (a tag-0 question the graph filter keeps for that run); elsewhere it is "changed". Under
the challenge's rules a DriveLM file's graph filter can leave no question scored for accuracy at
all: the comparison then says so first (`no_accuracy_scored`), instead of showing "-" scores next
to verdicts no rule gave.

Parameters: each run's effective values, i.e. the options its workers resolved (manifest
`resolved_options`: every `auto` and 0-means-default replaced, tokens.keep_ratio 0 -> 0.8),
over the node parameters as given; a run made before manifests kept them shows its parameters
as given, and the comparison says so.

Gates (exit 1 when crossed): B losing bags or answers that A has (a bag failed or missing in B, an
answer of A with no match in B: on by default, `--allow-lost` turns it off), accuracy or language
score dropping by more than a given amount, the p99 ratio of a stage (total by default) above a
given value, the fraction of answers changed, the number of failed bags. A gate that cannot be
evaluated (no reference answers for an accuracy gate) counts as crossed: a release gate that
silently passes on missing data would gate nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..evaluation.breakdown import accuracy_by_template
from ..evaluation.metrics import (
    ACCURACY,
    CHALLENGE,
    LANGUAGE,
    LENIENT,
    Question,
    answer_is_correct,
    combine_language,
    graph_filter,
    language_metrics,
    score,
)
from ..pipeline.answer import STAGES
from .dataset import open_run

LATENCY_KEYS = (*STAGES, "total")


@dataclass
class Thresholds:
    max_accuracy_drop: float | None = None
    max_p99_ratio: float | None = None
    max_language_drop: float | None = None
    max_changed: float | None = None
    max_failed: int | None = None
    allow_lost: bool = False              # B may lose bags/answers A has without failing the gate


@dataclass
class Side:
    name: str                     # "A" or "B"
    path: str                     # the run folder or URI
    manifest: dict
    rows: dict[tuple[str, str], dict]      # (bag, query id) -> row
    failures: dict[str, dict]              # bag key -> failure info


def _latency(rows: list[dict], key: str) -> list[float]:
    col = "total_ms" if key == "total" else f"ms_{key}"
    return [r[col] for r in rows if r["status"] == "ok" and r.get(col) is not None]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def param_changes(a: dict, b: dict) -> list[dict]:
    keys = sorted(set(a) | set(b))
    return [{"name": k, "A": a.get(k), "B": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def effective_params(manifest: dict) -> tuple[dict, bool]:
    """(what the run ran with, whether that is its resolved options): the node parameters as
    given, with the pipeline options replaced by those its workers resolved."""
    params, resolved = manifest.get("params", {}), manifest.get("resolved_options")
    if not resolved:
        return dict(params), False
    return {**{k: v for k, v in params.items() if k not in resolved}, **resolved}, True


def load_side(name: str, path: str | Path) -> Side:
    run, manifest = open_run(path)
    rows = {}
    for r in run.read_rows():
        key = (r["bag"], r["query_id"])
        if key in rows:         # a bag's partition is written once; a repeated id is the bag's own
            raise InputError(f"{path}: bag {r['bag']} has query id {r['query_id']!r} twice")
        rows[key] = r
    return Side(name, run.path, manifest, rows, run.failures())


def _questions(common: list[tuple[str, str]], a: Side) -> list[Question]:
    """The references of the common answers that have one, in the challenge's order per frame."""
    with_gt = [k for k in common if a.rows[k]["gt_question_id"] is not None]
    with_gt.sort(key=lambda k: (k[0], a.rows[k]["gt_frame"], a.rows[k]["gt_index"], k[1]))
    return [Question(f"{k[0]}:{k[1]}", f"{k[0]}:{a.rows[k]['gt_frame']}", a.rows[k]["question"],
                     a.rows[k]["gt_answer"], tuple(a.rows[k]["gt_tags"] or ()), a.rows[k]["gt_category"] or "")
            for k in with_gt]


def _predictions(side: Side, questions: list[Question]) -> dict[str, str]:
    out = {}
    for q in questions:
        bag, qid = q.id.split(":", 1)
        r = side.rows[(bag, qid)]
        out[q.id] = r["answer"] if r["status"] == "ok" else ""      # an error answer is a wrong answer
    return out


def _language(items: list[tuple[Question, str]]) -> float | None:
    if not items:
        return None
    try:
        return combine_language(language_metrics([p for _, p in items], [q.answer for q, _ in items]))
    except (OSError, RuntimeError, FileNotFoundError) as exc:      # no Java for the PTB tokenizer
        raise InputError(f"language scores need Java for pycocoevalcap's PTB tokenizer: {exc}") from None


@dataclass
class Comparison:
    a: Side
    b: Side
    rules: str
    stage: str
    thresholds: Thresholds
    common: list[tuple[str, str]] = field(default_factory=list)
    only_a: list[tuple[str, str]] = field(default_factory=list)
    only_b: list[tuple[str, str]] = field(default_factory=list)
    lost_bags: dict[str, str] = field(default_factory=dict)      # bag complete in A, not in B -> why
    params_resolved: dict = field(default_factory=dict)          # "A"/"B" -> effective values known
    no_accuracy_scored: bool = False      # references exist but the rules scored no answer for accuracy
    scores: dict = field(default_factory=dict)           # "A"/"B" -> overall scores
    categories: list[dict] = field(default_factory=list)
    templates: list[dict] = field(default_factory=list)
    changed: list[dict] = field(default_factory=list)
    status_changes: list[dict] = field(default_factory=list)
    latency: list[dict] = field(default_factory=list)
    drives: list[dict] = field(default_factory=list)
    params: list[dict] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def latency_row(self, stage: str) -> dict | None:
        return next((r for r in self.latency if r["stage"] == stage), None)

    def summary(self) -> dict:
        def side(s: Side) -> dict:
            return {"run": str(s.path), "model_sha256": s.manifest.get("model", {}).get("sha256"),
                    "project": s.manifest.get("project"), "answers": len(s.rows),
                    "bags_complete": len({k[0] for k in s.rows}), "bags_failed": s.failures}
        return {
            "A": side(self.a), "B": side(self.b), "rules": self.rules,
            "parameter_changes": self.params, "parameters_are_resolved": self.params_resolved,
            "matched_answers": len(self.common), "only_in_A": [list(k) for k in self.only_a],
            "only_in_B": [list(k) for k in self.only_b], "lost_bags": self.lost_bags,
            "lost_answers": len(self.only_a), "no_accuracy_scored": self.no_accuracy_scored,
            "scores": self.scores, "categories": self.categories, "templates": self.templates,
            "changed_answers": self.changed, "status_changes": self.status_changes,
            "changed_fraction": (len(self.changed) + len(self.status_changes)) / max(1, len(self.common)),
            "latency": self.latency, "drives": self.drives,
            "thresholds": self.thresholds.__dict__, "latency_gate_stage": self.stage,
            "violations": self.violations, "passed": not self.violations,
        }

    def text_summary(self) -> str:
        lines = [f"fleet compare: A {self.a.path} ({len(self.a.rows)} answers), B {self.b.path} "
                 f"({len(self.b.rows)} answers): {len(self.common)} matched, {len(self.changed)} answers changed, "
                 f"{len(self.status_changes)} status changes"]
        if self.no_accuracy_scored:
            lines.append(f"  NOTE: under the {self.rules} rules no answer was scored for accuracy (the graph filter "
                         "keeps none of the accuracy questions): changed answers are only 'changed', not right or "
                         "wrong; --lenient scores every question")
        if self.lost_bags or self.only_a:
            lines.append(f"  B LOST {len(self.lost_bags)} bag(s) and {len(self.only_a)} answer(s) that A has")
            for bag, why in sorted(self.lost_bags.items()):
                lines.append(f"    lost bag {bag}: {why}")
        for side in (self.a, self.b):
            for key, info in sorted(side.failures.items()):
                if key not in self.lost_bags:
                    lines.append(f"  failed in {side.name}: {key}: {info.get('reason')}")
        if not all(self.params_resolved.values()):
            lines.append("  parameters as given (" + ", ".join(n for n, ok in self.params_resolved.items() if not ok)
                         + " has no resolved options in its manifest: made before they were recorded)")
        for p in self.params:
            lines.append(f"  parameter {p['name']}: {p['A']!r} -> {p['B']!r}")
        sa, sb = self.scores.get("A", {}), self.scores.get("B", {})
        if sa.get("questions"):
            lines.append(f"  {sa['questions']} questions with a reference ({self.rules} rules): "
                         f"accuracy {_fmt(sa.get('accuracy'))} -> {_fmt(sb.get('accuracy'))}, "
                         f"language {_fmt(sa.get('language'))} -> {_fmt(sb.get('language'))}")
        else:
            lines.append("  no reference answers (run fleet eval with --ground-truth): no scores")
        row = self.latency_row("total")
        if row and row["A_p99"] is not None:
            lines.append(f"  total latency p50 {row['A_p50']:.1f} -> {row['B_p50']:.1f} ms, p99 {row['A_p99']:.1f} -> "
                         f"{row['B_p99']:.1f} ms ({row['p99_ratio']:.2f}x)")
        lines.append("  gates: " + ("passed" if not self.violations else f"{len(self.violations)} crossed"))
        return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def compare_runs(run_a: str | Path, run_b: str | Path, thresholds: Thresholds | None = None, lenient: bool = False,
                 stage: str = "total") -> Comparison:
    if stage not in LATENCY_KEYS:
        raise InputError(f"--latency-stage {stage!r}: one of {', '.join(LATENCY_KEYS)}")
    a, b = load_side("A", run_a), load_side("B", run_b)
    rules = LENIENT if lenient else CHALLENGE
    cmp = Comparison(a, b, rules.name, stage, thresholds or Thresholds())
    (eff_a, res_a), (eff_b, res_b) = effective_params(a.manifest), effective_params(b.manifest)
    cmp.params_resolved = {"A": res_a, "B": res_b}
    cmp.params = param_changes(eff_a, eff_b)
    if a.manifest.get("model", {}).get("sha256") != b.manifest.get("model", {}).get("sha256"):
        cmp.params.insert(0, {"name": "model (folder checksum)", "A": a.manifest["model"].get("sha256", "")[:16],
                              "B": b.manifest["model"].get("sha256", "")[:16]})
    cmp.common = [k for k in a.rows if k in b.rows]
    cmp.only_a = sorted(k for k in a.rows if k not in b.rows)
    cmp.only_b = sorted(k for k in b.rows if k not in a.rows)
    bags_b = {k[0] for k in b.rows}
    for bag in sorted({k[0] for k in a.rows} - bags_b):
        failure = b.failures.get(bag)
        cmp.lost_bags[bag] = (f"failed in B: {failure.get('reason')}" if failure else
                              "not in B (not in its plan, or its run did not finish)")

    questions = _questions(cmp.common, a)
    _changes(cmp, a, b, questions, rules)
    _scores(cmp, a, b, questions, rules)
    _latency_tables(cmp, a, b)
    _gates(cmp, b, stage)
    return cmp


def _changes(cmp: Comparison, a, b, questions: list, rules) -> None:
    """The answers and statuses that changed between the runs, each verdict where the rules score
    that answer for accuracy (cmp.changed, cmp.status_changes, cmp.no_accuracy_scored)."""
    # which answers the rules score for accuracy, per run (a verdict only for those)
    judged: dict[str, set[str]] = {}
    for side in (a, b):
        scored, _ = graph_filter(questions, _predictions(side, questions), rules) if questions else ([], [])
        judged[side.name] = {q.id for q in scored if ACCURACY in q.tags}
    cmp.no_accuracy_scored = bool(questions) and not judged["A"] and not judged["B"]

    def verdict(side: str, k: tuple[str, str], answer: str, reference: str | None) -> bool | None:
        if reference is None or f"{k[0]}:{k[1]}" not in judged[side]:
            return None
        return answer_is_correct(answer, reference, rules)

    for k in cmp.common:
        ra, rb = a.rows[k], b.rows[k]
        base = {"bag": k[0], "query_id": k[1], "question": ra["question"], "bag_path": ra["bag_path"],
                "gt_answer": ra["gt_answer"], "gt_category": ra["gt_category"]}
        if ra["status"] != rb["status"]:
            cmp.status_changes.append(base | {"A_status": ra["status"], "B_status": rb["status"],
                                              "A": ra["answer"] or ra["status_message"],
                                              "B": rb["answer"] or rb["status_message"]})
        elif ra["status"] == "ok" and (ra["answer"] != rb["answer"] or ra["token_ids"] != rb["token_ids"]):
            cmp.changed.append(base | {
                "A": ra["answer"], "B": rb["answer"], "A_cameras": ra["cameras"], "B_cameras": rb["cameras"],
                "frame_stamps_ns": ra["frame_stamps_ns"],
                "A_correct": verdict("A", k, ra["answer"], ra["gt_answer"]),
                "B_correct": verdict("B", k, rb["answer"], ra["gt_answer"])})



def _scores(cmp: Comparison, a, b, questions: list, rules) -> None:
    """Scores where references exist, the same questions for both runs: overall, per category and
    per template (cmp.scores, cmp.categories, cmp.templates)."""
    categories = sorted({q.category for q in questions})
    per_cat: dict[str, dict] = {c: {"category": c} for c in categories}
    for side in (a, b):
        preds = _predictions(side, questions)
        if not questions:
            cmp.scores[side.name] = {"questions": 0}
            continue
        s = score(questions, preds, rules=rules)
        cmp.scores[side.name] = {
            "questions": len(questions), "scored": s.counts["scored"], "accuracy": s.accuracy,
            "accuracy_questions": s.counts["accuracy"],
            "language": s.language["score"] if s.language else None, "language_questions": s.counts["language"],
            "match_f1": s.match["f1"] if s.match else None,
            "final_without_gpt": s.final["without_gpt"], "final_renormalized": s.final["renormalized"],
            "skipped_by_graph": s.skipped_by_graph}
        scored, _ = graph_filter(questions, preds, rules)
        for c in categories:
            items = [(q, preds[q.id]) for q in scored if q.category == c]
            acc = s.per_category.get(c, {})
            per_cat[c][side.name] = {
                "questions": sum(q.category == c for q in questions), "scored": len(items),
                "accuracy": acc.get("accuracy"), "accuracy_questions": acc.get("accuracy_questions", 0),
                "language": _language([(q, p) for q, p in items if LANGUAGE in q.tags]),
                "language_questions": sum(LANGUAGE in q.tags for q, _ in items)}
    cmp.categories = list(per_cat.values())
    if questions:
        cmp.templates = accuracy_by_template(questions, {"A": _predictions(a, questions),
                                                         "B": _predictions(b, questions)}, rules)



def _latency_tables(cmp: Comparison, a, b) -> None:
    """Per stage p50/p99 of both runs and their ratios, and per drive (cmp.latency, cmp.drives:
    the worst p99 ratio first)."""
    rows_a, rows_b = list(a.rows.values()), list(b.rows.values())
    for key in LATENCY_KEYS:
        va, vb = _latency(rows_a, key), _latency(rows_b, key)
        row = {"stage": key, "A_n": len(va), "B_n": len(vb), "A_p50": _pct(va, 50), "B_p50": _pct(vb, 50),
               "A_p99": _pct(va, 99), "B_p99": _pct(vb, 99)}
        row["p50_ratio"], row["p99_ratio"] = _ratio(row["B_p50"], row["A_p50"]), _ratio(row["B_p99"], row["A_p99"])
        cmp.latency.append(row)
    by_bag: dict[str, dict[str, list]] = defaultdict(lambda: {"A": [], "B": []})
    for side in (a, b):
        for (bag, _), r in side.rows.items():
            if r["status"] == "ok":
                by_bag[bag][side.name].append(r["total_ms"])
    bag_paths = {k[0]: r["bag_path"] for k, r in a.rows.items()}
    for bag, v in by_bag.items():
        if v["A"] and v["B"]:
            a99, b99 = _pct(v["A"], 99), _pct(v["B"], 99)
            cmp.drives.append({"bag": bag, "bag_path": bag_paths[bag],
                               "answers": len(v["B"]), "A_p50": _pct(v["A"], 50), "B_p50": _pct(v["B"], 50),
                               "A_p99": a99, "B_p99": b99, "p99_ratio": _ratio(b99, a99)})
    cmp.drives.sort(key=lambda d: -(d["p99_ratio"] or 0))



def _gates(cmp: Comparison, b, stage: str) -> None:
    """The thresholds the user set, each broken one as a sentence in cmp.violations."""
    t = cmp.thresholds
    if (cmp.lost_bags or cmp.only_a) and not t.allow_lost:
        cmp.violations.append(f"B lost {len(cmp.lost_bags)} bag(s) and {len(cmp.only_a)} answer(s) that A has "
                              f"({', '.join(sorted(cmp.lost_bags)[:5]) or 'answers only'}): --allow-lost to accept")
    sa, sb = cmp.scores.get("A", {}), cmp.scores.get("B", {})
    for metric, limit in (("accuracy", t.max_accuracy_drop), ("language", t.max_language_drop)):
        if limit is None:
            continue
        if sa.get(metric) is None or sb.get(metric) is None:
            why = ("no reference answers (fleet eval --ground-truth)" if not sa.get("questions") else
                   f"no question scored for {metric} (under the challenge's graph filter a DriveLM training file "
                   "skips every later question of a frame: --lenient)")
            cmp.violations.append(f"{metric} drop cannot be checked: {why}")
        elif sa[metric] - sb[metric] > limit:
            cmp.violations.append(f"{metric} dropped by {sa[metric] - sb[metric]:.4f} ({sa[metric]:.4f} -> "
                                  f"{sb[metric]:.4f}), more than --max-{metric}-drop {limit}")
    if t.max_p99_ratio is not None:
        row = cmp.latency_row(stage)
        if row is None or row["p99_ratio"] is None:
            cmp.violations.append(f"p99 ratio of {stage} cannot be checked: no ok answers in one of the runs")
        elif row["p99_ratio"] > t.max_p99_ratio:
            cmp.violations.append(f"{stage} p99 {row['A_p99']:.1f} -> {row['B_p99']:.1f} ms = "
                                  f"{row['p99_ratio']:.3f}x, more than --max-p99-ratio {t.max_p99_ratio}")
    if t.max_changed is not None:
        frac = (len(cmp.changed) + len(cmp.status_changes)) / max(1, len(cmp.common))
        if frac > t.max_changed:
            cmp.violations.append(f"{frac:.3f} of the matched answers changed, more than --max-changed {t.max_changed}")
    if t.max_failed is not None and len(b.failures) > t.max_failed:
        cmp.violations.append(f"{len(b.failures)} bag(s) failed in B, more than --max-failed {t.max_failed}")
