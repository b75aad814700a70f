"""Token selector stage and FastV baseline on the tiny checkpoint, each against an independent
from-scratch reference: greedy answers recomputed without any cache reuse over exactly the rows
that should be there, and the selector's scores recomputed in float64 from the layer's weights."""

import math

import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.decoding.greedy import greedy as greedy_decode
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.pipeline import Pipeline, assemble_prompt, encode, prompt_ids, select_tokens
from litevlm_runtime.stages.fastv import FastV
from litevlm_runtime.stages.token_selector import kept_count

MAX_NEW = 6
QUESTION = "Is there a pedestrian behind the ego car?"


@pytest.fixture(scope="module")
def base(tiny_model):
    return Pipeline.from_pretrained(tiny_model, options(max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def frames():
    return random_frames(11)


def full_prompt(pipe, frames, question):
    """(full prompt ids, camera spans, embeddings [N, D] with every visual token) built from scratch."""
    rt = pipe.rt
    ids, spans = prompt_ids(rt, list(CAMERAS), question)
    _, pixels = pipe.reference_inputs(frames, question)
    visual = rt.model.encode_images(pixels, rt.pos_embed).reshape(len(CAMERAS), -1, rt.cfg.llm.hidden_size)
    emb = rt.lm.embed(torch.tensor(ids))
    for c, (s, n) in enumerate(spans):
        emb[s:s + n] = visual[c]
    return ids, spans, emb


def run_scratch(lm, x, positions, layers=None, probe=None, norm=True):
    """Layers `layers` (default all) over x with no cache and a plain causal mask; the final norm
    only when `norm`."""
    t = x.shape[0]
    out, _, _ = lm.run_layers(x, positions, torch.ones(t, t, dtype=torch.bool).tril(), layers=layers, probe=probe)
    return lm.norm(out) if norm else out


@torch.inference_mode()
def reference_answer(pipe, frames, question, keep=None, max_new=MAX_NEW):
    """Greedy answer over [text, kept visual tokens at their original positions], every step a
    fresh full forward (no cache)."""
    lm = pipe.rt.lm
    ids, spans, emb = full_prompt(pipe, frames, question)
    dropped = set()
    if keep is not None:
        for (s, n), k in zip(spans, keep):
            dropped |= set(range(s, s + n)) - {s + int(i) for i in k}
    rows = torch.tensor([r for r in range(len(ids)) if r not in dropped])
    x, pos, out = emb[rows], rows, []
    for t in range(max_new):
        nxt = int(lm.head(run_scratch(lm, x, pos)[-1:]).argmax(-1))
        if nxt in pipe.rt.tok.eos_ids:
            break
        out.append(nxt)
        x = torch.cat([x, lm.embed(torch.tensor([nxt]))])
        pos = torch.cat([pos, torch.tensor([len(ids) + t])])
    return out


def test_keep_all_is_the_plain_pipeline(base, tiny_model, frames):
    ans = base.answer(frames, QUESTION)
    assert base.rt.token_selector is None
    assert ans.kept_tokens == ans.visual_tokens == 6 * base.rt.tokens_per_camera
    assert ans.token_ids == reference_answer(base, frames, QUESTION)
    # An explicit 1.0 with a selector named is still "keep everything", no selector stage.
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=MAX_NEW, tokens__keep_ratio=1.0,
                                                     tokens__mode="layer0"))
    assert p.rt.token_selector is None and p.answer(frames, QUESTION).token_ids == ans.token_ids


@pytest.mark.parametrize("ratio, scope", [(0.5, "camera"), (0.8, "camera"), (0.3, "global")])
def test_pruned_prompt_counts_order_positions_and_answer(tiny_model, frames, ratio, scope):
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=MAX_NEW, tokens__mode="layer0",
                                                     tokens__keep_ratio=ratio, tokens__scope=scope))
    ans = p.answer(frames, QUESTION)
    rt = p.rt
    per_cam = rt.tokens_per_camera
    expected = 6 * kept_count(per_cam, ratio) if scope == "camera" else kept_count(6 * per_cam, ratio)
    assert ans.kept_tokens == expected
    ids, spans = prompt_ids(rt, list(CAMERAS), QUESTION)
    assert ans.input_tokens == len(ids) - (6 * per_cam - expected)

    # The keep of this answer, recomputed from the arena's full prompt (same stage, same inputs).
    with torch.inference_mode():
        layout = assemble_prompt(rt, list(CAMERAS), QUESTION, rt.arena.visual[:6].view(6, per_cam, -1))
        keep = select_tokens(rt, layout)
    assert sum(len(k) for k in keep) == expected
    for k in keep:
        assert torch.equal(k, torch.unique(k)), "kept indices must be sorted and distinct"
        assert len(k) == 0 or (int(k.min()) >= 0 and int(k.max()) < per_cam)
        if scope == "camera":
            assert len(k) == kept_count(per_cam, ratio)
    # Prefill rows: text rows and kept visual rows at their original position ids, in order.
    n = ans.input_tokens
    positions = rt.arena.positions[:n].tolist()
    visual_positions = sorted(s + int(i) for (s, _), k in zip(spans, keep) for i in k)
    visual_set = {r for s, c in spans for r in range(s, s + c)}
    assert positions == sorted(positions)
    assert [q for q in positions if q in visual_set] == visual_positions
    assert [q for q in positions if q not in visual_set] == [r for r in range(len(ids)) if r not in visual_set]
    # And the answer is the from-scratch greedy answer over exactly those rows.
    assert ans.token_ids == reference_answer(p, frames, QUESTION, keep)


