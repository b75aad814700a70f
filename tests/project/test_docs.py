"""The docs say how to measure; dated figures live in docs/results/, each beside the commit it was
measured on (issue 44, "docs that will not go stale"). Checked here: docs/performance.md stays a
methods file with one current table whose links resolve, every results file states its question,
date, command and a commit that exists in this repository, and the results index lists them all;
and the figures the docs compute rather than measure (the shipped arena in docs/serving.md, the
car's memory plan in docs/deployment.md) agree with the code that computes them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from litevlm_runtime.bench.memory import PRESETS, memory_rows, memory_table_rows
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.arena import Arena
from litevlm_runtime.pipeline.runtime import DTYPES, arena_limits
from litevlm_runtime.stages.prompt import resolve_layout
from litevlm_runtime.weights.checkpoint import read_config
from litevlm_runtime.weights.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
COMMIT_LINE = re.compile(r"^- \*\*Measured on commit\*\*: `([0-9a-f]{7,40})`", re.M)


def results_files() -> list[Path]:
    return sorted(RESULTS.glob("2*.md"))


def markdown_tables(text: str) -> list[list[str]]:
    """Each table as its lines: a header row, a |---| separator, then its rows."""
    tables, lines = [], text.splitlines()
    for i in range(len(lines) - 1):
        if lines[i].startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            rows = [lines[i]]
            for line in lines[i + 2:]:
                if not line.startswith("|"):
                    break
                rows.append(line)
            tables.append(rows)
    return tables


def test_performance_doc_is_methods_plus_one_current_table():
    text = (DOCS / "performance.md").read_text()
    assert len(text.splitlines()) < 400, "docs/performance.md: methods only; dated figures go to docs/results/"
    assert "## Current figures" in text
    current = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    tables = markdown_tables(current)
    assert len(tables) == 1, "one current table under '## Current figures'"
    header, *rows = tables[0]
    assert "measured" in header and "results" in header
    assert len(rows) >= 10
    for row in rows:
        links = re.findall(r"\]\((results/[^)#]+)\)", row)
        assert links, f"a current figure without its results file: {row[:80]}"
        for link in links:
            assert (DOCS / link).is_file(), f"docs/performance.md links to a missing {link}"
        if "to be measured" not in row:
            assert re.search(r"20\d\d-\d\d-\d\d, `[0-9a-f]{7,40}`", row), f"no date and commit: {row[:80]}"
    # no dated results sections left in the methods file
    assert not re.search(r"^#+ .*20\d\d-\d\d-\d\d", text, re.M)


def test_every_results_file_states_its_question_date_command_and_commit():
    files = results_files()
    assert files, "docs/results/ holds no results"
    for path in files:
        text = path.read_text()
        assert re.match(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md$", path.name), path.name
        for field in ("**Question**", "**Measured**", "**Command**", "**Machine and load**"):
            assert field in text, f"{path.name} lacks {field}"
        assert COMMIT_LINE.search(text), f"{path.name} names no commit"


def test_the_results_index_lists_every_file_and_every_link_resolves():
    index = (RESULTS / "README.md").read_text()
    for path in results_files():
        assert f"]({path.name})" in index, f"docs/results/README.md does not list {path.name}"
    for doc in [*DOCS.glob("*.md"), *RESULTS.glob("*.md")]:
        for link in re.findall(r"\]\(([^)#:]+\.md)\)", doc.read_text()):
            assert (doc.parent / link).is_file(), f"{doc.relative_to(ROOT)} links to a missing {link}"


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_results_commit_exists_in_this_repository():
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the older commits")
    for path in results_files():
        for commit in COMMIT_LINE.findall(path.read_text()):
            run = git("cat-file", "-e", f"{commit}^{{commit}}")
            assert run.returncode == 0, f"{path.name}: commit {commit} is not in this repository"


# Figures the docs compute rather than measure: stated once, checked here against the code that
# computes them, so that a change to the arena or the presets fails until the doc says it too.

def doc_table(doc: str, header_start: str) -> list[list[str]]:
    text = (DOCS / doc).read_text()
    table = next(t for t in markdown_tables(text) if t[0].startswith(header_start))
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in table[1:]]


def test_the_serving_doc_states_the_shipped_arena():
    model = str(DEFAULT_MODEL)
    cfg, options = read_config(Path(model)), options_from_flat({}).resolved(None)
    limits = arena_limits(cfg, Tokenizer(model), options, resolve_layout(None, model)[0])
    arena = Arena(cfg, limits, DTYPES[options.dtype], torch.device("meta"))
    kv = sum(t.numel() * t.element_size() for k, t in arena.buffers().items()
             if k in ("k_regions", "v_regions", "k_turns", "v_turns"))
    shipped = next(r for r in doc_table("serving.md", "| max_turns | conversations | max_len")
                   if r[0].endswith("(shipped)"))
    assert int(shipped[2]) == arena.max_len, "docs/serving.md's shipped max_len"
    assert float(shipped[4]) == round(kv / 2**20, 1), "docs/serving.md's shipped KV MiB"


def test_the_deployment_doc_states_the_memory_plan():
    names = {"InternVL2.5-2B": "internvl2_5-2b", "InternVL3-2B": "internvl3-2b"}
    documented = [[names[r[0]], *r[1:]] for r in doc_table("deployment.md", "| model | weights | KV | ViT MiB")]
    computed = [row for p in PRESETS for row in memory_table_rows(memory_rows(p, reserved_gib=40.0))]
    assert documented == computed, "docs/deployment.md's memory plan differs from `litevlm bench --memory`"
