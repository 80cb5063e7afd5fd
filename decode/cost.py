"""The one cost model: time per token of the ar, sync and async decoders from measured pass times.

Inputs are wall times (ms) of single passes measured on the device that decodes (decode/timing.py):

    ar_ms          a target pass of one token (an ar step)
    verify_ms(W)   a target pass of W tokens, modelled as ar_ms + step_ms + per_token_ms x (W - 1) for W >= 2:
                   a CPU runs a one-token step on its matrix-vector path, and any wider pass on its
                   matrix-matrix path, which costs a step more (measured on 2 AVX-512 cores with the demo
                   target: 43 ms at one token, 59 / 64 / 77 / 92 ms at 2 / 4 / 8 / 16)
    draft_ms       a drafter pass that drafts one block (sync draft, async fallback)
    packed_ms      the async packed pass (chain + candidate blocks)
    contention     how much of the shorter pass the concurrent async round still pays: when verify and
                   packed pass run together the round lasts max(v, p) + contention x min(v, p), measured
                   by running both at once as the decoder does (0: perfect overlap; 1: no overlap, as
                   when both passes share the same cores and each alone saturates them)

A round verifies W tokens and commits a + 1 of them; tau = E[a + 1]. Per token:

    sync   (verify_ms(W) + draft_ms) / tau
    async  (s x together(verify_ms(W), packed_ms) + (1 - s) x verify_ms(W) + fallback_rate x draft_ms) / tau
    ar     ar_ms

where s is the share of async rounds that run a packed pass at all: `CandidatePolicy` drops the packed
pass of a round whose candidates are not worth their cost (the round then verifies and drafts, as sync).

and predicted speedup = ar_ms / that. The physical limit of any drafter at acceptance tau is
tau x ar_ms / verify_ms(W): a free, always-hitting drafter. `WidthPolicy` uses the same verify model to
choose how many drafted tokens each round verifies.
"""

import dataclasses
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PassTimes:
    """Measured pass times in milliseconds (see the module docstring).

    Attributes:
        ar_ms: target pass of one token.
        per_token_ms: extra target time per additional verified token (>= 0).
        draft_ms: drafter pass drafting one block.
        packed_ms: drafter packed pass.
        contention: in [0, 1]; share of the shorter pass not hidden when both run together.
        draft_tokens, packed_tokens: query tokens of the measured draft and packed passes; between them
            a packed pass's time is modelled as affine in its tokens (None: every packed pass costs
            packed_ms).
        step_ms: extra target time of any pass of two tokens or more over a one-token step (>= 0; 0 in
            records measured before it was).
    """

    ar_ms: float
    per_token_ms: float
    draft_ms: float
    packed_ms: float
    contention: float = 0.0
    draft_tokens: int | None = None
    packed_tokens: int | None = None
    step_ms: float = 0.0

    def verify_ms(self, width: float) -> float:
        """Target pass of `width` tokens (fractional widths: the mean width of a run, always >= 2 where a
        drafter verifies)."""
        return self.ar_ms + (self.step_ms if width > 1 else 0.0) + self.per_token_ms * max(0.0, width - 1)

    def together_ms(self, verify_ms: float, packed_ms: float) -> float:
        """Wall time of a verify pass and a packed pass run concurrently."""
        return max(verify_ms, packed_ms) + self.contention * min(verify_ms, packed_ms)

    def packed_ms_for(self, tokens: float) -> float:
        """A packed pass of `tokens` query tokens (chain and candidate blocks), ms."""
        if not self.draft_tokens or not self.packed_tokens or self.packed_tokens <= self.draft_tokens:
            return self.packed_ms
        per_token = max(0.0, (self.packed_ms - self.draft_ms) / (self.packed_tokens - self.draft_tokens))
        return max(0.0, self.draft_ms + per_token * (tokens - self.draft_tokens))

    def with_drafter(self, draft_ms: float, packed_ms: float) -> "PassTimes":
        """The same target and device with another drafter's pass times (same block size and budget)."""
        return dataclasses.replace(self, draft_ms=draft_ms, packed_ms=packed_ms)

    def to_dict(self) -> dict:
        """The fields as a dict; a zero step_ms is left out, so a record saved before it existed writes back
        the same (campaign states, cache keys)."""
        return {k: v for k, v in asdict(self).items() if k != "step_ms" or v}


