"""`litevlm bench --study cpu_stages` as a user runs it (issue 43: vision and the prompt's prefill, each GEMM variant
alternating in one process): every stage x variant row, the speed-up column against the first variant,
and a clear refusal of an unknown stage. Behaviour only: the figures themselves are the machine's.
Also the FLOP formulas it (and `litevlm bench --roofline`) counts vision and prefill with."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

from litevlm_runtime.bench.roofline import count_flops

STUDY = [sys.executable, "-m", "litevlm_runtime.cli", "bench", "--study", "cpu_stages"]


def test_every_stage_and_variant_gets_a_row(tmp_path):
    out = subprocess.run(
        [*STUDY, "--preset", "tiny", "--weights", "int4-rtn",
         "--threads", "1", "--prefill-rows", "40", "--tiles", "2", "--prefill-gemm", "float32,int8",
         "--vision-gemm", "float32,bfloat16", "--rounds", "2"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("stage ")) + 2
    rows = [line.split() for line in lines[first:] if line.strip()]
    got = {(" ".join(r[:3]), r[3]) for r in rows}
    assert got == {("prefill (40 rows)", v) for v in ("float32", "int8")} | \
        {("vision (2 tiles)", v) for v in ("float32", "bfloat16")}
    assert all(r[-1].endswith("x") for r in rows)
    assert [r[-1] for r in rows if r[3] in ("float32",)] == ["1.00x", "1.00x"]     # the first variant: the reference
    assert "1-min load" in out.stdout


def test_an_unknown_stage_is_named(tmp_path):
    out = subprocess.run(
        [*STUDY, "--preset", "tiny", "--stages", "decode"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode != 0 and "--stages decode" in out.stdout + out.stderr


def test_flops_of_onednn_linear_and_cpu_attention_are_counted():
    x, w = torch.randn(3, 5, 64), torch.randn(32, 64)
    assert count_flops(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")) == 2 * 15 * 64 * 32
    q, kv = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 12, 8)
    assert count_flops(lambda: F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)) == 4 * 4 * 10 * 12 * 8