def float64_scores(selector, emb, question, visual_rows, reduce):
    """The selector's scores from its layer's weights, in float64 (InternLM2 packed wqkv)."""
    layer, cfg = selector.layer, selector.cfg
    q_start, q_end = question
    x = emb[:q_end].double()
    g = layer.attention_norm.weight.double()
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * g
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // hkv
    packed = (xn @ layer.attention.wqkv.weight.double().T).view(q_end, hkv, group + 2, hd)
    q = packed[:, :, :group].reshape(q_end, hq, hd)
    k = packed[:, :, group]
    inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(q_end, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    per_head = []
    for h in range(hq):
        logits = q[q_start:, h] @ k[:, h // group].T / math.sqrt(hd)          # [Tq, T]
        i = torch.arange(q_start, q_end)[:, None]
        logits = logits.masked_fill(torch.arange(q_end)[None] > i, float("-inf"))
        per_head.append(torch.softmax(logits, -1))
    probs = torch.stack(per_head).mean(0)[:, visual_rows]                          # [Tq, V]
    return probs.max(0).values if reduce == "max" else probs.mean(0)


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_selector_scores_equal_float64_recomputation(tiny_model, frames, reduce):
    """Tolerance: float32 scores within 1e-5 relative (+1e-7 absolute) of float64; the kept set is
    the float64 top-k."""
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2, tokens__mode="layer0", tokens__keep_ratio=0.5,
                                                     tokens__reduce=reduce))
    rt = p.rt
    assert rt.token_selector.reduce == reduce
    with torch.inference_mode():
        _, pixels = p.reference_inputs(frames, QUESTION)
        visual = encode(rt, pixels)
        layout = assemble_prompt(rt, list(CAMERAS), QUESTION, visual)
        emb = rt.arena.prompt_embeds[:layout.length].clone()
        rows = torch.cat([torch.arange(s, s + c) for s, c in layout.spans])
        got = rt.token_selector.scores(emb, torch.arange(layout.length), layout.question, rows)
        want = float64_scores(rt.token_selector, emb, layout.question, rows, reduce)
        keep = select_tokens(rt, layout)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    offset = 0
    for (_, count), k in zip(layout.spans, keep):
        top = want[offset:offset + count].topk(len(k)).indices.sort().values
        assert torch.equal(k, top)
        offset += count
    # The question rows are the question's own tokens.
    q0, q1 = layout.question
    assert rt.tok.decode(rt.arena.prompt_ids[q0:q1].tolist()).strip() == QUESTION


def test_the_selector_is_its_own_copy(base):
    from litevlm_runtime.stages.token_selector import TokenSelector

    sel = TokenSelector.from_decoder(base.rt.lm)
    with torch.no_grad():
        sel.layer.attention.wqkv.weight.add_(1.0)
    assert not torch.equal(sel.layer.attention.wqkv.weight, base.rt.lm.layers[0].attention.wqkv.weight)


def test_fastv_drop_zero_equals_baseline(tiny_model, base, frames):
    hidden = {}

    def capture(name):
        def decode(rt, q, prompt, max_new, on_tokens=None):
            hidden[name] = prompt.hidden.clone()
            return greedy_decode(rt, q, prompt, max_new, on_tokens)
        return decode

    ref = base.answer(frames, QUESTION, decoder=capture("base"))
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=MAX_NEW))
    rt = p.rt
    rt.fastv = FastV(rt.lm, rt.arena, k=1, drop_ratio=0.0)   # the split forward and per-layer masks, nothing dropped
    rt.engines.decoder = rt.fastv
    ans = p.answer(frames, QUESTION, decoder=capture("fastv"))
    assert ans.token_ids == ref.token_ids
    assert ans.kept_tokens == ref.kept_tokens and ans.input_tokens == ref.input_tokens
    torch.testing.assert_close(hidden["fastv"], hidden["base"], rtol=0, atol=1e-6)


