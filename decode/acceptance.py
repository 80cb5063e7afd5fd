"""Verification outcomes: greedy matching, speculative sampling, and the shared stop rule.

A round verifies V = [t, d1 .. d(B-1)]. The target returns, for each row i of V, its choice p(i) for
the next position (greedy) or its distribution (sampling). The round commits d1 .. da and a bonus b,
so it adds a + 1 tokens. The stop rule then truncates those committed tokens at the first stop id
or at `max_new_tokens`; after truncation the round's acceptance is redefined as (committed - 1) and
b as the last committed token, so that a + 1 always equals the tokens the round added and a replayed
trajectory (which ends at the stop) gives the same a as the live target.
"""

from dataclasses import dataclass

import torch

from models.transfer import upload


@dataclass(frozen=True)
class StopRule:
    """When decoding ends: after `max_new_tokens` generated tokens or at a stop id (kept in the output)."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()

    def truncate(self, committed: list[int], generated: int) -> tuple[list[int], bool]:
        """Cut `committed` (tokens a round adds) at the first stop id or the token limit.

        Args:
            committed: tokens the round would add, in order.
            generated: tokens generated before this round.

        Returns:
            (kept tokens, whether decoding is finished).
        """
        room = self.max_new_tokens - generated
        for i, token in enumerate(committed[:room]):
            if token in self.stop_ids:
                return committed[: i + 1], True
        kept = committed[:room]
        return kept, len(kept) == room

    def replayed(self, recorded: list[int]) -> list[int] | None:
        """The output a greedy decoder under this rule produces, given the target's greedy output `recorded`
        under some other cap (by this tool or another engine): `recorded` cut at its first stop id or at
        `max_new_tokens`. None when `recorded` cannot tell: it ends before the cap at a token that is not a
        stop id (recorded with a smaller cap, or another engine's stop ids)."""
        kept, finished = self.truncate(list(recorded), 0)
        return kept if finished else None


def greedy_outcome(drafts: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """(a, b) for greedy verification.

    Args:
        drafts: d1 .. d(B-1).
        target_tokens: p(0) .. p(B-1), the target's argmax after t, d1, ... ; only p(0) .. p(a) are read,
            so a replay may fill later entries with -1.
    """
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]:
        a += 1
    return a, target_tokens[a]


def sampled_outcome(drafts: list[int], target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """(a, b) by speculative sampling with deterministic (argmax) drafts.

    With a one-hot proposal q, accepting d with probability min(1, p/q) is accepting with probability
    p(d), and the residual norm(max(0, p - q)) is p with d removed, renormalised. The committed tokens
    are then distributed exactly as the target's own samples.

    Args:
        drafts: d1 .. d(B-1).
        target_probs: float Tensor `(B, vocab)`, row i = target distribution after row i of V, on any
            device: the drafts' probabilities come to the host in one read, and only the one row a token is
            sampled from is copied (`generator` is a CPU generator, so draws are the same on every device).
    """
    accept = []
    if drafts:
        index = upload(torch.tensor([list(range(len(drafts))), list(drafts)], dtype=torch.long), target_probs.device)
        accept = target_probs[index[0], index[1]].tolist()
    for i, (draft, p_draft) in enumerate(zip(drafts, accept)):
        if torch.rand((), generator=generator).item() < p_draft:
            continue
        residual = target_probs[i].clone()
        residual[draft] = 0.0
        return i, _sample(residual, generator)
    return len(drafts), _sample(target_probs[len(drafts)], generator)


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    weights = weights.cpu()  # the generator is a CPU one; a no-op for CPU weights
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator).item())


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability vector `(vocab,)` on any device (drawn on the CPU)."""
    return _sample(probs, generator)
