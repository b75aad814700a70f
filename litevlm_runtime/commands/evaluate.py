"""`litevlm eval`: DriveLM-challenge scores of a model (or of a predictions file) on a QA file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError
from ..report import table


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="score a model the way the DriveLM challenge does")
    from ..options import add_option_flags

    p.add_argument("--model", help="model folder (InternVL2.5 layout); not needed with --from-predictions")
    p.add_argument("--data", required=True, help="DriveLM v1.1 QA file (SynthDrive val.json, DriveLM json)")
    p.add_argument("--frames", help="root the QA file's image paths resolve under (default: the QA file's folder)")
    add_option_flags(p, with_model=False)     # --pipeline baseline, --decoding.mode eagle, --backend.threads 1, ...
    p.add_argument("--blank-images", action="store_true",
                   help="replace every image by constant grey: the text-only baseline")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--accuracy-only", action="store_true",
                   help="answer only the questions that can count for accuracy (closed-form, and each key "
                        "frame's first: it sets the frame's graph under the challenge's rules): the same accuracy "
                        "in less than half the time; the other metrics then cover those questions only")
    p.add_argument("--predictions", help="write per-question answers (challenge output.json fields + latency) here")
    p.add_argument("--from-predictions", help="score this predictions file instead of running a model")
    p.add_argument("--judge", help="GPT-score judge as module:attribute (see litevlm_runtime/evaluation/judge.py)")
    p.add_argument("--match-threshold", type=float, default=16.0, help="match radius, L1 pixels (challenge: 16)")
    p.add_argument("--lenient", action="store_true",
                   help="the project's friendlier scoring instead of the challenge's evaluation.py rules (the "
                        "default): every question scored (no per-frame graph filter), answers compared after "
                        "stripping whitespace, coordinates read only from <cN,CAM_X,x,y> tags (integers and "
                        "negatives included, other numbers ignored); see evaluation/metrics.py")
    p.add_argument("--graph-filter", action="store_true",
                   help="deprecated: the challenge's per-frame graph filter is now part of the default rules")
    p.add_argument("--by-question", action="store_true",
                   help="also report choice/yes-no accuracy per question template (evaluation/breakdown.py), "
                        "over the questions the chosen rules score")
    p.add_argument("--versus", action="append", default=[], metavar="NAME=PREDICTIONS.json",
                   help="with --by-question: add a column for another run's predictions on the same questions "
                        "(e.g. blanked=blank_pred.json); repeatable")
    p.add_argument("--constrain", action="store_true",
                   help="also answer every closed-form question (options A-D, yes/no) constrained to its choices "
                        "(derived from the question) and report accuracy and valid answers with and without")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=PREDICTIONS.json",
                   help="compare runs' predictions on the same questions (the first is the reference): accuracy "
                        "with its 95%% Wilson interval, the difference with a 95%% paired bootstrap over key frames, "
                        "identical answers (evaluation/compare.py); repeatable, no model run")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..evaluation.judge import load_judge
    from ..evaluation.metrics import score

    rules = checked_rules(args)
    if args.compare:
        return compare(args, rules)
    judge = load_judge(args.judge) if args.judge else None
    records, predictions, questions, arena = answers(args, rules)
    scores = score(questions, predictions, judge, args.match_threshold, rules).to_dict()
    by_template = None
    if args.by_question or args.versus:
        from ..evaluation.breakdown import accuracy_by_template
        runs = {"this run": predictions} | named_predictions(args.versus, questions, "--versus")
        by_template = accuracy_by_template(questions, runs, rules, args.match_threshold)
    run_info = describe_run(args, records, questions, arena)
    if args.json:
        print(json.dumps({"run": run_info, "scores": scores} | ({"by_template": by_template} if by_template else {}),
                         indent=1))
    else:
        print(report(run_info, scores))
        if by_template:
            print(template_table(by_template))
    if records is not None and run_info["errors"]:
        print(f"litevlm eval: {run_info['errors']} question(s) were rejected by the pipeline "
              f"(empty answers, scored as wrong; see --predictions for messages)", file=sys.stderr)
    return 0


def checked_rules(args) -> dict:
    """The scoring rules the flags ask for, after refusing flags that contradict each other."""
    from ..evaluation.metrics import CHALLENGE, LENIENT

    if args.limit is not None and args.limit < 1:
        raise InputError("--limit must be at least 1")
    if args.graph_filter and args.lenient:
        raise InputError("--graph-filter contradicts --lenient (lenient rules score every question); "
                         "the graph filter is part of the default, challenge rules")
    if args.graph_filter:
        print("litevlm eval: --graph-filter is deprecated: the challenge's graph filter is now the default "
              "(--lenient turns it off)", file=sys.stderr)
    return LENIENT if args.lenient else CHALLENGE


def answers(args, rules) -> tuple[list[dict] | None, dict[str, str], list, dict]:
    """(records of the model's run or None, predictions id -> answer, the questions asked, the
    arena's bytes): the model run over the data, or the --from-predictions file checked to answer
    every question."""
    from ..evaluation.data import load_frames
    from ..evaluation.runner import EvalPlan, read_predictions, run_model, select
    from ..options import options_from_args

    def asked():
        return [q for _, qs in select(load_frames(args.data), args.limit, args.accuracy_only) for q in qs]

    if args.from_predictions:
        predictions = read_predictions(args.from_predictions)
        questions = asked()
        missing = [q.id for q in questions if q.id not in predictions]
        if missing:
            raise InputError(f"{args.from_predictions}: no answer for {len(missing)} question(s), e.g. {missing[0]}")
        return None, predictions, questions, {}
    if not args.model:
        raise InputError("--model is required (or score a file with --from-predictions)")
    frames_root = args.frames or str(Path(args.data).parent)
    arena: dict = {}
    plan = EvalPlan(blank_images=args.blank_images, limit=args.limit, accuracy_only=args.accuracy_only)
    records = run_model(args.model, args.data, frames_root, options_from_args(args), plan,
                        progress=not args.quiet, info=arena)
    predictions = {r["id"]: r["answer"] for r in records}
    questions = asked()
    if args.constrain:
        constrained = run_model(args.model, args.data, frames_root, options_from_args(args),
                                EvalPlan(blank_images=args.blank_images, limit=args.limit, constrain=True),
                                progress=not args.quiet)
        print(constrain_table(questions, records, constrained, rules, args.match_threshold))
    if args.predictions:
        Path(args.predictions).write_text(json.dumps(records, indent=1))
    return records, predictions, questions, arena


def describe_run(args, records: list[dict] | None, questions: list, arena: dict) -> dict:
    """The run's line of the report: data, model, what served (as the answers say), errors, means."""
    pipeline = None
    if records is not None:
        served = {r.get("pipeline") for r in records if "error" not in r}
        pipeline = ", ".join(sorted(p for p in served if p)) or None      # what served, as the answers say
    run_info = {"data": args.data, "model": args.model, "pipeline": pipeline,
                "images": "blank" if args.blank_images else "real", "questions": len(questions)}
    if records is not None:
        answered = [r for r in records if "error" not in r]
        run_info["errors"] = len(records) - len(answered)
        if answered:
            run_info["mean_total_ms"] = sum(r["total_ms"] for r in answered) / len(answered)
            run_info["mean_cameras"] = sum(len(r["cameras"]) for r in answered) / len(answered)
        run_info["arena"] = arena
    return run_info


def named_predictions(items: list[str], questions, flag: str) -> dict[str, dict[str, str]]:
    """NAME=PREDICTIONS.json items -> {name: predictions}, each answering every question."""
    from ..evaluation.runner import read_predictions

    runs = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"{flag} {item!r}: expected NAME=PREDICTIONS.json")
        preds = read_predictions(path)
        missing = [q.id for q in questions if q.id not in preds]
        if missing:
            raise InputError(f"{flag} {path}: no answer for {len(missing)} question(s), e.g. {missing[0]}")
        runs[name] = preds
    return runs


