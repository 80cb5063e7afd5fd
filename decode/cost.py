"""The one cost model: time per token of the ar, sync and async decoders from measured pass times.

Inputs are wall times (ms) of single passes measured on the device that decodes (decode/timing.py):

    ar_ms          a target pass of one token (an ar step)
    verify_ms(W)   a target pass of W tokens, modelled as ar_ms + per_token_ms x (W - 1)
    draft_ms       a drafter pass that drafts one block (sync draft, async fallback)
    packed_ms      the async packed pass (chain + candidate blocks)
    contention     how much of the shorter pass the concurrent async round still pays: when verify and
                   packed pass run together the round lasts max(v, p) + contention x min(v, p), measured
                   by running both at once as the decoder does (0: perfect overlap; 1: no overlap, as
                   when both passes share the same cores and each alone saturates them)

A round verifies W tokens and commits a + 1 of them; tau = E[a + 1]. Per token:

    sync   (verify_ms(W) + draft_ms) / tau
    async  (together(verify_ms(W), packed_ms) + fallback_rate x draft_ms) / tau
    ar     ar_ms

and predicted speedup = ar_ms / that. The physical limit of any drafter at acceptance tau is
tau x ar_ms / verify_ms(W): a free, always-hitting drafter. `WidthPolicy` uses the same verify model to
choose how many drafted tokens each round verifies.
"""

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
    """

    ar_ms: float
    per_token_ms: float
    draft_ms: float
    packed_ms: float
    contention: float = 0.0

    def verify_ms(self, width: float) -> float:
        """Target pass of `width` tokens (fractional widths: the mean width of a run)."""
        return self.ar_ms + self.per_token_ms * max(0.0, width - 1)

    def together_ms(self, verify_ms: float, packed_ms: float) -> float:
        """Wall time of a verify pass and a packed pass run concurrently."""
        return max(verify_ms, packed_ms) + self.contention * min(verify_ms, packed_ms)

    def with_drafter(self, draft_ms: float, packed_ms: float) -> "PassTimes":
        """The same target and device with another drafter's pass times."""
        return PassTimes(self.ar_ms, self.per_token_ms, draft_ms, packed_ms, self.contention)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerCost:
    """A drafter pass time that is affine in the drafter's depth: fixed_ms + per_layer_ms x layers.

    Small drafters are bound by per-layer cost, plus a fixed part (embedding, lm_head, top-k) that
    removing layers does not shorten. Fitted from two measured depths (decode.timing.drafter_layer_costs),
    it predicts every pruned depth without timing noise between steps.
    """

    fixed_ms: float
    per_layer_ms: float

    def at(self, layers: int) -> float:
        return self.fixed_ms + self.per_layer_ms * layers

    @classmethod
    def fit(cls, layers_a: int, ms_a: float, layers_b: int, ms_b: float) -> "LayerCost":
        per_layer = max(0.0, (ms_a - ms_b) / (layers_a - layers_b))
        return cls(max(0.0, ms_a - per_layer * layers_a), per_layer)


def _ar_round(times: PassTimes, width: float, fallback_rate: float, concurrent: bool) -> float:
    return times.ar_ms


def _sync_round(times: PassTimes, width: float, fallback_rate: float, concurrent: bool) -> float:
    return times.verify_ms(width) + times.draft_ms


def _async_round(times: PassTimes, width: float, fallback_rate: float, concurrent: bool) -> float:
    verify = times.verify_ms(width)
    passes = times.together_ms(verify, times.packed_ms) if concurrent else verify + times.packed_ms
    return passes + fallback_rate * times.draft_ms


# decoder -> modelled round time (ms); a new decoder adds its entry here.
ROUND_MODELS = {"ar": _ar_round, "sync": _sync_round, "async": _async_round}


def round_ms(decoder: str, times: PassTimes, width: float, fallback_rate: float = 0.0,
             concurrent: bool = True) -> float:
    """Modelled wall time (ms) of one round of `decoder` verifying `width` tokens."""
    if decoder not in ROUND_MODELS:
        raise ValueError(f"no cost model for decoder {decoder!r}; known: {', '.join(ROUND_MODELS)}")
    return ROUND_MODELS[decoder](times, width, fallback_rate, concurrent)


def time_per_token_ms(decoder: str, times: PassTimes, tau: float, width: float, fallback_rate: float = 0.0,
                      concurrent: bool = True) -> float:
    """Modelled ms per generated token: round time / tau (tau = 1 for ar)."""
    return round_ms(decoder, times, width, fallback_rate, concurrent) / (1.0 if decoder == "ar" else tau)


def predicted_speedup(decoder: str, times: PassTimes, tau: float, width: float, fallback_rate: float = 0.0,
                      concurrent: bool = True) -> float:
    """ar time per token / the decoder's modelled time per token."""
    return times.ar_ms / time_per_token_ms(decoder, times, tau, width, fallback_rate, concurrent)


def speedup_limit(times: PassTimes, tau: float, width: float) -> float:
    """tau x T_ar / T_verify(width): the speedup of a drafter that costs nothing and always hits."""
    return tau * times.ar_ms / times.verify_ms(width)


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
        fixed: draft_ms / ar_ms (the per-round cost that does not grow with W).
    """

    slope: float
    fixed: float

    @classmethod
    def from_times(cls, times: PassTimes) -> "WidthPolicy":
        return cls(_two_digits(times.per_token_ms / times.ar_ms), _two_digits(times.draft_ms / times.ar_ms))

    def choose(self, confidences: list[float], max_width: int) -> int:
        """Verify width in 2 .. max_width for drafts with per-slot confidences c_1 .. c_(max_width - 1)."""
        best_width, best_rate = max_width, -1.0
        expected, reach = 1.0, 1.0
        for width in range(2, max_width + 1):
            reach *= confidences[width - 2]
            expected += reach
            rate = expected / (1.0 + self.slope * (width - 1) + self.fixed)
            if rate > best_rate + 1e-12:
                best_width, best_rate = width, rate
        return best_width


def _two_digits(value: float) -> float:
    return float(f"{max(0.0, value):.2g}")
