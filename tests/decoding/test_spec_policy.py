"""The speculation cost model's choices against hand-made cost tables (spec_policy.py): deep, wide
trees where verification is nearly free (a memory-bound GPU), small ones where it costs per row
(a compute-bound CPU), none where the draft costs as much as the target; the expected rate by
hand; backing off after a losing round; plain steps first while the prompt catch-up would cost
more than they do."""

import math
from types import SimpleNamespace

import pytest
import torch

from litevlm_runtime.decoding.spec_policy import DeviceCosts, TreePolicyState, interpolate


def gpu():      # memory-bound: 64 rows cost about one
    return DeviceCosts(verify_ms={1: 1.0, 64: 1.05}, draft_level_ms=0.1, pending_ms={1: 0.1, 8: 0.11})


def cpu():      # compute-bound past a few rows
    return DeviceCosts(verify_ms={1: 1.0, 2: 1.2, 4: 1.5, 8: 2.4, 16: 4.5, 64: 17.0}, draft_level_ms=0.12,
                       pending_ms={1: 0.12, 8: 0.9})


def shallow():  # a draft layer as dear as the whole target (a 1-layer target)
    return DeviceCosts(verify_ms={1: 1.0, 64: 1.1}, draft_level_ms=1.0, pending_ms={1: 1.0, 8: 1.1})


class Tree(SimpleNamespace):
    """What observe_round reads of a DraftTree."""

    def __len__(self):
        return len(self.scores)


def policy(costs, total=60, depth=6, topk=10):
    return TreePolicyState(costs, total, depth, topk, adaptive=True)


def logs(*p):
    return torch.log(torch.tensor(p, dtype=torch.float32))


def test_interpolation_and_extrapolation():
    t = {1: 1.0, 4: 4.0, 8: 6.0}
    assert interpolate(t, 1) == 1.0 and interpolate(t, 2) == pytest.approx(2.0)
    assert interpolate(t, 6) == pytest.approx(5.0) and interpolate(t, 16) == pytest.approx(10.0)
    assert interpolate({3: 2.5}, 100) == 2.5


def test_expected_rate_by_hand():
    pol = policy(cpu())
    pol.spent_ms = 0.5
    # T=1: 1.9 / (0.5 + 1.2) = 1.1176; T=2: 2.5 / (0.5 + 1.35) = 1.3514; T=3: 2.55 / (0.5 + 1.5) = 1.275
    rate, t = pol.expected_rate([0.9, 0.6, 0.05])
    assert t == 2 and rate == pytest.approx(2.5 / 1.85)
    pol.costs.calibration = 0.2                      # a draft that overstates itself: smaller trees
    # T=1: 1.18 / 1.7 = 0.694; T=2: 1.30 / 1.85 = 0.703; T=3: 1.31 / 2.0 = 0.655
    rate, t = pol.expected_rate([0.9, 0.6, 0.05])
    assert t == 2 and rate == pytest.approx(1.30 / 1.85)
    pol.costs.calibration = 0.1
    assert pol.expected_rate([0.9, 0.6, 0.05])[1] == 1


def test_free_verification_keeps_many_nodes_and_drafts_deep():
    pol = policy(gpu())
    scores = logs(*[0.8] + [0.05] * 9)             # one confident child, nine unlikely ones
    assert pol.expand(scores, scores, 1)            # another level is nearly free: draft it
    assert pol.choose_total(scores, 60) == 10       # verifying every candidate costs nothing extra


def test_compute_bound_verification_keeps_few_nodes():
    pol = policy(cpu())
    pol.spent_ms = 0.12
    scores = logs(*[0.8] + [0.05] * 9)
    assert pol.choose_total(scores, 60) == 1        # each extra row costs ~0.15 ms for 0.05 tokens
    assert pol.expand(scores, scores[:10], 1)       # the confident child's children may pay ...
    weak = logs(*[0.02] * 10)
    assert not policy(cpu()).expand(weak, weak, 1)  # ... unlikely ones never do


def test_no_tree_when_the_draft_costs_a_target_step():
    costs = shallow()
    assert not costs.speculation_can_pay(6)
    assert gpu().speculation_can_pay(6) and cpu().speculation_can_pay(6)
    assert not policy(costs).draft_now()
    rate, depth = costs.best_chain_rate(6)          # even a perfect chain: (d+1) / (pending + (d-1) + verify)
    assert rate < 1.0 / costs.step_ms and depth >= 1
    linear = DeviceCosts(verify_ms={1: 1.0, 8: 8.0}, draft_level_ms=0.01, pending_ms={1: 0.01})
    assert not linear.speculation_can_pay(6)        # verification linear in rows never pays