@torch.inference_mode()
def fastv_reference(pipe, frames, question, k_layer, drop, max_new=MAX_NEW):
    """FastV from scratch: layers < K over every row, rank by the last prompt row's layer K-1
    attention (explicit per-head softmax), layers >= K over kept + generated rows only, every step
    recomputed with fresh caches and plain causal masks."""
    lm = pipe.rt.lm
    ids, spans, emb = full_prompt(pipe, frames, question)
    n = len(ids)
    captured = {}

    def probe(layer, q, k):
        if layer == k_layer - 1:
            captured["q"], captured["k"] = q[-1], k
    run_scratch(lm, emb, torch.arange(n), layers=range(0, k_layer), probe=probe, norm=False)
    q, k = captured["q"], captured["k"]
    group = q.shape[0] // k.shape[1]
    att = torch.stack(
        [torch.softmax(k[:, h // group] @ q[h] / math.sqrt(q.shape[-1]), -1) for h in range(q.shape[0])]
    ).mean(0)
    visual = torch.cat([torch.arange(s, s + c) for s, c in spans])
    n_keep = kept_count(len(visual), 1 - drop)
    kept_visual = set(visual[att[visual].topk(n_keep).indices].tolist())
    upper_rows = [r for r in range(n) if r not in set(visual.tolist()) or r in kept_visual]
    x, out = emb, []
    for t in range(max_new):
        m = x.shape[0]
        lower = run_scratch(lm, x, torch.arange(m), layers=range(0, k_layer), norm=False)
        rows = torch.tensor(upper_rows + list(range(n, m)))
        h = run_scratch(lm, lower[rows], rows, layers=range(k_layer, len(lm.layers)))
        nxt = int(lm.head(h[-1:]).argmax(-1))
        if nxt in pipe.rt.tok.eos_ids:
            break
        out.append(nxt)
        x = torch.cat([x, lm.embed(torch.tensor([nxt]))])
    return out, n_keep, len(upper_rows)


@pytest.mark.parametrize("drop", [0.5, 0.75])
def test_fastv_equals_from_scratch_reference(tiny_model, frames, drop):
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=MAX_NEW, fastv__k=1, fastv__ratio=drop))
    ans = p.answer(frames, QUESTION)
    want, n_keep, rows = fastv_reference(p, frames, QUESTION, 1, drop)
    assert ans.kept_tokens == n_keep == kept_count(6 * p.rt.tokens_per_camera, 1 - drop)
    assert ans.input_tokens == rows
    assert ans.token_ids == want
    # A second question on the same pipeline resets the dropped set (no leak between queries).
    q2 = "What should the ego vehicle do?"
    assert p.answer(frames, q2).token_ids == fastv_reference(p, frames, q2, 1, drop)[0]


def test_bad_options(tiny_model):
    for opts, msg in [(dict(tokens__keep_ratio=-0.1), "tokens.keep_ratio: -0.1 is below"),
                      (dict(tokens__keep_ratio=1.5), "tokens.keep_ratio: 1.5 is above"),
                      (dict(tokens__mode="layer0", tokens__scope="tile"), "tokens.scope"),
                      (dict(tokens__mode="layer0", tokens__reduce="median"), "tokens.reduce"),
                      (dict(fastv__ratio=0.5, fastv__k=2), "fastv.k must lie in"),
                      (dict(fastv__ratio=1.0, fastv__k=1), "fastv.ratio: 1.0 is above")]:
        with pytest.raises(InputError, match=msg):
            Pipeline.from_pretrained(tiny_model, options(**opts))


def test_eagle_after_token_selection_is_lossless(tiny_model, tmp_path, frames):
    """EAGLE-2 reads the prefill's compacted rows (embeddings, features, original positions): its
    greedy output under token selection equals plain greedy under the same selection."""
    from litevlm_runtime.models.eagle import DraftHead
    from litevlm_runtime.weights.checkpoint import read_config
    from litevlm_runtime.weights.draft_head import save_draft_head

    torch.manual_seed(0)
    save_draft_head(DraftHead(read_config(tiny_model).llm), tmp_path / "eagle", {"test": True})
    opts = dict(max_new_tokens=12, tokens__mode="layer0", tokens__keep_ratio=0.5)
    greedy = Pipeline.from_pretrained(tiny_model, options(**opts))
    eagle = Pipeline.from_pretrained(tiny_model, options(**opts, decoding__mode="eagle",
                                                         decoding__draft_dir=str(tmp_path / "eagle"),
                                                         decoding__eagle__policy="fixed", decoding__eagle__total=12,
                                                         decoding__eagle__depth=4, decoding__eagle__topk=3))
    for q in (QUESTION, "What should the ego vehicle do?"):
        a, b = greedy.answer(frames, q), eagle.answer(frames, q)
        assert b.kept_tokens == a.kept_tokens < a.visual_tokens
        assert b.token_ids == a.token_ids
