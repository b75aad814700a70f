"""`litevlm export`: the bundle's manifest, its integrity checks, and every graph against the
PyTorch stage (relative error max |onnx - torch| / max |torch| <= 1e-4 in fp32)."""

from __future__ import annotations

import shutil

import pytest
from helpers import options
from helpers.export import MAX_NEW_TOKENS, TEST_BUCKETS, exported_bundle, lively_checkpoint

from litevlm_runtime.engines.buckets import Buckets, default_buckets, parse_buckets, pick
from litevlm_runtime.engines.bundle import checkpoint_hash, read_manifest
from litevlm_runtime.errors import LiteVLMError
from litevlm_runtime.export.exporter import verify_bundle
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.integrity import sha256_file


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return lively_checkpoint(root), exported_bundle(root)


def test_manifest_describes_every_graph(exported):
    model, bundle = exported
    m = read_manifest(bundle)
    assert m["model"]["checkpoint_sha256"] == checkpoint_hash(model)
    assert m["buckets"] == TEST_BUCKETS.to_dict()
    want = ([("vision", n) for n in TEST_BUCKETS.vision] + [("prefill", t) for t in TEST_BUCKETS.prefill]
            + [("decoder", t) for t in TEST_BUCKETS.step] + [("decoder_batch", max(TEST_BUCKETS.batch))]
            + [("head", t) for t in TEST_BUCKETS.head])
    assert [(g["stage"], g["bucket"]) for g in m["graphs"]] == want
    names = {"vision": (["pixels"], ["visual"]), "head": (["hidden"], ["logits"]),
             "prefill": (["embeds", "positions", "mask_new"], ["hidden", "k_new", "v_new"]),
             "decoder": (["embeds", "positions", "mask_cache", "mask_new", "k_cache", "v_cache"],
                         ["hidden", "k_new", "v_new"]),
             "decoder_batch": (["embeds", "positions", "mask_cache", "mask_new", "k_regions", "v_regions"],
                               ["hidden", "k_new", "v_new"])}
    for g in m["graphs"]:
        assert ([i["name"] for i in g["inputs"]], [o["name"] for o in g["outputs"]]) == names[g["stage"]]
        assert sha256_file(bundle / g["file"]) == g["sha256"]
        if g["stage"] == "decoder_batch":
            continue                    # one graph, a dynamic batch dimension (test below)
        rows = g["inputs"][0]["shape"][0]
        assert rows == g["bucket"]
        if g["stage"] in ("decoder", "prefill"):
            assert g["outputs"][1]["shape"][2] == rows
        if g["stage"] == "decoder":
            shapes = {i["name"]: i["shape"] for i in g["inputs"]}
            assert shapes["mask_cache"] == [rows, m["arena"]["max_len"]] and shapes["mask_new"] == [rows, rows]
            assert {i["name"]: i["dtype"] for i in g["inputs"]}["mask_new"] == "bool"
            assert g["outputs"][1]["shape"][2] == rows
    for name, digest in m["weights"].items():
        assert sha256_file(bundle / name) == digest
    # weights are stored once per stage, however many buckets use them
    decoder_weights = (bundle / "decoder.weights").stat().st_size
    assert decoder_weights < 1.5 * sum(p.numel() * 4 for n, p in _lm_params(model))
    assert set(m["not_present"]) >= {"token_selector", "eagle_draft"}


def _lm_params(model):
    from litevlm_runtime.weights.checkpoint import load_model

    return [
        (n, p) for n, p in load_model(model).language_model.named_parameters() if "embed" not in n and "output" not in n
    ]


def test_every_graph_matches_the_torch_stage(exported):
    model, bundle = exported
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
    rows = verify_bundle(pipe.rt, bundle)
    batched = [(r["bucket"], r["rows"]) for r in rows if r["stage"] == "decoder_batch"]
    # every batch bucket full, and the largest one row short (a padding row): hidden, k and v each
    assert sorted(set(batched)) == [(2, 2), (4, 3), (4, 4)] and len(batched) == 9
    assert len(rows) == (len(TEST_BUCKETS.vision) + 3 * (len(TEST_BUCKETS.prefill) + len(TEST_BUCKETS.step))
                         + len(TEST_BUCKETS.head) + len(batched))
    worst = max(rows, key=lambda r: r["rel_error"])
    assert worst["rel_error"] <= 1e-4, worst


