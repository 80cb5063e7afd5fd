"""Summaries of decoder results (docs/design.md, Decoders).

tau = mean acceptance length (a + 1) per drafting round: rounds that the speculation gate ran as plain target
steps (decode.gate) are left out of tau, the verify width and the acceptance histogram, and counted in
`gated_share` instead; speed counts every round. `tau_macro` averages per-prompt means (DFlash's
convention), `tau_micro` pools every round. Time per token is total decode time over total timed tokens
(an aggregate, i.e. throughput-weighted), and speedup is the AR time per token over the decoder's,
both measured on the same prompts.
"""

import math
from statistics import mean

from .decoders import DecodeResult


def paired_ratio_error(numerators: list[float], denominators: list[float]) -> float:
    """Standard error of mean(numerators) / mean(denominators), the two measured on the same prompts (paired;
    delta method): 0.0 with fewer than two prompts. A held-out tau retention (candidate over base taus) and a
    measured speedup (ar's decode times over a decoder's) are such ratios."""
    n = len(denominators)
    if n < 2 or len(numerators) != n or sum(denominators) <= 0:
        return 0.0
    mean_denominator = sum(denominators) / n
    ratio = sum(numerators) / n / mean_denominator
    variance = sum((a - ratio * b) ** 2 for a, b in zip(numerators, denominators)) / (n - 1)
    return math.sqrt(variance / n) / mean_denominator


def tau_per_prompt(results: list[DecodeResult]) -> list[float]:
    """Mean (a + 1) per prompt over its drafting rounds; prompts without any are left out."""
    drafting = [[rnd.accepted for rnd in r.rounds if rnd.drafted] for r in results]
    return [mean(a + 1 for a in accepted) for accepted in drafting if accepted]


def summarize(results: list[DecodeResult], block_size: int | None) -> dict:
    """Aggregate metrics of one decoder over prompts (JSON-ready; times in ms)."""
    every_round = [rnd for r in results for rnd in r.rounds]
    rounds = [rnd for rnd in every_round if rnd.drafted]
    tokens = sum(r.timed_tokens for r in results)
    decode_s = sum(r.decode_s for r in results)
    per_prompt = tau_per_prompt(results)
    summary = {
        "prompts": len(results),
        "rounds": len(every_round),  # target passes after prefill, gated ones included
        "output_tokens": sum(len(r.output_ids) for r in results),
        "tau_macro": mean(per_prompt) if per_prompt else None,
        "tau_micro": mean(rnd.accepted + 1 for rnd in rounds) if rounds else None,
        "tau_per_prompt": per_prompt,
        "tokens_per_s": tokens / decode_s if decode_s > 0 else None,
        "time_per_token_ms": 1000 * decode_s / tokens if tokens else None,
        # Wall time of one round (ar: one step), the unit the cost model predicts (decode/cost.py round_ms).
        "round_ms": 1000 * decode_s / len(every_round) if every_round and decode_s > 0 else None,
        # The same for the drafting rounds alone (each round's own wall time): what a drafter's passes cost.
        "drafting_round_ms": 1000 * mean(rnd.total_s for rnd in rounds) if rounds and decode_s > 0 else None,
        "decode_s": decode_s,
        "prefill_s": sum(r.prefill_s for r in results),
        "verify_width_mean": mean(rnd.width for rnd in rounds) if rounds else None,
    }
    if results and results[0].decoder != "ar":
        summary["gated_share"] = 1.0 - len(rounds) / len(every_round) if every_round else None
    if block_size is not None and results and results[0].decoder != "ar":
        histogram = [0] * block_size
        for rnd in rounds:
            histogram[rnd.accepted] += 1
        summary["acceptance_histogram"] = histogram
        # alpha_i = P(a >= i | a >= i - 1), i = 1 .. B-1: how often draft i is accepted once reached.
        reached = [sum(histogram[i:]) for i in range(block_size)]
        summary["per_position_acceptance"] = [
            reached[i] / reached[i - 1] if reached[i - 1] else None for i in range(1, block_size)
        ]
    if results and results[0].decoder == "async":
        summary.update(_async_summary(rounds, block_size))
    return summary


def _async_summary(rounds, block_size: int) -> dict:
    judged = [rnd for rnd in rounds if rnd.hit is not None]
    by_outcome = {}
    for a in range(block_size):
        outcome = [rnd.hit for rnd in judged if rnd.accepted == a]
        if outcome:
            by_outcome[str(a)] = {"rounds": len(outcome), "hit_rate": sum(outcome) / len(outcome)}
    n = len(rounds) or 1
    packed = [r.packed_tokens for r in rounds if r.packed_tokens]  # rounds that ran a packed pass
    split = {
        "verify": sum(r.verify_s for r in rounds),
        "packed": sum(r.draft_s for r in rounds),
        "overlap": sum(r.overlap_s for r in rounds),
        "fallback": sum(r.fallback_s for r in rounds),
        "round_total": sum(r.total_s for r in rounds),
    }
    # "other" is round time spent outside verify, the packed pass and fallback drafts (planning, bookkeeping).
    split["other"] = split["round_total"] - (split["verify"] + split["packed"] - split["overlap"] + split["fallback"])
    return {
        "hit_rate": sum(r.hit for r in judged) / len(judged) if judged else None,
        "hit_rate_by_outcome": by_outcome,
        "fallback_rate": sum(not r.hit for r in judged) / len(judged) if judged else None,
        "packed_tokens_mean": mean(r.packed_tokens for r in rounds) if rounds else None,
        # Rounds that ran a packed pass (decode.cost.CandidatePolicy may skip it) and its mean tokens.
        "packed_share": len(packed) / len(rounds) if rounds else None,
        "packed_pass_tokens_mean": mean(packed) if packed else None,
        "time_split_ms": {key: 1000 * value / n for key, value in split.items()},
        # The packed pass's share in flight while the target verified (decoders.Round.overlap_s: overlap
        # of wall-clock intervals, an upper bound on the work hidden, not a measure of it).
        "packed_hidden_fraction": split["overlap"] / split["packed"] if split["packed"] > 0 else None,
    }