@dataclass(frozen=True)
class LayerCost:
    """A drafter pass time that is affine in the drafter's depth and in its head's rows:
    fixed_ms + per_layer_ms x layers + per_row_ms x (head rows - rows).

    Small drafters are bound by per-layer cost, plus a part (embedding, lm_head, top-k) that removing layers
    does not shorten. Of that part the head's product, its softmax and top-k grow with the rows it computes: a
    draft vocabulary (models/draft_vocab.py) computes fewer. `fixed_ms` is the part at `rows` head rows (those
    of the drafter it was measured on); `per_row_ms` what each row costs (0 with `rows` 0: no head term, as
    records made before it). Fitted from two measured depths and a cut head (decode.timing.drafter_layer_costs),
    it predicts every pruned depth and head without timing noise between steps.
    """

    fixed_ms: float
    per_layer_ms: float
    per_row_ms: float = 0.0
    rows: int = 0

    def at(self, layers: int, rows: int | None = None) -> float:
        """The pass of a `layers`-layer drafter whose head computes `rows` rows (None: as measured)."""
        head = self.per_row_ms * (rows - self.rows) if rows is not None and self.rows else 0.0
        return max(0.0, self.fixed_ms + self.per_layer_ms * layers + head)

    def with_head(self, rows_a: int, ms_a: float, rows_b: int, ms_b: float) -> "LayerCost":
        """This cost with its head term: the line through a pass of a head of `rows_a` rows (the measured
        drafter's, `fixed_ms` at them) taking `ms_a` and one of `rows_b` rows taking `ms_b` at the same depth,
        kept physical (a negative slope, noise, is no head term)."""
        if rows_a == rows_b:
            return self
        return dataclasses.replace(self, per_row_ms=max(0.0, (ms_a - ms_b) / (rows_a - rows_b)), rows=rows_a)

    def to_list(self) -> list:
        """As a state or cache stores it: [fixed_ms, per_layer_ms], and per_row_ms and rows with a head term."""
        head = [self.per_row_ms, self.rows] if self.rows else []
        return [self.fixed_ms, self.per_layer_ms, *head]

    @classmethod
    def fit(cls, layers_a: int, ms_a: float, layers_b: int, ms_b: float) -> "LayerCost":
        """The line through (layers_a, ms_a) and (layers_b, ms_b), kept physical and through the first point
        (the measured depth the predictions start from): a negative slope becomes a flat line at ms_a, and a
        negative fixed part (the shallow pass read less than its share, noise) a line through the origin."""
        per_layer = max(0.0, (ms_a - ms_b) / (layers_a - layers_b))
        if ms_a - per_layer * layers_a < 0.0:
            per_layer = ms_a / layers_a
        return cls(ms_a - per_layer * layers_a, per_layer)


@dataclass(frozen=True)
class RoundShape:
    """What a run's rounds look like on average: the cost model's input besides the pass times.

    Attributes:
        width: mean verify width W.
        fallback_rate: async; rounds whose next draft needs a fallback pass (a miss, or no packed pass).
        packed_share: async; rounds that run a packed pass at all.
        packed_tokens: async; mean query tokens of those packed passes (None: the measured full pass).
        concurrent: async; the packed pass runs together with the verify pass.
    """

    width: float
    fallback_rate: float = 0.0
    packed_share: float = 1.0
    packed_tokens: float | None = None
    concurrent: bool = True


def packed_shape(packed_share: float | None, packed_tokens: float | None) -> dict:
    """The packed-pass fields of RoundShape as keyword arguments for the functions below, from a run's
    measurements: none when the share was not measured (every async round then runs the full packed pass)."""
    return {} if packed_share is None else {"packed_share": packed_share, "packed_tokens": packed_tokens}


def _ar_round(times: PassTimes, shape: RoundShape) -> float:
    return times.ar_ms


def _sync_round(times: PassTimes, shape: RoundShape) -> float:
    return times.verify_ms(shape.width) + times.draft_ms


