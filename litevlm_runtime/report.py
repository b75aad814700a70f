"""Plain-text tables for the CLI (latency per stage, benchmark summaries)."""

from __future__ import annotations

from .pipeline.answer import Answer


def table(headers: list[str], rows: list[list], floatfmt: str = "{:.2f}") -> str:
    cells = [[floatfmt.format(c) if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def answer_table(ans: Answer) -> str:
    rows = [[stage, ms] for stage, ms in ans.stage_ms.items()] + [["total", ans.total_ms]]
    return table(["stage", "ms"], rows)
