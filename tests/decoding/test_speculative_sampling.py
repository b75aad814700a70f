"""Speculative sampling over a draft tree is exact: every emitted token is distributed as the
target's own sampling, whatever the draft proposes (checked by simulation against known
distributions; 20000 rounds, frequencies within 0.015 of the target probabilities, about 4
standard errors)."""

import torch
from helpers import random_frames

from litevlm_runtime.decoding.speculative import speculative_sample

V = 6


def dist(*w):
    t = torch.tensor(w, dtype=torch.float64)
    return t / t.sum()


P_ROOT = dist(5, 1, 3, 0.5, 2, 0.01)                  # target at the root
Q_ROOT = dist(1, 4, 1, 2, 0.2, 1)                     # a poor draft
P_CHILD = {t: dist(*(torch.roll(torch.tensor([4.0, 1, 1, 2, 0.3, 0.5]), t).tolist())) for t in range(V)}
Q_CHILD = {t: dist(*(torch.roll(torch.tensor([1.0, 3, 0.5, 1, 2, 1]), t).tolist())) for t in range(V)}


def one_round(gen, k_root=4, k_child=3):
    """Draw a tree as the sampling draft would (i.i.d. samples, duplicates merged), verify it."""
    tokens, parents, samples, q = [None], [-1], {}, {}
    samples[0] = torch.multinomial(Q_ROOT, k_root, replacement=True, generator=gen).tolist()
    q[0] = Q_ROOT
    children = {}
    for s in samples[0]:
        if (0, s) not in children:
            tokens.append(s), parents.append(0)
            node = len(tokens) - 1
            children[(0, s)] = node
            samples[node] = torch.multinomial(Q_CHILD[s], k_child, replacement=True, generator=gen).tolist()
            q[node] = Q_CHILD[s]
            for g in samples[node]:                   # grandchildren: leaves, never expanded
                if (node, g) not in children:
                    tokens.append(g), parents.append(node)
                    children[(node, g)] = len(tokens) - 1
    target = torch.zeros(len(tokens), V, dtype=torch.float64)
    for i, t in enumerate(tokens):
        if i == 0:
            target[i] = P_ROOT
        elif parents[i] == 0:
            target[i] = P_CHILD[t]
        else:
            target[i] = P_ROOT                         # any fixed distribution at the leaves
    path, nxt = speculative_sample(children, samples, q, target, gen)
    emitted = [tokens[i] for i in path[1:]] + [nxt]
    return emitted


def test_emitted_tokens_follow_the_target():
    gen = torch.Generator().manual_seed(1234)
    n = 20000
    first = torch.zeros(V, dtype=torch.float64)
    second = {t: torch.zeros(V, dtype=torch.float64) for t in range(V)}
    for _ in range(n):
        out = one_round(gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0]][out[1]] += 1
    assert (first / n - P_ROOT).abs().max() < 0.015, (first / n, P_ROOT)
    checked = 0
    for t in range(V):
        m = second[t].sum()
        if m > 2000:                                   # enough draws for a tight check
            assert (second[t] / m - P_CHILD[t]).abs().max() < 0.03, (t, second[t] / m, P_CHILD[t])
            checked += 1
    assert checked >= 2


def test_sampling_pipeline_runs_with_eagle(tiny_model, tmp_path):
    """Temperature sampling through the whole pipeline, with and without the draft tree."""
    from helpers import options

    from litevlm_runtime.models.eagle import DraftHead
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.weights.checkpoint import read_config
    from litevlm_runtime.weights.draft_head import save_draft_head

    torch.manual_seed(0)
    save_draft_head(DraftHead(read_config(tiny_model).llm), tmp_path / "eagle", {})
    for decoding in ("greedy", "eagle"):
        pipe = Pipeline.from_pretrained(tiny_model, options(
            max_new_tokens=12, decoding__mode=decoding, decoding__temperature=0.8, decoding__seed=3,
            decoding__draft_dir=str(tmp_path / "eagle"), decoding__eagle__policy="fixed",
            decoding__eagle__total=10, decoding__eagle__depth=3, decoding__eagle__topk=4))
        a = pipe.answer(random_frames(0), "What is ahead?")
        assert 1 <= len(a.token_ids) <= 12 and a.decode_steps >= 1
        assert pipe.answer(random_frames(0), "What is ahead?").token_ids == a.token_ids   # seeded per query