def _async_round(times: PassTimes, shape: RoundShape) -> float:
    verify = times.verify_ms(shape.width)
    packed = times.packed_ms if shape.packed_tokens is None else times.packed_ms_for(shape.packed_tokens)
    passes = times.together_ms(verify, packed) if shape.concurrent else verify + packed
    return shape.packed_share * passes + (1.0 - shape.packed_share) * verify + shape.fallback_rate * times.draft_ms


# decoder -> modelled round time (ms); a new decoder adds its entry here.
ROUND_MODELS = {"ar": _ar_round, "sync": _sync_round, "async": _async_round}


def round_ms(decoder: str, times: PassTimes, width: float, fallback_rate: float = 0.0,
             concurrent: bool = True, **shape) -> float:
    """Modelled wall time (ms) of one round of `decoder` verifying `width` tokens (`shape`: the other
    fields of RoundShape)."""
    if decoder not in ROUND_MODELS:
        raise ValueError(f"no cost model for decoder {decoder!r}; known: {', '.join(ROUND_MODELS)}")
    return ROUND_MODELS[decoder](times, RoundShape(width, fallback_rate, concurrent=concurrent, **shape))


def time_per_token_ms(decoder: str, times: PassTimes, tau: float, width: float, fallback_rate: float = 0.0,
                      concurrent: bool = True, gated_share: float = 0.0, **shape) -> float:
    """Modelled ms per generated token: round time / tau (tau = 1 for ar). With `gated_share` of the rounds
    plain target steps (decode.gate: one token for ar_ms each), tau and width are those of the drafting rounds."""
    if decoder == "ar":
        return times.ar_ms
    drafted = 1.0 - gated_share
    spent = drafted * round_ms(decoder, times, width, fallback_rate, concurrent, **shape) + gated_share * times.ar_ms
    return spent / (drafted * tau + gated_share)


def predicted_speedup(decoder: str, times: PassTimes, tau: float, width: float, fallback_rate: float = 0.0,
                      concurrent: bool = True, gated_share: float = 0.0, **shape) -> float:
    """ar time per token / the decoder's modelled time per token."""
    return times.ar_ms / time_per_token_ms(decoder, times, tau, width, fallback_rate, concurrent, gated_share,
                                           **shape)


def equal_tau_speedup(decoder: str, before: PassTimes, after: PassTimes, width: float, fallback_rate: float = 0.0,
                      concurrent: bool = True, **shape) -> float:
    """round_ms with pass times `before` / with `after`, at the same round shape: how much faster per token a
    drafter with `after`'s passes runs than one with `before`'s at the same tau (tau divides both alike). What a
    cheaper (pruned) drafter buys before any tau it loses, so the most that pruning can buy; the prediction
    of a pruned drafter is this times what its tau keeps."""
    return (round_ms(decoder, before, width, fallback_rate, concurrent, **shape)
            / round_ms(decoder, after, width, fallback_rate, concurrent, **shape))


def speedup_limit(times: PassTimes, tau: float, width: float, gated_share: float = 0.0) -> float:
    """tau x T_ar / T_verify(width): the speedup of a drafter that costs nothing and always hits (with
    `gated_share` of the rounds plain target steps, as in `time_per_token_ms`)."""
    drafted = 1.0 - gated_share
    return (drafted * tau + gated_share) * times.ar_ms / (drafted * times.verify_ms(width) + gated_share * times.ar_ms)


