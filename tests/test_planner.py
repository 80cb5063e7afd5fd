"""The async candidate planner spends its token budget on the likeliest outcomes, deterministically."""

from decode.planner import Candidate, plan_candidates


def test_confident_drafts_favour_the_all_accepted_candidate():
    plan = plan_candidates([0.99] * 3, [[(50, 0.005)]] * 3, block_size=4, budget_tokens=4, max_fan_out=1)
    assert plan == [Candidate(3, None)]


def test_unsure_first_slot_favours_early_rejection_guesses():
    confidences = [0.2, 0.9, 0.9]
    alternatives = [[(10, 0.5), (11, 0.2)], [(12, 0.05)], [(13, 0.05)]]
    plan = plan_candidates(confidences, alternatives, block_size=4, budget_tokens=10, max_fan_out=2)
    # Values: (0,10)=0.5, (0,11)=0.2, (1,12)=0.01, ... all-accepted=0.162; budget fits two blocks of 5.
    assert plan == [Candidate(0, 10), Candidate(0, 11)]


def test_budget_and_fan_out_are_respected_and_order_is_stable():
    confidences = [0.5] * 7
    alternatives = [[(100 + a, 0.3), (200 + a, 0.1), (300 + a, 0.05)] for a in range(7)]
    plan = plan_candidates(confidences, alternatives, block_size=8, budget_tokens=40, max_fan_out=2)
    assert sum(9 if c.guess is not None else 8 for c in plan) <= 40
    assert all(c.guess is None or c.guess < 300 for c in plan)
    assert plan == sorted(plan, key=lambda c: (c.accepted, c.guess is None))
    assert plan == plan_candidates(confidences, alternatives, 8, 40, 2)


def test_zero_budget_plans_nothing():
    assert plan_candidates([0.9] * 3, [[(1, 0.1)]] * 3, 4, 0, 3) == []
