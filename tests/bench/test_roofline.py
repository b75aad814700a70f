"""The roofline's accounting (roofline.py): what a stage must move and compute, from the model's own
tensors, and the `litevlm bench --roofline` table. Behaviour only: no figure of this machine's
speed is checked (the bandwidth only has to be a positive, finite measurement)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import options
from helpers.export import lively_checkpoint

from litevlm_runtime.bench.roofline import measure_bandwidth, stage_costs
from litevlm_runtime.cli import main
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.lowbit import Int8Linear


def test_bandwidth_is_a_measurement():
    bw = measure_bandwidth(8 << 20, repeats=2)
    assert bw.array_bytes * 3 <= 8 << 20
    for gbs in (bw.read_gbs, bw.copy_gbs, bw.triad_gbs):
        assert 0 < gbs < math.inf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lively_checkpoint(tmp_path_factory.getbasetemp())


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_decode_step_moves_every_decoder_weight_and_the_live_cache(model, weights):
    pipe = Pipeline.from_pretrained(model, options(pipeline="baseline", backend__threads=1, backend__weights=weights))
    rt, context = pipe.rt, 40
    step, head = stage_costs(rt, ("step", "head"), context, 0, 0, repeats=1)
    lm = rt.lm
    tensors = [t for m in list(lm.layers) + [lm.norm, lm.output] for t in list(m.parameters()) + list(m.buffers())]
    llm = rt.cfg.llm
    kv = 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * 4 * (context + 1)   # float32 cache
    assert step.bytes == sum(t.numel() * t.element_size() for t in tensors) + kv
    # at least the 2 FLOPs per weight of every linear layer (attention adds its own)
    linears = [m for m in lm.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert step.flops >= 2 * sum(m.in_features * m.out_features for m in linears)
    assert head.bytes == sum(
        t.numel() * t.element_size() for t in list(lm.output.parameters()) + list(lm.output.buffers())
    )
    assert step.ms > 0 and head.ms > 0


def test_int8_step_moves_about_a_quarter_of_the_linear_bytes(model):
    costs = {}
    for weights in ("float", "int8"):
        pipe = Pipeline.from_pretrained(
            model, options(pipeline="baseline", backend__threads=1, backend__weights=weights)
        )
        costs[weights] = stage_costs(pipe.rt, ("step",), 10, 0, 0, repeats=1)[0].bytes
    assert 0.25 < costs["int8"] / costs["float"] < 0.35       # int8 + a float scale per row, norms and cache in float


def test_bench_roofline_alternates_weights_in_one_table(capsys):
    rc = main(["bench", "--preset", "tiny", "--roofline", "--weights", "float,int8,int4-rtn", "--stages", "step,head",
               "--context", "32", "--pipeline", "baseline", "--backend.threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fraction of floor" in out and "GB/s" in out
    assert "int8 vs float" in out and "int4-rtn vs float" in out and "int4-rtn vs int8" in out
    assert out.count("decode step (1 row, 32 cached)") == 6    # float, int8, int4-rtn, and three ratios


@pytest.mark.parametrize("extra", [[], ["--costs"]])
def test_every_bench_table_prints_the_decode_step_against_its_floor(capsys, extra):
    rc = main(["bench", "--preset", "tiny", "--questions", "1", "--frame-sets", "1", "--max_new_tokens", "4",
               "--backend.threads", "1"] + extra)
    out = capsys.readouterr().out
    assert rc == 0
    line = next(l for l in out.splitlines() if l.startswith("decode step ("))
    assert "floor" in line and "GB/s" in line and "fraction of the floor reached" in line


def test_columns_a_step_reads_follow_the_backend():
    """Eager torch reads the live columns; a graph backend its cache bucket (the whole cache unless
    torch-compile's buckets): what the step's floor counts."""
    from types import SimpleNamespace

    from litevlm_runtime.bench.roofline import columns_read

    def rt(backend, **decoder):
        return SimpleNamespace(engines=SimpleNamespace(backend=backend, decoder=SimpleNamespace(**decoder)),
                               arena=SimpleNamespace(max_len=1911))
    assert columns_read(rt("torch"), 208) == 208
    assert columns_read(rt("onnxruntime"), 208) == 1911
    assert columns_read(rt("torch-compile", cache_sizes=(256, 512, 1024, 1911)), 208) == 256
    assert columns_read(rt("torch-compile", cache_sizes=(256, 512, 1024, 1911)), 1025) == 1911


@pytest.mark.parametrize("weights", ["float", "int8", "int4-rtn", "fp16"])
def test_tied_head_step_counts_the_table_it_multiplies(weights):
    """InternVL3/3.5 tie the LM head to the embedding (a matmul, not a Linear): the step and the head
    read the whole table, float or its one low-bit copy, and the roofline counts it (issue 35: it
    left 0.93 GB of the 2B step out)."""
    from litevlm_runtime.bench.random_model import random_pipeline

    pipe = random_pipeline("tiny-qwen3", options(pipeline="baseline", backend__threads=1, backend__weights=weights))
    rt, context = pipe.rt, 30
    lm = rt.lm
    assert lm.cfg.tie_word_embeddings and not isinstance(lm.head, torch.nn.Module)
    step, head = stage_costs(rt, ("step", "head"), context, 0, 0, repeats=1)

    def nbytes(modules):
        seen = {t.data_ptr(): t for m in modules for t in list(m.parameters()) + list(m.buffers())}
        return sum(t.numel() * t.element_size() for t in seen.values())
    llm = rt.cfg.llm
    kv = 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * 4 * (context + 1)
    assert head.bytes == nbytes([lm.embed]) > 0
    assert step.bytes == nbytes(list(lm.layers) + [lm.norm, lm.embed]) + kv
    table = llm.vocab_size * llm.hidden_size
    expected_table = {"float": 4 * table, "int8": table + 4 * llm.vocab_size, "fp16": 2 * table,
                      "int4-rtn": table // 2 + 3 * table // 128}[weights]      # codes + float16 scale, uint8 zero
    assert head.bytes == expected_table