def compare(args, rules) -> int:
    """`--compare NAME=P.json ...`: the runs' accuracy side by side with intervals (compare.py)."""
    from ..evaluation.compare import COMPARISON_HEADER, compare_runs, comparison_rows
    from ..evaluation.data import load_frames
    from ..evaluation.runner import select

    questions = [q for _, qs in select(load_frames(args.data), args.limit, args.accuracy_only) for q in qs]
    runs = named_predictions(args.compare, questions, "--compare")
    scores = compare_runs(questions, runs, rules)
    # The same comparison per question category (a DriveLM section, or motion: questions that need time).
    by_category = {c: compare_runs(questions, runs, rules, category=c) for c in sorted({q.category for q in questions})}

    def fields(s):      # a category without closed-form questions has no accuracy: null, not NaN (not JSON)
        if not s.scored:
            return s.__dict__ | {"accuracy": None, "interval": None}
        return s.__dict__ | {"accuracy": s.accuracy, "interval": s.interval}
    if args.json:
        print(json.dumps([fields(s) | {"by_category": {c: fields(per[i]) for c, per in by_category.items()}}
                          for i, s in enumerate(scores)], indent=1))
        return 0
    print(f"{len(questions)} questions of {args.data}; " + rules_line({"name": rules.name, "match_threshold": 16.0}))
    print(table(COMPARISON_HEADER, comparison_rows(scores)))
    for c, per in by_category.items():
        print(f"\ncategory {c}:")
        print(table(COMPARISON_HEADER, comparison_rows(per)))
    return 0