@dataclass(frozen=True)
class WidthPolicy:
    """Chooses each round's verify width W from the drafter's confidences in its own drafts.

    With c_i the drafter's probability of draft i, the expected tokens committed by verifying W tokens
    are E(W) = 1 + sum_{i < W} c_1 ... c_i, and the round costs about verify_ms(W) + draft_ms. The
    policy takes the W in 2 .. max that maximises E(W) / cost(W). Only ratios matter, so the policy
    keeps the slope and the fixed part relative to ar_ms, rounded to two significant digits: small
    timing noise does not change decisions, and a run is reproducible from the recorded policy.

    Attributes:
        slope: per_token_ms / ar_ms.
        fixed: (draft_ms + step_ms) / ar_ms (the per-round cost that does not grow with W >= 2).
    """

    slope: float
    fixed: float

    @classmethod
    def from_times(cls, times: PassTimes) -> "WidthPolicy":
        return cls(_two_digits(times.per_token_ms / times.ar_ms),
                   _two_digits((times.draft_ms + times.step_ms) / times.ar_ms))

    def round_cost(self, width: int) -> float:
        """A round verifying `width` >= 2 tokens, in one-token target steps (verify pass and draft)."""
        return 1.0 + self.slope * (width - 1) + self.fixed

    def choose(self, confidences: list[float], max_width: int) -> int:
        """Verify width in 2 .. max_width for drafts with per-slot confidences c_1 .. c_(max_width - 1)."""
        values, reach = [], 1.0
        for confidence in confidences[: max_width - 1]:
            reach *= confidence
            values.append(reach)
        return 1 + self.best_count(values) if values else max_width

    def best_count(self, values: list[float]) -> int:
        """How many of a round's candidate tokens to verify, 1 .. len(values): the count n that maximises
        E(n) / round_cost(n + 1), E(n) = 1 + values[0] + .. + values[n - 1], where values[i] is the drafter's
        probability that the target accepts the i-th best token and every token before it on its path (a
        chain's c_1 .. c_i; a draft tree's node values, decode/tree.py), best first. Ties: the fewer."""
        best_count, best_rate = len(values), -1.0
        expected = 1.0
        for count, value in enumerate(values, 1):
            expected += value
            rate = expected / self.round_cost(count + 1)
            if rate > best_rate + 1e-12:
                best_count, best_rate = count, rate
        return best_count


def _two_digits(value: float) -> float:
    return float(f"{max(0.0, value):.2g}")


@dataclass(frozen=True)
class CandidatePolicy:
    """Chooses how many of a round's planned candidate blocks its packed pass drafts (async).

    The planner ranks candidates by the drafter's probability that each is the round's outcome (their
    values v_1 >= v_2 >= ...; outcomes exclude each other, so k candidates hit with probability
    h_k = v_1 + ... + v_k). Drafting k of them costs a packed pass of chain + their tokens, run together
    with the verify pass, plus a fallback draft on a miss; drafting none skips the packed pass (verify,
    then draft, as the sync decoder does). The policy takes the k, 0 included, with the least expected
    round time, so the async decoder is never modelled slower than the sync one: where the two passes
    cannot overlap (few cores), it drafts fewer candidates or none. Times are kept relative to ar_ms and
    rounded to two significant digits, as in `WidthPolicy`.

    Attributes:
        slope: per_token_ms / ar_ms (verify pass per extra token).
        draft: draft_ms / ar_ms.
        packed_fixed, packed_per_token: the packed pass as packed_fixed + packed_per_token x tokens.
        contention: see PassTimes.
        step: step_ms / ar_ms (what any verify pass of two tokens or more costs over a one-token step).
    """

    slope: float
    draft: float
    packed_fixed: float
    packed_per_token: float
    contention: float
    step: float = 0.0

    @classmethod
    def from_times(cls, times: PassTimes) -> "CandidatePolicy":
        base = times.packed_ms_for(0)
        per_token = (times.packed_ms_for(100) - base) / 100
        return cls(*(_two_digits(v / times.ar_ms) for v in (times.per_token_ms, times.draft_ms, base, per_token)),
                   _two_digits(times.contention), _two_digits(times.step_ms / times.ar_ms))

    def round_cost(self, width: int, chain_tokens: int, values: list[float], costs: list[int]) -> float:
        """Expected round time (units of ar_ms) when the packed pass drafts candidates with `values` and
        query-token `costs` after `chain_tokens` chain tokens (none: no packed pass)."""
        verify = 1.0 + self.step + self.slope * (width - 1)
        if not values:
            return verify + self.draft
        packed = self.packed_fixed + self.packed_per_token * (chain_tokens + sum(costs))
        together = max(verify, packed) + self.contention * min(verify, packed)
        return together + max(0.0, 1.0 - sum(values)) * self.draft

    def count(self, width: int, chain_tokens: int, values: list[float], costs: list[int]) -> int:
        """How many of the candidates (best first, with `values` and `costs`) to draft."""
        costs_by_k = [self.round_cost(width, chain_tokens, values[:k], costs[:k]) for k in range(len(values) + 1)]
        return min(range(len(costs_by_k)), key=lambda k: (costs_by_k[k], k))