def test_batched_step_is_one_graph_with_a_dynamic_batch(exported):
    """decoder_batch: one graph over [B, layers, Hkv, S, D] KV regions, B a named dynamic axis,
    exported for the batch buckets; its weights are the decode step's file (same parameters)."""
    import onnx

    _, bundle = exported
    m = read_manifest(bundle)
    (g,) = [g for g in m["graphs"] if g["stage"] == "decoder_batch"]
    assert g["buckets"] == list(TEST_BUCKETS.batch) and g["weights"] == "decoder.weights"
    shapes = {i["name"]: i["shape"] for i in g["inputs"] + g["outputs"]}
    a = m["arena"]
    assert shapes["mask_cache"] == ["batch", a["max_len"]] and shapes["mask_new"] == ["batch", "batch"]
    assert shapes["k_regions"][0] == "batch" and shapes["k_regions"][3] == a["max_len"]
    assert shapes["hidden"][0] == "batch" and shapes["k_new"][2] == "batch"
    graph = onnx.load(str(bundle / g["file"]), load_external_data=False).graph
    first = {i.name: i.type.tensor_type.shape.dim[0] for i in graph.input}
    assert all(d.dim_param and not d.dim_value for d in first.values()), first     # symbolic in the graph too


def test_tampered_or_mismatched_bundle_is_refused(exported, tmp_path):
    model, bundle = exported
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    g = read_manifest(copy)["graphs"][0]
    data = bytearray((copy / g["file"]).read_bytes())
    data[-1] ^= 0xFF
    (copy / g["file"]).write_bytes(bytes(data))
    opts = lambda **kw: options(backend__name="onnxruntime", backend__bundle=str(copy), **kw)  # noqa: E731
    with pytest.raises(LiteVLMError, match="does not match its sha256"):
        Pipeline.from_pretrained(model, opts(max_new_tokens=MAX_NEW_TOKENS))
    with pytest.raises(LiteVLMError, match="exported for arena max_len"):
        Pipeline.from_pretrained(model, opts(max_new_tokens=MAX_NEW_TOKENS + 5))
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(LiteVLMError, match="not valid JSON"):
        Pipeline.from_pretrained(model, opts(max_new_tokens=MAX_NEW_TOKENS))


def test_bucket_parsing_and_picking(exported):
    model, _ = exported
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
    d = default_buckets(pipe.rt.arena)
    assert d.vision == (1, 2, 3, 6) and d.step == (1, 64) and max(d.prefill) == pipe.rt.arena.max_prompt
    b = parse_buckets("vision=2,6; step=1,8", d)
    assert b.vision == (2, 6) and b.step == (1, 8) and b.prefill == d.prefill
    assert b.decoder() == tuple(sorted(set(d.prefill) | {1, 8}))
    with pytest.raises(LiteVLMError, match="KEY=N"):
        parse_buckets("tiles=3", d)
    with pytest.raises(LiteVLMError, match="positive"):
        Buckets(vision=(0,), prefill=(8,), step=(1,), head=(1,))
    assert pick((4, 6), 3, "vision") == 4 and pick((4, 6), 6, "vision") == 6
    with pytest.raises(LiteVLMError, match="--buckets 'step=...'"):
        pick((1, 8), 9, "decoder")
    assert d.cache == () and parse_buckets("cache=512,256", d).cache == (256, 512)
    assert Buckets.from_dict(d.to_dict()) == d and Buckets.from_dict({**d.to_dict(), "cache": [64]}).cache == (64,)


def test_export_refuses_buckets_larger_than_the_arena(exported, tmp_path):
    from litevlm_runtime.export.exporter import export_bundle

    model, _ = exported
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
    too_big = Buckets(vision=(7,), prefill=(8,), step=(1,), head=(1,))
    with pytest.raises(LiteVLMError, match="exceed the arena's maximum 6"):
        export_bundle(pipe.rt, tmp_path / "b", too_big, progress=lambda m: None)
    with pytest.raises(LiteVLMError, match="exceed the arena's maximum"):
        export_bundle(pipe.rt, tmp_path / "b", Buckets(vision=(6,), prefill=(8,), step=(1,), head=(1,),
                                                       cache=(pipe.rt.arena.max_len + 1,)), progress=lambda m: None)
    with pytest.raises(LiteVLMError, match="cache-column buckets are torch-compile's"):
        export_bundle(pipe.rt, tmp_path / "b", Buckets(vision=(6,), prefill=(8,), step=(1,), head=(1,), cache=(64,)),
                      progress=lambda m: None)
    assert not list((tmp_path / "b").glob("*.onnx"))       # refused before exporting anything