def test_plain_steps_first_while_the_prompt_catch_up_costs_more():
    costs = DeviceCosts(verify_ms={1: 1.0, 64: 1.05}, draft_level_ms=0.1, pending_ms={1: 0.1, 8: 0.5, 400: 3.2})
    pol = policy(costs)
    pol.start(400)
    assert pol.backoff == math.ceil(3.2 / 1.0)
    assert [pol.draft_now() for _ in range(5)] == [False, False, False, False, True]


def test_backoff_after_a_losing_round_then_probe_again():
    costs = cpu()
    pol = policy(costs)
    pol.spent_ms = 0.12
    tree = Tree(scores=logs(1.0, 0.01, 0.01, 0.01), depths=torch.tensor([0, 1, 1, 1]))
    pol.observe_round(tree, 0, 0.0, 0.0)
    assert pol.backoff == 1 and pol.next_backoff == 2
    assert not pol.draft_now() and pol.draft_now()
    pol.observe_round(tree, 0, 0.0, 0.0)
    assert pol.backoff == 2 and pol.next_backoff == 4
    assert costs.calibration < 1.0                  # predicted 0.03 tokens, got 0: calibration falls
    win = Tree(scores=logs(1.0, 0.9, 0.8), depths=torch.tensor([0, 1, 2]))
    pol.backoff = 0
    pol.observe_round(win, 2, 0.0, 0.0)
    assert pol.backoff == 0 and pol.next_backoff == 1


def test_fixed_policy_is_the_configured_tree():
    pol = TreePolicyState(shallow(), 12, 4, 3, adaptive=False)
    scores = logs(*[0.01] * 9)
    assert pol.draft_now() and pol.expand(scores, scores[:3], 1) and pol.choose_total(scores, 12) == 9


def test_answers_alternate_to_learn_then_decode_greedily_while_speculation_loses_then_probe():
    from litevlm_runtime.decoding.spec_policy import MIN_ANSWERS, PROBE_EVERY, PROBE_LIMIT

    costs = gpu()

    def answer(kind_if_eagle_ms, greedy_ms, tokens=10):
        eagle = costs.speculate_this_answer(6)
        costs.observe_answer("eagle" if eagle else "greedy", tokens, kind_if_eagle_ms if eagle else greedy_ms)
        return eagle

    learning = [answer(30.0, 10.0) for _ in range(2 * MIN_ANSWERS)]
    assert learning == [True, False] * MIN_ANSWERS                # both kinds measured, in turn
    assert costs.answer_speed() == pytest.approx(1 / 3)            # whole answers: 3x slower per token
    later = [answer(30.0, 10.0) for _ in range(PROBE_EVERY + 2 * PROBE_EVERY + 4 * PROBE_EVERY)]
    probes = [i for i, e in enumerate(later) if e]
    assert probes == [PROBE_EVERY - 1, 3 * PROBE_EVERY - 1, 7 * PROBE_EVERY - 1]   # losing probes: rarer
    assert costs.probe_every == min(8 * PROBE_EVERY, PROBE_LIMIT)
    # Speculation that wins is kept: after enough fast speculative answers it is on for every answer.
    costs.answer_ms["eagle"], costs.answer_tokens["eagle"] = 5.0, 10.0
    assert costs.answer_speed() == pytest.approx(2.0)
    assert all(costs.speculate_this_answer(6) for _ in range(5)) and costs.probe_every == PROBE_EVERY
    assert not shallow().speculate_this_answer(6)                  # a perfect chain cannot pay: never


def test_round_overhead_is_learned_and_counts_against_trees():
    costs = cpu()
    pol = policy(costs)
    pol.spent_ms = 0.12
    tree = Tree(scores=logs(1.0, 0.9), depths=torch.tensor([0, 1]))
    pol.observe_round(tree, 1, 0.0, (0.12 + 1.2 + 5.0) / 1000.0)     # 5 ms beyond the modelled cost
    assert costs.overhead_ms == pytest.approx(1.0)                   # EMA: 0.2 of 5 ms
    assert costs.speed < 1.0                                         # 2 tokens in 6.3 ms vs 1 per ms
    assert not shallow().speculation_can_pay(6)


def test_bench_reports_the_answer_level_decision():
    from litevlm_runtime.bench.policy import policy_choice
    from litevlm_runtime.decoding.spec_policy import MIN_ANSWERS
    from litevlm_runtime.options import EagleTree

    costs = cpu()
    rows = dict(policy_choice(costs, EagleTree()))
    assert rows["realised speed of answers"].startswith("learning (0 speculative, 0 greedy")
    for _ in range(MIN_ANSWERS):
        costs.observe_answer("eagle", 10, 20.0)
        costs.observe_answer("greedy", 10, 10.0)
    rows = dict(policy_choice(costs, EagleTree()))
    assert rows["realised speed of answers"].startswith("0.50x greedy's tokens per ms, whole answers")
    assert rows["realised speed of answers"].endswith("greedy, probing 1 answer in 8")
