"""When a speculative decoder drafts, and when it lets the target step alone (docs/speed.md, The speculation gate).

A drafting round pays for a draft and a verify pass wider than one token; on a CPU that is about two target
steps (the demo pair on 2 cores: 1.8-2.2 one-token steps), so a round must commit more than that many tokens to
beat the target alone. Where the drafter guesses poorly (prose after code, a domain it never saw) its rounds
commit 1-1.5 tokens and speculative decoding runs well below the target's own speed. The gate watches each
sequence's recent rounds and, while they commit fewer tokens than their cost buys on one-token steps, runs plain
target steps instead (exact by construction: a one-token verify pass is an ar step), trying a drafting round
again after a wait that doubles while such probes keep failing.

Per sequence, with e = committed tokens / round cost in one-token steps (decode.cost.WidthPolicy.round_cost)
for each drafting round:

    efficiency <- (1 - smoothing) x efficiency + smoothing x e        (starts at `start`: draft first)
    efficiency < threshold   -> the next `wait` target tokens (first 4) are plain steps; then one probe round
    a probe that leaves efficiency < threshold doubles the wait (up to max_wait); one that clears resets it

Every decision depends on committed tokens and the cost model's rounded ratios only, never on timing, so a
replay makes the live decoder's decisions and a run is reproducible from its recorded policy.
"""

from dataclasses import dataclass

from .cost import PassTimes, WidthPolicy


@dataclass(frozen=True)
class GatePolicy:
    """The gate's settings (see the module docstring).

    Attributes:
        cost: a drafting round's cost in one-token target steps (`WidthPolicy.round_cost`, the cost the
            adaptive width maximises tokens against).
        threshold: close below this smoothed efficiency (1.0 breaks even with the target alone; lower keeps
            drafting through short dips, which a probe would pay to find again).
        smoothing: weight of the newest round in the smoothed efficiency.
        start: the smoothed efficiency before any round (above threshold: every sequence drafts first).
        first_wait, max_wait: target tokens stepped alone after the gate closes, first and at most.

    Defaults chosen on the three suites' calibration parts, not their evaluation parts (scripts/gate_study.py:
    16 prompts each, simulated at every position of their decodes under two measurements of this machine's
    pass times; docs/speed.md, The speculation gate): of the settings tried, the best on average over both.
    """

    cost: WidthPolicy
    threshold: float = 0.9
    smoothing: float = 0.5
    start: float = 1.5
    first_wait: int = 4
    max_wait: int = 32

    @classmethod
    def from_times(cls, times: PassTimes) -> "GatePolicy":
        return cls(WidthPolicy.from_times(times))

    def gate(self) -> "Gate":
        """A fresh gate for one sequence."""
        return Gate(self)


class Gate:
    """One sequence's gate: whether its next round drafts (`drafting`), updated after every round (`observe`)."""

    def __init__(self, policy: GatePolicy):
        self.policy = policy
        self.efficiency = policy.start
        self.drafting = True
        self.wait = 0  # target tokens left to step alone while closed
        self.backoff = policy.first_wait
        self.probing = False  # the open round is a probe after a wait

    def observe(self, committed: int, width: int | None) -> None:
        """Account one round: `committed` tokens (a + 1), verified `width` tokens wide, or `width` None for a
        plain target step."""
        policy = self.policy
        if width is None:
            self.wait -= committed
            if self.wait <= 0:
                self.drafting, self.probing = True, True
            return
        efficiency = committed / policy.cost.round_cost(width)
        self.efficiency = (1.0 - policy.smoothing) * self.efficiency + policy.smoothing * efficiency
        if self.efficiency >= policy.threshold:
            self.probing = False
            return
        self.backoff = min(policy.max_wait, 2 * self.backoff) if self.probing else policy.first_wait
        self.drafting, self.probing, self.wait = False, False, self.backoff
