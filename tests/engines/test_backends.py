"""The bundle backends (ONNX Runtime, OpenVINO: the same exported graphs) against the PyTorch
backend: stage by stage (fp32) and whole answers; OpenVINO with NNCF-compressed weights.

Metric for stage equivalence: max |backend - torch| / max |torch| over the whole output
tensor (relative to the output's scale), required <= 1e-4 in float32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_frames, relative_error
from helpers.export import BUNDLE_BACKENDS, MAX_NEW_TOKENS, exported_bundle, lively_checkpoint, pipelines

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.errors import LiteVLMError
from litevlm_runtime.pipeline.request import QueryRequest

TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=BUNDLE_BACKENDS)
def pipes(request, tmp_path_factory):
    """(torch, the bundle backend) over the lively checkpoint and its export."""
    root = tmp_path_factory.getbasetemp()
    return pipelines(lively_checkpoint(root), exported_bundle(root), backend=request.param)


@pytest.mark.parametrize("tiles", [3, 4, 6])   # 3 runs in the 4-tile bucket, padded
def test_vision_stage_matches_torch(pipes, tiles):
    torch_pipe, bound_pipe = pipes
    s = torch_pipe.rt.cfg.force_image_size
    pixels = torch.randn(tiles, 3, s, s, generator=torch.Generator().manual_seed(tiles))
    ref = torch_pipe.rt.engines.vision.run(pixels)
    got = bound_pipe.rt.engines.vision.run(pixels)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE


def fill_caches(pipe, seed):
    g = torch.Generator().manual_seed(seed)
    a = pipe.rt.arena
    a.k_cache.copy_(torch.randn(a.k_cache.shape, generator=g))
    a.v_cache.copy_(torch.randn(a.v_cache.shape, generator=g))


def test_decoder_stage_matches_torch(pipes):
    """A prefill (100 rows in the 256 bucket), a decode step, and a 5-node tree (8 bucket) under an
    ancestor mask in scratch slots; the hidden states and the whole KV caches must agree.
    The caches start full of random values so that a stale entry leaking through the mask shows."""
    torch_pipe, bound_pipe = pipes
    for p in pipes:
        fill_caches(p, 0)
    d = torch_pipe.rt.cfg.llm.hidden_size
    g = torch.Generator().manual_seed(1)
    n = 100
    # a prefill: no earlier cache, a causal prompt (positions with gaps, as after token selection)
    prefill = (torch.randn(n, d, generator=g), torch.arange(n) * 2, torch.ones(n, n, dtype=torch.bool).tril_())
    # decode step: one row at slot n attending to every slot before it
    steps = [(torch.randn(1, d, generator=g), torch.tensor([2 * n]), torch.tensor([n]),
              torch.ones(1, n, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool))]
    # tree: root + two children + two grandchildren in scratch slots 130..134, over slots < n + 1
    parents = [-1, 0, 0, 1, 2]
    ancestors = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            ancestors[i, j] = True
            j = parents[j]
    depth = torch.tensor([0, 1, 1, 2, 2])
    steps.append((torch.randn(5, d, generator=g), 2 * n + 1 + depth, torch.arange(130, 135),
                  torch.ones(5, n + 1, dtype=torch.bool), ancestors))

    def check(outs, rows):
        assert outs[1].shape == outs[0].shape == (rows, d)
        assert relative_error(outs[1], outs[0]) <= TOLERANCE
        ka, kb = bound_pipe.rt.arena, torch_pipe.rt.arena
        assert relative_error(ka.k_cache, kb.k_cache) <= TOLERANCE
        assert relative_error(ka.v_cache, kb.v_cache) <= TOLERANCE

    check([p.rt.engines.decoder.prefill(*prefill).clone() for p in pipes], n)
    for embeds, positions, slots, mask_cache, mask_new in steps:
        check([p.rt.engines.decoder.step(embeds, positions, slots, mask_cache, mask_new).clone() for p in pipes],
              embeds.shape[0])


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_head_stage_matches_torch(pipes, rows):
    torch_pipe, bound_pipe = pipes
    hidden = torch.randn(rows, torch_pipe.rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(rows))
    ref = torch_pipe.rt.engines.head.run(hidden)
    got = bound_pipe.rt.engines.head.run(hidden)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE


def test_answers_identical_to_torch(pipes):
    torch_pipe, bound_pipe = pipes
    answers = []
    for i, question in enumerate(DEFAULT_QUESTIONS[:6]):
        frames = random_frames(i)
        ref, got = torch_pipe.answer(frames, question), bound_pipe.answer(frames, question)
        assert got.token_ids == ref.token_ids, question
        assert got.text == ref.text
        assert 1 <= len(ref.token_ids) <= MAX_NEW_TOKENS
        answers.append(tuple(ref.token_ids))
    # the comparison means something only if answers depend on the input
    assert len(set(answers)) >= 4


def test_bucket_overflow_is_a_clear_error(pipes):
    _, bound_pipe = pipes
    hidden = torch.zeros(9, bound_pipe.rt.cfg.llm.hidden_size)
    with pytest.raises(LiteVLMError, match="largest shape bucket 8"):
        bound_pipe.rt.engines.head.run(hidden)


def test_backend_needs_a_bundle(tmp_path_factory):
    from helpers import options

    from litevlm_runtime.pipeline.pipeline import Pipeline

    model = lively_checkpoint(tmp_path_factory.getbasetemp())
    with pytest.raises(LiteVLMError, match="litevlm export"):
        Pipeline.from_pretrained(model, options(backend__name="onnxruntime"))
    with pytest.raises(LiteVLMError, match="backend.name: 'tpu' is not one of"):
        Pipeline.from_pretrained(model, options(backend__name="tpu"))
    with pytest.raises(LiteVLMError, match="tensorrt runs on a CUDA device"):
        Pipeline.from_pretrained(model, options(backend__name="tensorrt", backend__bundle="b"))


def test_follow_up_on_a_bundle_backend_equals_torch(pipes):
    """A follow-up's new rows run as decode steps over the restored KV, in calls of at most the
    bundle's largest step bucket (8 rows here): the same answer as torch's follow-up and as the
    conversation from scratch (on torch: the whole conversation is past this bundle's one
    256-row prefill bucket, which a follow-up never uses)."""
    torch_pipe, bound_pipe = pipes
    images = random_frames(3)
    got = {}
    for name, pipe in (("torch", torch_pipe), ("bound", bound_pipe)):
        first = pipe.answer(images, QueryRequest(DEFAULT_QUESTIONS[0], query_id="t1", keep_turn=True))
        follow = pipe.answer(images, QueryRequest(DEFAULT_QUESTIONS[1], follow_up_of="t1"))
        assert follow.input_tokens > 8 and follow.reused_tokens > 0
        got[name] = (first.token_ids, follow.token_ids, first.text)
    assert got["bound"] == got["torch"]
    scratch = torch_pipe.answer(
        images, QueryRequest(DEFAULT_QUESTIONS[1], history=[(DEFAULT_QUESTIONS[0], got["torch"][2])])
    )
    assert scratch.token_ids == got["bound"][1]


def test_backend_choices_are_checked_with_the_reason(tmp_path_factory):
    """backend.compress is OpenVINO's; int8 PyTorch weights are not a bundle backend's; an OpenVINO
    pipeline without a bundle names the export command."""
    from helpers import options

    from litevlm_runtime.pipeline.pipeline import Pipeline

    with pytest.raises(LiteVLMError, match="backend.compress int8: NNCF compresses the weights OpenVINO runs"):
        options(backend__name="onnxruntime", backend__compress="int8")
    with pytest.raises(LiteVLMError, match="or set backend.compress int8"):
        options(backend__name="openvino", backend__weights="int8")
    with pytest.raises(LiteVLMError, match="backend.compress: 'int2' is not one of"):
        options(backend__name="openvino", backend__compress="int2")
    model = lively_checkpoint(tmp_path_factory.getbasetemp())
    with pytest.raises(LiteVLMError, match="backend.name openvino needs backend.bundle"):
        Pipeline.from_pretrained(model, options(backend__name="openvino"))


def rtn(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """w [N, K] quantized and dequantized in float64 by textbook round-to-nearest, asymmetric,
    over groups of `group` input channels (None: each output channel whole), the range widened
    to hold zero: scale = (max - min) / (2^bits - 1), zero point round(-min / scale). What
    backend.compress promises NNCF does (int8 per channel, int4 in groups of 128)."""
    n, k = w.shape
    g = w.double().reshape(n, -1, group or k)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / (2 ** bits - 1)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale) + zero, 0, 2 ** bits - 1)
    return ((q - zero) * scale).reshape(n, k).to(w.dtype)


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """Per mode: OpenVINO over the lively bundle with NNCF int8 / int4 weights, beside a torch
    pipeline whose decoder linears and LM head hold `rtn` of the same weights (the reference)
    and the float torch pipeline."""
    from helpers import options

    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.weights.linear_forms import decoder_linears

    root = tmp_path_factory.getbasetemp()
    model, bundle = lively_checkpoint(root), exported_bundle(root)
    float_pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
    out = {}
    for mode, bits, group in (("int8", 8, None), ("int4", 4, 128)):
        ov_pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name="openvino",
                                                          backend__bundle=str(bundle), backend__compress=mode))
        ref = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
        lm = ref.rt.lm
        with torch.no_grad():
            for _, _, linear in decoder_linears(lm):            # every layer's projections and the LM head
                linear.weight.copy_(rtn(linear.weight, bits, group))
        out[mode] = (ov_pipe, ref, float_pipe)
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_openvino_compressed_weights_are_what_compress_says(compressed, mode):
    """backend.compress int8 / int4: OpenVINO's prefill (every decoder layer) and LM head equal
    torch running round-to-nearest weights of that form (`rtn`), within 1% of
    the output's scale (measured 3-6e-4: NNCF keeps its scales in float16), while the float
    weights' outputs are 5x or more further off (measured: int8 0.6-1.6%, int4 10-26% on these
    std-0.1 random weights): the weights are compressed, and to what the setting says."""
    ov_pipe, ref, float_pipe = compressed[mode]
    assert ov_pipe.rt.engines.backend == f"openvino[{mode}]"
    d = ref.rt.cfg.llm.hidden_size
    g = torch.Generator().manual_seed(4)
    n = 40
    prompt = (torch.randn(n, d, generator=g), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_())
    hidden = torch.randn(8, d, generator=g)
    got = (ov_pipe.rt.engines.decoder.prefill(*prompt).clone(), ov_pipe.rt.engines.head.run(hidden).clone())
    want = (ref.rt.engines.decoder.prefill(*prompt).clone(), ref.rt.engines.head.run(hidden).clone())
    floats = (float_pipe.rt.engines.decoder.prefill(*prompt).clone(), float_pipe.rt.engines.head.run(hidden).clone())
    for stage, a, b, f in zip(("prefill", "head"), got, want, floats):
        to_reference, to_float = relative_error(a, b), relative_error(a, f)
        assert to_reference <= 0.01, (stage, to_reference, to_float)
        assert to_float > 5 * to_reference, (stage, to_reference, to_float)


def test_bench_names_openvino_rows_and_the_fastest_backend_per_stage(tmp_path):
    """`litevlm bench --backend torch,onnxruntime=B,openvino=B,openvino:int8=B`: one run per
    entry, OpenVINO's compression in its label and options; the table names, per stage, the
    fastest backend when it leads the next by more than 5%, else 'level'."""
    from helpers import options

    from litevlm_runtime.bench.backends import backend_options, comparison_table, parse_backends
    from litevlm_runtime.pipeline.answer import STAGES

    specs = parse_backends(f"torch,onnxruntime={tmp_path},openvino={tmp_path},openvino:int4", tmp_path)
    assert [(s.label, s.name, s.compress) for s in specs] == [
        ("torch", "torch", ""), ("onnxruntime", "onnxruntime", ""), ("openvino", "openvino", ""),
        ("openvino[int4]", "openvino", "int4")]
    base = options(backend__name="openvino", backend__compress="int8")
    assert backend_options(base, specs[0]).backend.compress == "none"          # not the torch row's
    assert backend_options(base, specs[2]).backend.compress == "int8"          # the command's own
    assert backend_options(base, specs[3]).backend.compress == "int4"
    assert str(backend_options(base, specs[3]).backend.bundle) == str(tmp_path)
    for bad, why in (("onnxruntime:int8=B", "NAME:COMPRESS is openvino:"), ("openvino:int2=B", "NAME:COMPRESS"),
                     ("openvino", "needs a bundle")):
        with pytest.raises(LiteVLMError, match=why):
            parse_backends(bad, None)
    ms = {"torch": 100.0, "onnxruntime": 50.0, "openvino": 40.0}
    summary = {"queries": 2, "baseline": "torch", "backends": {
        label: {"median_ms": {s: (m if s == "decode" else 10.0 + i * 0.1) for s in (*STAGES, "total")},
                "identical_to_baseline": "2/2"} for i, (label, m) in enumerate(ms.items())}}
    rows = {line.split()[0]: line for line in comparison_table(summary).splitlines() if line.strip()}
    assert rows["decode"].rstrip().endswith("openvino (1.25x over onnxruntime)")
    assert rows["vision"].rstrip().endswith("level")