def test_eagle_draft_step_exports_and_matches(exported, tmp_path):
    """The EAGLE-2 draft step's graph (from a draft head in the model folder) in ONNX Runtime
    against DraftHead.forward, which writes its cache in place."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from litevlm_runtime.export.exporter import SharedWeights, draft_specs, export_graph
    from litevlm_runtime.models.eagle import DraftHead
    from litevlm_runtime.weights.draft_head import save_draft_head

    model, _ = exported
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    rt = Pipeline.from_pretrained(folder, options(max_new_tokens=MAX_NEW_TOKENS)).rt
    assert draft_specs(rt, TEST_BUCKETS)[0] == []
    torch.manual_seed(0)
    draft = DraftHead(rt.cfg.llm)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_draft_head(draft, folder / "eagle", {"test": True})
    specs, status = draft_specs(rt, Buckets(vision=(1,), prefill=(4,), step=(1,), head=(1,)))
    assert status == "exported" and [s.bucket for s in specs] == [1, 4]
    spec = specs[1]
    entry = export_graph(spec, tmp_path / "eagle_draft_4.onnx", SharedWeights(tmp_path, "eagle_draft"))
    assert [o["name"] for o in entry["outputs"]] == ["features_out", "k_new", "v_new"]
    g = torch.Generator().manual_seed(1)
    t, s = 4, rt.arena.max_len
    inputs = dict(spec.inputs)
    inputs["k_cache"] = torch.randn(inputs["k_cache"].shape, generator=g)
    inputs["v_cache"] = torch.randn(inputs["v_cache"].shape, generator=g)
    inputs["positions"] = torch.arange(10, 10 + t)
    history, slots = 10, torch.arange(10, 10 + t)
    inputs["mask_cache"] = torch.zeros(t, s, dtype=torch.bool)
    inputs["mask_cache"][:, :history] = True
    inputs["mask_new"] = torch.ones(t, t, dtype=torch.bool).tril_()
    session = ort.InferenceSession(str(tmp_path / "eagle_draft_4.onnx"), providers=["CPUExecutionProvider"])
    feats, k_new, _ = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    # Against the eager torch draft engine over the live columns, which stores the rows in its cache.
    from litevlm_runtime.engines.torch_engine import TorchDraft

    k_ref, v_ref = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    engine = TorchDraft(specs[1].module.draft, k_ref, v_ref)
    with torch.no_grad():
        want = engine.step(inputs["token_embeds"], inputs["features"], inputs["positions"], slots,
                           inputs["mask_cache"][:, :history], inputs["mask_new"])
    rel = lambda got, ref: float(np.abs(got - ref.numpy()).max() / np.abs(ref.numpy()).max())  # noqa: E731
    assert rel(feats, want) <= 1e-4
    assert rel(k_new, k_ref[:, :, slots]) <= 1e-4


@pytest.mark.slow
def test_view_selector_exports_and_matches(tmp_path):
    """The view selector graph (model folder's view_selector/) in ONNX Runtime vs the module."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from litevlm_runtime.export.exporter import SharedWeights, export_graph, view_selector_spec
    from litevlm_runtime.stages.view_selector import (
        ViewSelector,
        ViewSelectorConfig,
        save_view_selector,
        train_tokenizer,
    )

    tok = train_tokenizer(["is there a car behind the ego vehicle", "what is in front left of the ego car"])
    torch.manual_seed(0)
    save_view_selector(tmp_path / "view_selector",
                       ViewSelector(ViewSelectorConfig(vocab_size=tok.get_vocab_size(), width=32, layers=1, heads=2,
                                                       ffn=64, max_len=24)), tok)
    spec, status = view_selector_spec(tmp_path)
    assert status == "exported" and spec.bucket == 24
    entry = export_graph(spec, tmp_path / "view_selector_24.onnx", SharedWeights(tmp_path, "view_selector"))
    assert entry["outputs"][0]["shape"] == [1, 6]
    ids = torch.randint(0, tok.get_vocab_size(), (1, 24), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(1, 24, dtype=torch.bool)
    pad[0, :9] = False
    session = ort.InferenceSession(str(tmp_path / "view_selector_24.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"ids": ids.numpy(), "pad_mask": pad.numpy()})[0]
    with torch.no_grad():
        want = spec.module(ids, pad).numpy()
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