def constrain_table(questions, free: list[dict], constrained: list[dict], rules, match_threshold: float) -> str:
    """Closed-form questions (scored by accuracy) answered without and with their choices: how
    many got choices derived, how many answers are one of them, and the accuracy of each run."""
    from ..evaluation.choices import closed_form_choices
    from ..evaluation.metrics import ACCURACY, score

    closed = [q for q in questions if ACCURACY in q.tags]
    by_id = {"without": {r["id"]: r["answer"] for r in free}, "with": {r["id"]: r["answer"] for r in constrained}}
    lines = [f"constrained answers: {len(closed)} closed-form questions (scored by accuracy), "
             f"{sum(1 for q in closed if closed_form_choices(q.question))} with choices derived from the question",
             f"{'run':<10}{'valid choice':>14}{'accuracy':>10}"]
    for name, pred in by_id.items():
        valid = sum(1 for q in closed if (c := closed_form_choices(q.question)) and pred[q.id] in c)
        acc = score(closed, pred, None, match_threshold, rules).accuracy if closed else None
        lines.append(f"{name:<10}{f'{valid}/{len(closed)}':>14}{(f'{acc:.3f}' if acc is not None else 'n/a'):>10}")
    return "\n".join(lines)


def report(run_info: dict, s: dict) -> str:
    na = "n/a"
    c = s["counts"]
    exact = "exact match" if s["rules"]["exact_answers"] else "match after strip()"
    rows = [[f"accuracy ({exact})", s["accuracy"] if s["accuracy"] is not None else na, c["accuracy"]]]
    lang = s["language"]
    rows.append(["language score", lang["score"] if lang else na, c["language"]])
    if lang:
        rows += [[f"  {k}", lang[k], ""] for k in ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr")]
    m = s["match"]
    rows.append(
        ["match score" + (" (F1 only)" if m and m["judge"] is None else ""), m["score"] if m else na, c["match"]]
    )
    gpt = s["gpt"]
    rows.append(["GPT score", gpt["score"] if gpt["available"] else "unavailable", c["gpt"]])
    f = s["final"]
    rows.append(["final, without GPT term (max 0.6)", f["without_gpt"], ""])
    rows.append(
        [
            "final, renormalized (/%.1f)" % (0.2 * len(f["terms_used"])),
            f["renormalized"] if f["renormalized"] is not None else na,
            "",
        ]
    )
    rows.append(["final, with GPT (challenge)", f["with_gpt"] if f["with_gpt"] is not None else na, ""])
    head = (f"DriveLM evaluation of {run_info['model'] or 'predictions'} on {run_info['data']}: "
            f"{run_info['questions']} questions, pipeline {run_info['pipeline']}, images {run_info['images']}")
    lines = [head, rules_line(s["rules"]), table(["metric", "value", "questions"], rows, floatfmt="{:.4f}")]
    if not gpt["available"]:
        lines.append(f"GPT score unavailable: {gpt['note']} (plug one in with --judge module:attr)")
    if s["final"]["terms_missing"]:
        lines.append(f"terms missing from the final score: {', '.join(s['final']['terms_missing'])}")
    if lang and lang["texts_split_by_tokenizer"]:
        lines.append(f"{lang['texts_split_by_tokenizer']} language text(s) hold a line break other than \\n "
                     f"(\\r, \\v, \\f, U+2028/9): the PTB tokenizer splits them and shifts every later answer "
                     f"against the wrong reference, as in the challenge's script")
    if s["rules"]["graph_filter"]:
        lines.append(f"graph filter: {c['scored']} of {c['questions']} questions scored, "
                     f"{s['skipped_by_graph']} skipped (they name objects the frame's first answer missed)")
        if s["frames_without_graph"]:
            lines.append(f"  {s['frames_without_graph']} frame(s) begin with a question whose reference names no "
                         f"coordinates, so every later question naming an object there is skipped (the challenge's "
                         f"test file begins each frame with 'What are the important objects...'; --lenient scores all)")
    per = [[cat, v["questions"], v["skipped_by_graph"], v["accuracy_questions"],
            v["accuracy"] if v["accuracy"] is not None else na] for cat, v in s["by_category"].items()]
    lines.append(table(["category", "scored", "skipped", "choice+yes/no", "accuracy"], per, floatfmt="{:.4f}"))
    if "mean_total_ms" in run_info:
        lines.append(f"mean latency {run_info['mean_total_ms']:.1f} ms per answer, "
                     f"{run_info['mean_cameras']:.2f} cameras per question, {run_info['errors']} rejected")
    if run_info.get("arena"):
        a = run_info["arena"]
        lines.append(f"arena {a['arena_bytes'] / 2**20:.1f} MiB, of which KV caches {a['kv_bytes'] / 2**20:.1f} MiB "
                     f"(arena.kv_dtype {a['kv_dtype']}: batch regions, conversation turns, prompt prefix, draft)")
    return "\n".join(lines)


def rules_line(rules: dict) -> str:
    if rules["name"] == "challenge":
        text = (
            "rules: the DriveLM challenge's evaluation.py (graph filter, exact answers, every d.d number a coordinate)"
        )
    else:
        text = "rules: lenient (--lenient: every question, answers stripped, coordinates from <cN,CAM,x,y> tags only)"
    from ..evaluation.metrics import MATCH_THRESHOLD_PX
    if rules["match_threshold"] != MATCH_THRESHOLD_PX:
        text += f"; match radius {rules['match_threshold']:g} px (challenge: 16)"
    return text


def template_table(rows: list[dict]) -> str:
    """Per-template accuracy, one question count and one accuracy column per run."""
    names = list(rows[0]["accuracy"])
    headers = ["question template"] + [h for n in names for h in (f"QA {n}" if len(names) > 1 else "QA", n)]
    cells = [[r["template"]] + [c for n in names for c in (r["questions"][n], r["accuracy"][n]
                                                            if r["accuracy"][n] is not None else "n/a")]
             for r in rows]
    return table(headers, cells, floatfmt="{:.3f}")
