"""Which candidate successor blocks the async decoder drafts in its packed pass.

After round k's draft V = [t, d1 .. d(B-1)], the outcome is (a, b). For a < B-1 the bonus b is unknown
but differs from d(a+1), so a candidate is (a, g): an explicit guess g at the position of d(a+1), taken
from the drafter's next-best ids at that slot. For a = B-1 one mask-anchored candidate drafts b in its
first slot. Probabilities come from the drafter's own confidences c_i (probability of d_i):

    P(reach a)           = c_1 * ... * c_a
    value of (a, g)      = P(reach a) * q_{a+1}(g)      (= P(a) * P(b = g | a) with renormalised q)
    value of all-accept  = c_1 * ... * c_(B-1)

Candidates are taken greedily by value (ties: smaller a, then better rank) while their tokens fit the
budget; a rejection candidate costs S + 1 query tokens (guess + S mask slots, S the drafter's block
size), the all-accepted one S. B is the verified block size, at most S.
Only drafter outputs enter (and, through `keep`, the cost model's rounded time ratios, fixed for a run),
so a replay makes the same choices.
"""

from dataclasses import dataclass

ALL_ACCEPTED = None  # the guess of the mask-anchored all-accepted candidate


@dataclass(frozen=True)
class Candidate:
    """A candidate successor block: outcome `accepted` (a) and the guessed bonus (None for a = B-1)."""

    accepted: int
    guess: int | None


def plan_candidates(
    confidences: list[float],
    alternatives: list[list[tuple[int, float]]],
    block_size: int,
    budget_tokens: int,
    max_fan_out: int,
    slots: int | None = None,
    keep=None,
) -> list[Candidate]:
    """Choose the candidates of one packed pass.

    Args:
        confidences: c_1 .. c_(B-1), the drafter's probability of each draft d_1 .. d_(B-1).
        alternatives: per draft slot, (id, probability) pairs excluding the draft, best first.
        budget_tokens: query tokens available for candidate blocks (the chain is not counted).
        max_fan_out: at most this many guesses per outcome.
        slots: mask slots per drafted block (the drafter's block size; default `block_size`).
        keep: optional callable(values, costs) -> k that keeps the k best of the candidates that fit
            (their values and query-token costs, best first), e.g. decode.cost.CandidatePolicy.

    Returns:
        The chosen candidates sorted by (accepted, guess rank), the all-accepted one last.
    """
    slots = slots or block_size
    options = []  # (value, accepted, rank, guess, cost)
    reach = 1.0
    for a in range(block_size - 1):
        for rank, (token, prob) in enumerate(alternatives[a][:max_fan_out]):
            options.append((reach * prob, a, rank, token, slots + 1))
        reach *= confidences[a]
    options.append((reach, block_size - 1, 0, ALL_ACCEPTED, slots))
    options.sort(key=lambda option: (-option[0], option[1], option[2]))
    chosen, left = [], budget_tokens
    for value, a, rank, token, cost in options:
        if value > 0 and cost <= left:
            chosen.append((value, cost, (a, rank, token)))
            left -= cost
    if keep is not None:
        chosen = chosen[: keep([value for value, _, _ in chosen], [cost for _, cost, _ in chosen])]
    chosen = sorted(candidate for _, _, candidate in chosen)
    return [Candidate(a, token) for a, _, token in chosen]
