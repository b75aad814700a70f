"""What the adaptive speculation policy (decoding/spec_policy.py) does with measured costs, as rows
of a report (`litevlm bench --costs`, and the latency table when costs were measured at warm-up):
whether drafting can pay, the realised speeds, the best chain, and the tree it keeps for a
reference confidence profile."""

from __future__ import annotations

import torch

from ..decoding.spec_policy import TreePolicyState


def policy_choice(costs, tree) -> list[list]:
    """What the adaptive policy does with these costs: whether it drafts at all, the best chain a
    perfect draft could make, and the tree it keeps for a reference confidence profile (a draft
    whose best child has p 0.6, the next 0.15, 0.05, ...; EAGLE-2's confidences look like this)."""
    rate, depth = costs.best_chain_rate(tree.depth)
    pol = TreePolicyState(costs, tree.total, tree.depth, tree.topk, adaptive=True)
    profile = torch.log(torch.tensor([0.6, 0.15, 0.05] + [0.02] * (tree.topk - 3))[:tree.topk])
    levels, scores, frontier = 1, profile, profile
    pol.spent_ms = costs.pending(2)
    while levels < tree.depth and pol.expand(scores, frontier, levels):
        frontier = (frontier[:, None] + profile[None]).flatten().topk(tree.topk).values
        scores = torch.cat([scores, frontier])
        levels += 1
    total = pol.choose_total(scores, tree.total)
    return [
        [
            "a perfect draft could pay here",
            "yes" if costs.speculation_can_pay(tree.depth) else "no (a plain step is faster)",
        ],
        ["realised speed of rounds", f"{costs.speed:.2f} x a plain step over {costs.rounds} rounds"],
        ["realised speed of answers", answer_speed_line(costs)],
        ["best perfectly-accepted chain", f"depth {depth}: {rate * costs.step_ms:.2f} tokens per plain step"],
        ["tree for the reference profile", f"depth {levels}, {total + 1} nodes verified"],
        ["round overhead beyond the models", f"{costs.overhead_ms:.2f} ms (learned online)"],
    ]


def answer_speed_line(costs) -> str:
    speed = costs.answer_speed()
    counts = f"{costs.answers['eagle']} speculative, {costs.answers['greedy']} greedy answers"
    if speed is None:
        return f"learning ({counts}; alternating)"
    verdict = "speculating" if speed >= 1 else f"greedy, probing 1 answer in {costs.probe_every}"
    return f"{speed:.2f}x greedy's tokens per ms, whole answers ({counts}): {verdict}"
