"""The soak and peak harness's statistics: what a run sent and received, and the tables made of it
(latency percentiles, lost and duplicated answers, RSS growth, determinism, the peak-rate
bisection's trials and the comparison of configurations)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..pipeline.answer import STAGES
from ..timing import percentile


def percentiles(values, qs=(50, 90, 99)) -> tuple[float, ...]:
    return tuple(percentile(values, q) for q in qs)


def frame_set_of(row: dict, set_of_stamp: dict[int, int]) -> int:
    """The workload frame set an answer was given on (by its CAM_FRONT stamp as published), -1 if
    none the harness published."""
    return set_of_stamp.get(row["frame_stamps_ns"].get("CAM_FRONT", -1), -1)


# --------------------------------------------------------------------------------------------
# Soak
@dataclass
class SoakResult:
    rate: float
    sent: list[tuple[str, str]]                  # (query id, question) in order
    rows: list[dict]                             # every answer received
    set_of_stamp: dict[int, int]                 # CAM_FRONT stamp -> frame set index
    rss: list[tuple[int, int]]                   # (queries sent so far, RSS bytes)
    warmup: int
    duration_s: float
    pipeline: str = ""
    warmup_ids: frozenset = None         # default: the first `warmup` of `sent` (pooled runs: each run's)

    def __post_init__(self):
        if self.warmup_ids is None:
            self.warmup_ids = frozenset(qid for qid, _ in self.sent[:self.warmup])

    # ---- accounting
    @property
    def by_id(self) -> dict[str, list[dict]]:
        d = defaultdict(list)
        for r in self.rows:
            d[r["query_id"]].append(r)
        return d

    @property
    def lost(self) -> list[str]:
        got = self.by_id
        return [qid for qid, _ in self.sent if qid not in got]

    @property
    def duplicated(self) -> list[str]:
        return [qid for qid, rs in self.by_id.items() if len(rs) > 1]

    @property
    def status_counts(self) -> Counter:
        return Counter(r["status"] for r in self.rows)

    def measured(self) -> list[dict]:
        """ok answers after the warm-up queries."""
        return [r for r in self.rows if r["status"] == "ok" and r["query_id"] not in self.warmup_ids]

    def determinism(self) -> tuple[int, list[str]]:
        """(how many (question, frame set) pairs were answered more than once, those whose
        answers differ)."""
        answers = defaultdict(set)
        counts = Counter()
        for r in self.rows:
            if r["status"] != "ok":
                continue
            key = (r["question"], frame_set_of(r, self.set_of_stamp))
            answers[key].add(tuple(r["token_ids"]))
            counts[key] += 1
        repeated = [k for k, n in counts.items() if n > 1]
        differ = [f"{q[:40]!r} on frame set {s}: {len(answers[(q, s)])} different answers"
                  for q, s in repeated if len(answers[(q, s)]) > 1]
        return len(repeated), differ

    def rss_summary(self) -> tuple[float, float, float, float]:
        """(MB at the end of the warm-up, MB at the end, growth MB, slope MB per 1000 queries
        by least squares over the samples after the warm-up)."""
        after = [(n, b) for n, b in self.rss if n >= self.warmup and b > 0]
        if len(after) < 2:
            return (float("nan"),) * 4
        n, b = np.array([x[0] for x in after], float), np.array([x[1] for x in after], float) / 2**20
        slope = float(np.polyfit(n, b, 1)[0] * 1000) if np.ptp(n) > 0 else 0.0
        return float(b[0]), float(b[-1]), float(b[-1] - b[0]), slope

    # ---- report
    def latency_rows(self) -> list[tuple[str, float, float, float, int]]:
        ok = self.measured()
        rows = []
        for name in ("total", "cpu", "not running", "gc", "queue", "e2e", *STAGES):
            if name == "total":
                v = [r["total_ms"] for r in ok]
            elif name == "cpu":
                v = [r["cpu_ms"] for r in ok if "cpu_ms" in r]
            elif name == "not running":
                v = [r["total_ms"] - r["cpu_ms"] for r in ok if "cpu_ms" in r]
            elif name == "gc":
                v = [r["gc_ms"] for r in ok if "gc_ms" in r]
            elif name == "queue":
                v = [r["queue_ms"] for r in ok]
            elif name == "e2e":
                v = [r["e2e_ms"] for r in ok]
            else:
                v = [r["stage_ms"][name] for r in ok if name in r["stage_ms"]]
            if v:
                rows.append((name, *percentiles(v), len(v)))
        return rows

    def per_question_rows(self) -> list[tuple[str, float, float, int]]:
        by_q = defaultdict(list)
        for r in self.measured():
            by_q[r["question"]].append(r["total_ms"])
        return [(q, *percentiles(v, (50, 99)), len(v)) for q, v in by_q.items()]

    def table(self) -> str:
        lines = [f"soak: {len(self.sent)} queries at {self.rate:g}/s in {self.duration_s:.0f} s "
                 f"({self.pipeline or 'pipeline unknown'}); statistics after the first {self.warmup}",
                 f"{'ms':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'p99/p50':>9}{'n':>7}"]
        names = {"total": "pipeline", "e2e": "end-to-end", "cpu": " its CPU time", "not running": " not running",
                 "gc": " in GC"}
        for name, p50, p90, p99, n in self.latency_rows():
            ratio = p99 / p50 if p50 > 0 else float("nan")
            lines.append(f"{names.get(name, name):<14}{p50:>10.1f}{p90:>10.1f}{p99:>10.1f}{ratio:>9.2f}{n:>7}")
        pq = self.per_question_rows()
        if pq:
            worst = max(pq, key=lambda x: x[2] / x[1] if x[1] > 0 else 0)
            lines.append(f"per question: {len(pq)} questions; pipeline p99/p50 within one question "
                         f"<= {worst[2] / worst[1]:.2f} ({worst[0][:40]!r}, n {worst[3]}); "
                         f"question medians {min(x[1] for x in pq):.1f}..{max(x[1] for x in pq):.1f} ms")
        groups, n, wall99, cpu99 = identical_work_tail(self.measured())
        lines.append(f"identical work ({groups} groups of the same question, cameras, reused cameras and decode steps; "
                     f"{n} answers): p99 of latency / its group's median: wall {wall99:.2f}, CPU {cpu99:.2f}")
        start, end, growth, slope = self.rss_summary()
        lines.append(f"RSS: {start:.1f} MB after the warm-up, {end:.1f} MB at the end: growth {growth:+.1f} MB "
                     f"({slope:+.2f} MB per 1000 queries)")
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(self.status_counts.items()))
        lines.append(f"answers: {len(self.sent)} sent, {len(self.by_id)} answered, {len(self.lost)} lost, "
                     f"{len(self.duplicated)} duplicated; statuses: {statuses or 'none'}")
        repeated, differ = self.determinism()
        lines.append(f"determinism: {repeated} (question, frame set) pairs answered more than once, "
                     f"{len(differ)} with differing answers" + "".join(f"\n  DIFF {d}" for d in differ[:10]))
        return "\n".join(lines)

    def ok(self) -> bool:
        return not self.lost and not self.duplicated and not self.determinism()[1]

    @classmethod
    def pooled(cls, results: list["SoakResult"]) -> "SoakResult":
        """Several runs (ids made distinct by their prefixes) as one; RSS of the first run."""
        if len(results) == 1:
            return results[0]
        first = results[0]
        return cls(first.rate, [s for r in results for s in r.sent], [x for r in results for x in r.rows],
                   {k: v for r in results for k, v in r.set_of_stamp.items()}, first.rss, first.warmup,
                   sum(r.duration_s for r in results), first.pipeline,
                   frozenset().union(*(r.warmup_ids for r in results)))



def comparison_table(results: dict[str, "SoakResult"], rounds: int) -> str:
    """One row per configuration, ratios against the baseline (the first) of the same run: the
    pipeline's time and end-to-end (queue wait and transport included: what a query waits for
    work beside it, standing questions say)."""
    def stats(res):
        ok = res.measured()
        total = [r["total_ms"] for r in ok]
        cpu = [r["cpu_ms"] for r in ok if "cpu_ms" in r]
        idle = [r["total_ms"] - r["cpu_ms"] for r in ok if "cpu_ms" in r]
        p50, _, p99 = percentiles(total)
        c50, _, c99 = percentiles(cpu)
        e50, _, e99 = percentiles([r["e2e_ms"] for r in ok])
        return p50, p99, c50, c99, percentiles(idle)[2], e50, e99, len(ok)
    base = stats(next(iter(results.values())))
    lines = [f"soak comparison ({rounds} round{'s' * (rounds > 1)}, runs alternating; pipeline ms)",
             f"{'config':<16}{'p50':>8}{'p99':>8}{'p99/p50':>9}{'cpu p50':>9}{'cpu p99':>9}{'cpu p99/p50':>12}"
             f"{'not running p99':>16}{'e2e p50':>9}{'e2e p99':>9}{'p50 vs base':>12}{'e2e p50 vs base':>16}"
             f"{'p99 vs base':>12}{'n':>6}"]
    for label, res in results.items():
        p50, p99, c50, c99, idle99, e50, e99, n = stats(res)
        lines.append(f"{label or 'baseline':<16}{p50:>8.1f}{p99:>8.1f}{p99 / p50:>9.2f}{c50:>9.1f}{c99:>9.1f}"
                     f"{c99 / c50:>12.2f}{idle99:>16.1f}{e50:>9.1f}{e99:>9.1f}{p50 / base[0]:>12.2f}"
                     f"{e50 / base[5]:>16.2f}{p99 / base[1]:>12.2f}{n:>6}")
    return "\n".join(lines)


def identical_work_tail(rows: list[dict], min_group: int = 5) -> tuple[int, int, float, float]:
    """The runtime's own tail, without the mix of work: ok answers grouped by what they did (question,
    cameras selected, cameras reused, decode steps), each divided by its group's median; returns
    (groups, answers, p99 of that ratio for the wall time, for the serving thread's CPU time)."""
    groups = defaultdict(list)
    for r in rows:
        if r["status"] == "ok":
            key = (r["question"], tuple(r["cameras"]), tuple(r.get("reused_cameras", ())), r["decode_steps"])
            groups[key].append(r)
    groups = {k: v for k, v in groups.items() if len(v) >= min_group}
    if not groups:
        return 0, 0, float("nan"), float("nan")

    def tail(field):
        ratios = [x[field] / np.median([y[field] for y in g]) for g in groups.values() for x in g if field in x]
        return percentiles(ratios, (99,))[0] if ratios else float("nan")
    return len(groups), sum(len(g) for g in groups.values()), tail("total_ms"), tail("cpu_ms")


# --------------------------------------------------------------------------------------------
# Peak rate
@dataclass
class Trial:
    rate: float
    sent: int
    ok: int
    queue_full: int
    other: int
    lost: int

    @property
    def queue_full_fraction(self) -> float:
        return self.queue_full / self.sent if self.sent else 0.0


@dataclass
class PeakResult:
    trials: list[Trial] = field(default_factory=list)
    peak: float = 0.0
    max_queue_full: float = 0.05
    bracket: tuple[float, float] = (0.0, 0.0)
    concurrency: int = 1
    rows: list[dict] = field(default_factory=list)            # every answer of every trial
    set_of_stamp: dict[int, int] = field(default_factory=dict)
    lone_rows: list[dict] = field(default_factory=list)       # queries asked one at a time (lone latency)
    frame_sets: int = 0                                      # in the workload (lone query i: set i mod this)

    def answers(self) -> dict[tuple[str, int], list[tuple[int, ...]]]:
        """(question, frame set) -> the token ids of every ok answer to it."""
        out = defaultdict(list)
        for r in self.rows + self.lone_rows:
            if r["status"] == "ok":
                key = (r["question"], frame_set_of(r, self.set_of_stamp))
                out[key].append(tuple(r["token_ids"]))
        return out

    def lone_p50(self) -> float:
        return percentiles(list(self.lone_ms().values()), (50,))[0]

    def lone_answered(self) -> dict[str, dict]:
        """lone_i -> the row of lone query i (question i on frame set i) answered ok on its frames
        (`lone_i_againK`: the same query asked again after its frames came late; the last one counts)."""
        out = {}
        for r in self.lone_rows:
            i = int(r["query_id"].split("_")[1])
            if r["status"] == "ok" and frame_set_of(r, self.set_of_stamp) == i % max(1, self.frame_sets):
                out[f"lone_{i}"] = r
        return out

    def lone_ms(self) -> dict[str, float]:
        """lone_i -> pipeline ms of lone query i (lone_answered)."""
        return {k: r["total_ms"] for k, r in self.lone_answered().items()}

    def to_json(self) -> dict:
        return {"peak_rate": self.peak, "bracket": list(self.bracket), "concurrency": self.concurrency,
                "max_queue_full": self.max_queue_full,
                "trials": [vars(t) | {"queue_full_fraction": t.queue_full_fraction} for t in self.trials],
                "lone_pipeline_p50_ms": self.lone_p50(),
                "answers": [{"query_id": r["query_id"], "question": r["question"], "status": r["status"],
                             "frame_set": frame_set_of(r, self.set_of_stamp),
                             "answer": r.get("answer", ""), "token_ids": list(r["token_ids"]),
                             "total_ms": r["total_ms"], "queue_ms": r["queue_ms"], "stage_ms": r.get("stage_ms", {}),
                             "decode_steps": r.get("decode_steps", 0), "accepted_length": r.get("accepted_length", 0.0)}
                            for r in self.rows + self.lone_rows]}

    def table(self) -> str:
        lines = [f"peak: highest query rate with under {self.max_queue_full:.0%} queue_full",
                 f"{'rate/s':>10}{'sent':>7}{'ok':>7}{'queue_full':>12}{'fraction':>10}{'other':>7}{'lost':>6}"
                 f"  verdict"]
        for t in self.trials:
            verdict = "pass" if t.queue_full_fraction < self.max_queue_full and not t.lost else "fail"
            lines.append(f"{t.rate:>10.2f}{t.sent:>7}{t.ok:>7}{t.queue_full:>12}{t.queue_full_fraction:>10.3f}"
                         f"{t.other:>7}{t.lost:>6}  {verdict}")
        lo, hi = self.bracket
        lines.append(f"peak rate: {self.peak:.2f} queries/s (passes; {hi:.2f}/s fails)" if hi else
                     f"peak rate: >= {self.peak:.2f} queries/s (the highest rate tried passed)")
        at_peak = self.at_peak()
        if at_peak:
            lines.append(f"at the peak rate ({len(at_peak)} ok answers), ms:")
            lines.append(f"{'':<14}{'p50':>10}{'p99':>10}")
            for name in ("total", "queue", "e2e", *STAGES):
                v = [r["total_ms"] if name == "total" else r[f"{name}_ms"] if name in ("queue", "e2e")
                     else r["stage_ms"].get(name, 0.0) for r in at_peak]
                p50, p99 = percentiles(v, (50, 99))
                lines.append(f"{'pipeline' if name == 'total' else name:<14}{p50:>10.1f}{p99:>10.1f}")
        lone = list(self.lone_answered().values())
        if lone:            # where a lone query's time goes (the lone-p50 comparison's stages)
            stages = ", ".join(f"{name} {percentiles([r['stage_ms'].get(name, 0.0) for r in lone], (50,))[0]:.1f}"
                               for name in STAGES)
            steps = percentiles([r.get("decode_steps", 0) for r in lone], (50,))[0]
            lines.append(f"lone queries ({len(lone)} ok on their frames), p50 ms: {stages}; decode steps {steps:.0f}, "
                         f"answers with more than one token per pass (EAGLE-2 accepted) "
                         f"{sum(r.get('accepted_length', 0.0) > 1.0 for r in lone)}/{len(lone)}")
        return "\n".join(lines)

    def at_peak(self) -> list[dict]:
        """The ok answers of the trial at the peak rate."""
        index = next((i for i, t in enumerate(self.trials) if t.rate == self.peak), None)
        if index is None:
            return []
        prefix = f"peak{index + 1}_"
        return [r for r in self.rows if r["status"] == "ok" and r["query_id"].startswith(prefix)]


def peak_comparison(results: dict[str, PeakResult]) -> dict:
    """Each configuration against the first (the baseline) of the same run: peak rate ratio,
    greedy answers to the same (question, frame set) pairs (every answer of either run to a pair
    must be the one token sequence), and a lone query's pipeline time: each configuration's p50,
    and the median of the per-query ratios (lone query i is the same question on the same frames
    in every configuration; one pair's time varies by +-30% between runs on a shared machine, and
    the ratio of two p50s of 16 mixed queries, 2 to 14 tokens long, more than the paired median)."""
    labels = list(results)
    base = results[labels[0]]
    base_answers = base.answers()
    rows, differing, compared = [], [], 0
    lines = [f"peak comparison (concurrency {base.concurrency}; ratios against {labels[0] or 'baseline'})",
             f"{'config':<16}{'peak/s':>9}{'x base':>8}{'lone p50 ms':>13}{'x base':>8}{'lone paired':>13}"
             f"{'pairs compared':>16}{'differ':>8}"]
    for label in labels:
        res = results[label]
        pairs = res.answers()
        common = [k for k in pairs if k in base_answers]
        diff = [k for k in common if len(set(pairs[k]) | set(base_answers[k])) > 1]
        if label != labels[0]:
            compared += len(common)
            differing += [f"{label}: {q[:40]!r} on frame set {s}" for q, s in diff]
        ratio = res.peak / base.peak if base.peak else float("nan")
        lone = res.lone_p50() / base.lone_p50() if base.lone_p50() else float("nan")
        mine, theirs = res.lone_ms(), base.lone_ms()
        paired = [mine[q] / theirs[q] for q in mine if theirs.get(q)]
        paired_ratio = statistics.median(paired) if paired else float("nan")
        rows.append({"config": label or "baseline", "peak_rate": res.peak, "peak_vs_base": ratio,
                     "lone_p50_ms": res.lone_p50(), "lone_p50_vs_base": lone, "lone_paired_vs_base": paired_ratio,
                     "pairs_compared": len(common), "pairs_differing": len(diff)})
        lines.append(f"{label or 'baseline':<16}{res.peak:>9.2f}{ratio:>8.2f}{res.lone_p50():>13.1f}{lone:>8.2f}"
                     f"{paired_ratio:>13.2f}{len(common):>16}{len(diff):>8}")
    lines += [f"  DIFF {d}" for d in differing[:10]]
    return {"rows": rows, "pairs_compared": compared, "differing": differing, "table": "\n".join(lines)}
