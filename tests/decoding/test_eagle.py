"""EAGLE-2: greedy speculative decoding is lossless (token for token equal to plain greedy), the
draft tree is well formed, and distillation raises the mean accepted length."""

import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.decoding.greedy import QueryDecoding
from litevlm_runtime.models.eagle import DraftHead
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.training.eagle import Sequence, collect, draft_loss, mean_accepted_length
from litevlm_runtime.weights.checkpoint import load_model
from litevlm_runtime.weights.draft_head import load_draft_head, save_draft_head
from litevlm_runtime.weights.tokenizer import Tokenizer

TREES = [dict(decoding__eagle__total=60, decoding__eagle__depth=6, decoding__eagle__topk=10),
         dict(decoding__eagle__total=12, decoding__eagle__depth=4, decoding__eagle__topk=3),
         dict(decoding__eagle__total=1, decoding__eagle__depth=2, decoding__eagle__topk=1)]


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A tiny target and a draft distilled from it for a few epochs (enough to accept > 1 token)."""
    torch.manual_seed(0)
    model = load_model(tiny_model)
    draft = DraftHead(model.cfg.llm)
    pipe = Pipeline.from_model(model, Tokenizer(tiny_model), options(max_new_tokens=24, decoding__mode="eagle",
                                                                     decoding__eagle__policy="fixed"), draft=draft)
    pairs = [(random_frames(s), DEFAULT_QUESTIONS[s % len(DEFAULT_QUESTIONS)]) for s in range(16)]
    seqs = [
        Sequence(*(t.clone() for t in (s.embeds, s.features, s.positions, s.text_next))) for s in collect(pipe, pairs)
    ]
    held = [(random_frames(100 + s), DEFAULT_QUESTIONS[(s + 3) % len(DEFAULT_QUESTIONS)]) for s in range(6)]
    before = mean_accepted_length(pipe, held)
    opt = torch.optim.AdamW(draft.parameters(), lr=2e-3)
    for p in pipe.rt.lm.parameters():
        p.requires_grad_(False)
    draft.train()
    losses = []
    for epoch in range(3):
        for seq in seqs:
            loss, _, _ = draft_loss(draft, pipe.rt.lm.head, seq, 0.05)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    draft.eval()
    after = mean_accepted_length(pipe, held)
    folder = tmp_path_factory.mktemp("eagle") / "eagle"
    save_draft_head(draft, folder, {"test": True})
    return {"dir": folder, "before": before, "after": after, "losses": losses}


def test_distillation_improves_acceptance(trained):
    first, last = sum(trained["losses"][:16]) / 16, sum(trained["losses"][-16:]) / 16
    assert last < first
    assert trained["after"] > trained["before"] + 0.3, (trained["before"], trained["after"])


@pytest.mark.parametrize("tree", TREES, ids=["60-6-10", "12-4-3", "1-2-1"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_eagle_is_lossless(tiny_model, trained, tree, policy):
    greedy = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=24))
    eagle = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=24, decoding__mode="eagle",
                                                         decoding__draft_dir=str(trained["dir"]),
                                                         decoding__eagle__policy=policy, **tree))
    accepted = []
    for s in range(6):
        frames, q = random_frames(200 + s), DEFAULT_QUESTIONS[s % len(DEFAULT_QUESTIONS)]
        a, b = greedy.answer(frames, q), eagle.answer(frames, q)
        assert b.token_ids == a.token_ids, f"question {s}: EAGLE-2 output differs from greedy"
        assert b.decode_steps <= a.decode_steps
        accepted.append(b.accepted_length)
    if tree["decoding__eagle__total"] > 1 and policy == "fixed":
        assert max(accepted) > 1.5     # the tree path (KV compaction) was really exercised


def test_tree_is_ancestor_closed(tiny_model, trained):
    from litevlm_runtime.decoding.speculative import Eagle2, tree_ancestors

    pipe = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=8, decoding__mode="eagle",
                                                        decoding__draft_dir=str(trained["dir"]),
                                                        decoding__eagle__policy="fixed", decoding__eagle__total=20,
                                                        decoding__eagle__depth=5, decoding__eagle__topk=4))
    rt = pipe.rt
    pipe.answer(random_frames(7), "What is ahead?")       # fills the caches
    p = 50
    with torch.inference_mode():
        hidden = torch.randn(1, rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(0))
        tree = Eagle2(rt, QueryDecoding.greedy(rt), rt.costs.policy(rt.options.decoding.eagle)).build_tree(
            hidden, 5, p, p, 8
        )
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    assert len(tokens) == 21 and parents[0] == -1 and tokens[0] == 5
    for i, parent in enumerate(parents[1:], start=1):
        assert 0 <= parent < i                              # parents come first (closure + order)
        assert depths[i] == depths[parent] + 1
    siblings = {}
    for i, parent in enumerate(parents[1:], start=1):
        siblings.setdefault(parent, []).append(tokens[i])
    assert all(len(v) == len(set(v)) for v in siblings.values())   # no duplicate child tokens
    anc = tree_ancestors(tree.parents, tree.depths, 5)       # against a walk up the parent pointers
    for i in range(len(tokens)):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            chain.add(j)
        assert set(anc[i].nonzero().flatten().tolist()) == chain


def test_draft_head_checkpoint_errors(tiny_model, trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from litevlm_runtime.errors import CheckpointError
    from litevlm_runtime.weights.checkpoint import read_config

    cfg = read_config(tiny_model).llm
    state = load_file(trained["dir"] / "model.safetensors")
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(state, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_draft_head(bad, cfg, None, torch.float32)
    with pytest.raises(Exception, match="decoding.mode eagle: no model.safetensors"):
        Pipeline.from_pretrained(
            tiny_model, options(decoding__mode="eagle", decoding__draft_dir=str(tmp_path / "none"))
        )
