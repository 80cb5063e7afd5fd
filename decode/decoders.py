"""The three decoders: `ar` (target alone), `sync` (draft, verify, repeat) and `async` (D3D packed).

All three share the verifier interface, the acceptance rules and the stop rule, and return the same
`DecodeResult`. The speculative decoders run a batch of sequences in lockstep over one `DraftEngine`
(one row when decoding live; many when replaying for layer scoring); a row's tokens, acceptances and
hits never depend on the other rows or on timing.

Async round k (docs/design.md, Decoders): while the target verifies V = [t, d1 .. d(B-1)], ONE packed drafter
pass feeds the chain t, d1 .. d(B-1) plus candidate blocks for the likeliest outcomes (decode.planner).
When (a, b) is known the matching candidate becomes the next draft (a hit); otherwise the drafter
drafts synchronously from b (a fallback). Running the two passes one after the other (`concurrent=False`)
gives identical tokens, acceptances and hits.

With a speculation gate (`DecodeConfig.gate_policy`, decode/gate.py), a sequence whose recent rounds did
not pay for their drafts runs plain target steps (a one-token verify pass, no draft) until the gate lets
it draft again; its drafter cache catches up in the next draft pass. Exact either way.

With draft trees (`DecodeConfig.tree_branches`, greedy only; decode/tree.py) a round verifies the drafter's
next-best ids beside its drafts in the same target pass. The async packed pass plans on the main chain (the
argmax drafts); an outcome that leaves it through another node is a miss.
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.errors import ConfigError, DataError
from models.masks import BlockSpec

from . import registry
from .acceptance import greedy_outcome, sample_token, sampled_outcome
from .config import DecodeConfig
from .cost import WidthPolicy
from .engine import BlockPrediction, DraftEngine, DraftRequest
from .planner import plan_candidates
from .tree import greedy_path, grow
from .verifiers import LiveVerifier, TargetOutput, Verifier
from .worker import draft_worker, thread_split

DECODERS = registry.OURS  # the decoders implemented here (decode.registry has them all, baselines included)
# Called with (row, ids) each time a sequence commits tokens: its prompt's index in the batch (0 for ar) and
# the ids the round added, after the stop rule, in order. Runs on the decoding thread, inside the timed rounds.
CommitHook = Callable[[int, list[int]], None]


@dataclass
class Round:
    """One target pass. Times are seconds; `hit` is None where no candidate applies (sync, last round, a gated
    target step and the draft that reopens the gate).

    Times are wall time on the decoding thread, from a pass's launch to the host read that ends it (every
    pass ends in one, on every device), so they are what the round waited for. `overlap_s` is how long the
    verify pass and the concurrent packed pass were both in flight (the intersection of their wall-clock
    intervals), not how long both computed at once: on 2 CPU cores or on one GPU the two share the
    hardware, which shows as longer `verify_s` and `draft_s`, not as less overlap. How much running them
    together actually saves is measured by decode.timing (the `contention` of decode.cost.PassTimes).
    """

    accepted: int
    hit: bool | None = None
    verify_s: float = 0.0
    draft_s: float = 0.0
    overlap_s: float = 0.0
    fallback_s: float = 0.0
    packed_tokens: int = 0
    total_s: float = 0.0
    width: int = 1
    drafted: bool = True  # False: a plain target step that the speculation gate chose (decode.gate; width 1, a 0)


@dataclass
class DecodeResult:
    """What a decoder produced for one prompt.

    Attributes:
        output_ids: generated ids (the prompt excluded), trimmed by the stop rule.
        rounds: one entry per target pass after prefill.
        prefill_s: target prefill (+ the first draft for speculative decoders); excluded from decode_s.
        decode_s: wall time of the rounds (the first output token comes from prefill, outside it).
    """

    decoder: str
    prompt_len: int
    output_ids: list[int]
    rounds: list[Round] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def acceptance(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def widths(self) -> list[int]:
        """Tokens verified per round (1 for ar)."""
        return [r.width for r in self.rounds]

    @property
    def round_trace(self) -> list[tuple[int, bool | None]]:
        """Per-round (a, hit): the sequence replay must reproduce exactly."""
        return [(r.accepted, r.hit) for r in self.rounds]

    @property
    def timed_tokens(self) -> int:
        """Tokens produced inside the timed rounds (all but the prefill token)."""
        return max(0, len(self.output_ids) - 1)


@dataclass
class _Draft:
    """A round's drafts after t: the main chain V = [t, d1 .. d(W-1)] with the drafter's per-slot beliefs,
    and for a draft tree its other nodes after them (decode/tree.py).

    Attributes:
        tokens: the fed tokens: t, the main chain's drafts, then a tree's other nodes.
        confidences, alternatives: the main chain's, per draft.
        parents: a tree's parent index per fed token; None for a chain.
    """

    tokens: list[int]
    confidences: list[float]
    alternatives: list[list[tuple[int, float]]]
    parents: list[int] | None = None

    @classmethod
    def from_slots(cls, bonus: int, prediction: BlockPrediction, first_slot: int, count: int,
                   policy: WidthPolicy | None = None, branches: int = 0) -> "_Draft":
        """The draft after `bonus` from `count` slots of `prediction` (fewer where `policy` says so), a tree
        of up to `count` nodes where `branches` > 0."""
        end = first_slot + count
        if branches > 0:
            tree = grow(bonus, prediction.tokens[first_slot:end], prediction.probs[first_slot:end],
                        prediction.alternatives[first_slot:end], branches, count, policy)
            chain_end = first_slot + tree.chain - 1
            return cls(tree.tokens, prediction.probs[first_slot:chain_end],
                       prediction.alternatives[first_slot:chain_end], None if tree.is_chain else tree.parents)
        # A chain directly (what `grow` without branches gives, without its heap: this runs every round)
        if policy is not None:
            end = first_slot + policy.choose(prediction.probs[first_slot:end], count + 1) - 1
        return cls(
            [bonus] + prediction.tokens[first_slot:end],
            prediction.probs[first_slot:end],
            prediction.alternatives[first_slot:end],
        )

    @property
    def chain_width(self) -> int:
        """Tokens on the main chain, t included."""
        return 1 + len(self.confidences)

    def chain_alternatives(self) -> list[list[tuple[int, float]]]:
        """The main chain's next-best ids less those the tree verifies at the same place (an outcome
        through them continues in the tree, so no async candidate can match it)."""
        if self.parents is None:
            return self.alternatives
        verified = {(self.parents[i], self.tokens[i]) for i in range(self.chain_width, len(self.tokens))}
        return [[(token, prob) for token, prob in options if (slot, token) not in verified]
                for slot, options in enumerate(self.alternatives)]


class _Sequence:
    """Per-prompt decoding state: committed tokens, the verifier, the current draft, the round log."""

    def __init__(self, prompt: list[int], verifier, config: DecodeConfig, row: int = 0,
                 on_commit: CommitHook | None = None):
        self.tokens = list(prompt)
        self.row = row
        self.on_commit = on_commit
        self.prompt_len = len(prompt)
        self.verifier = verifier
        self.stop = config.stop_rule
        self.generator = torch.Generator().manual_seed(config.seed)
        self.done = False
        self.draft: _Draft | None = None  # None: the next round is a plain target step (the gate is closed)
        self.gate = config.gate_policy.gate() if config.gate_policy is not None else None
        self.rounds: list[Round] = []
        self.chain_accepted = 0  # drafts of the last verified main chain that were committed
        self.left_chain = False  # whether the last verify committed a tree node off the main chain

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def _pick(self, out: TargetOutput, row: int) -> int:
        if out.probs is None:
            return out.tokens[row]
        return sample_token(out.probs[row], self.generator)

    def start(self) -> None:
        """Prefill the target and commit the first token."""
        out = self.verifier.prefill(self.tokens)
        self._commit([self._pick(out, 0)])

    def _commit(self, committed: list[int], fed: list[int] | None = None) -> int:
        """Commit `committed` (after the stop rule); `fed`: after a tree verify, the fed tokens that hold
        the committed positions (t and the accepted nodes)."""
        kept, self.done = self.stop.truncate(committed, self.generated)
        if kept[-1] < 0:  # a replay past the end of its trajectory answers -1
            raise DataError(
                "the replayed trajectory ended before the stop rule did; record it with the same "
                "max_new_tokens and stop ids as this run"
            )
        self.tokens += kept
        self.verifier.commit(len(self.tokens) - 1, fed)
        if self.on_commit is not None:
            self.on_commit(self.row, kept)
        return len(kept) - 1

    def ar_step(self) -> int:
        self.chain_accepted, self.left_chain = 0, False
        out = self.verifier.verify([self.tokens[-1]])
        return self._commit([self._pick(out, 0)])

    @property
    def width(self) -> int:
        """Tokens the current draft verifies (t and its drafts)."""
        return len(self.draft.tokens)

    def verify_draft(self) -> int:
        """Verify the current draft and commit; returns a (after the stop rule)."""
        draft = self.draft
        out = self.verifier.verify(draft.tokens, draft.parents)
        if draft.parents is not None:
            path, bonus = greedy_path(draft.tokens, draft.parents, out.tokens)
            committed, fed = [draft.tokens[node] for node in path] + [bonus], [0] + path
            on_chain = next((k for k, node in enumerate(path) if node != k + 1), len(path))
        else:
            drafts, fed = draft.tokens[1:], None
            if out.probs is None:
                on_chain, bonus = greedy_outcome(drafts, out.tokens)
            else:
                on_chain, bonus = sampled_outcome(drafts, out.probs, self.generator)
            committed = drafts[:on_chain] + [bonus]
        a = self._commit(committed, fed)
        # what the async packed pass can use; the stop rule may cut the path before it leaves the chain
        self.chain_accepted, self.left_chain = min(on_chain, a), a > on_chain
        return a

    def step(self) -> tuple[int, int | None]:
        """One round: verify the current draft, or a plain target step where there is none; commit, and
        tell the gate. Returns (a after the stop rule, tokens verified; None for a target step)."""
        width = self.width if self.draft is not None else None
        a = self.verify_draft() if width is not None else self.ar_step()
        if self.gate is not None:
            self.gate.observe(a + 1, width)
        return a, width

    @property
    def drafts_next(self) -> bool:
        """Whether the next round verifies a draft (unfinished, and the gate, if any, open)."""
        return not self.done and (self.gate is None or self.gate.drafting)

    def result(self, decoder: str, prefill_s: float, decode_s: float) -> DecodeResult:
        return DecodeResult(decoder, self.prompt_len, self.tokens[self.prompt_len :], self.rounds, prefill_s, decode_s)


def decode_ar(target: torch.nn.Module, prompt: list[int], config: DecodeConfig,
              on_commit: CommitHook | None = None) -> DecodeResult:
    """Plain KV-cached decoding with the target alone: the baseline and the reference output.

    `on_commit(0, [token])` is called after each committed token (streaming; see CommitHook)."""
    seq = _Sequence(prompt, LiveVerifier(target, config.temperature), config, 0, on_commit)
    start = time.perf_counter()
    seq.start()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while not seq.done:
        round_start = time.perf_counter()
        seq.ar_step()
        elapsed = time.perf_counter() - round_start
        seq.rounds.append(Round(accepted=0, verify_s=elapsed, total_s=elapsed))
    return seq.result("ar", prefill_s, time.perf_counter() - start)


def decode_one(decoder: str, drafter: torch.nn.Module | None, target: torch.nn.Module, prompt: list[int],
               config: DecodeConfig, verifier: Verifier | None = None,
               on_commit: CommitHook | None = None) -> DecodeResult:
    """Decode one prompt with one of DECODERS: `ar` runs the target alone, `sync` and `async` run `drafter`
    verified by `verifier` (default: the live target). `on_commit` streams the committed tokens."""
    entry = registry.DECODERS.get(decoder)
    if entry is None or entry.kind not in (registry.TARGET, registry.SPECULATIVE):
        raise ConfigError(f"unknown decoder {decoder!r}; choose from {', '.join(DECODERS)}")
    if entry.kind == registry.TARGET:
        return entry(target, prompt, config, on_commit)
    verifier = verifier or LiveVerifier(target, config.temperature)
    return decode_speculative(decoder, drafter, [verifier], [prompt], config, on_commit)[0]


def decode_speculative(
    decoder: str,
    drafter: torch.nn.Module,
    verifiers: list[Verifier],
    prompts: list[list[int]],
    config: DecodeConfig,
    on_commit: CommitHook | None = None,
) -> list[DecodeResult]:
    """Run `sync` or `async` decoding for several prompts in lockstep (one drafter pass per step).

    Args:
        decoder: a speculative decoder of decode.registry ("sync" or "async"); its round function runs each step.
        verifiers: one per prompt (decode.verifiers.Verifier: live or replayed), in the prompts' order.
        prompts: token ids per prompt.
        on_commit: optional callback(prompt index, ids) after each commit (streaming; see CommitHook).

    Returns:
        One DecodeResult per prompt. Timings are per step of the whole batch; they mean per-prompt
        times only when one prompt is decoded.
    """
    if decoder not in registry.names(registry.SPECULATIVE):
        raise ValueError(f"unknown speculative decoder {decoder!r}")
    run_round = registry.DECODERS[decoder].function
    seqs = [_Sequence(prompt, verifier, config, row, on_commit)
            for row, (prompt, verifier) in enumerate(zip(prompts, verifiers))]
    engine = DraftEngine(drafter, rows=len(seqs), fan_out=config.fan_out, context_vocab=config.context_vocab)
    block = config.verify_block(engine.block_size)
    start = time.perf_counter()
    for seq in seqs:
        seq.start()
    _sync_draft(engine, seqs, [not seq.done for seq in seqs], block, config)
    prefill_s = time.perf_counter() - start
    lookahead = config.lookahead and all(seq.verifier.answers_ahead for seq in seqs)
    start = time.perf_counter()
    while any(not seq.done for seq in seqs):
        run_round(engine, seqs, block, config, lookahead)
    decode_s = time.perf_counter() - start
    return [seq.result(decoder, prefill_s, decode_s) for seq in seqs]


def _sync_draft(engine: DraftEngine, seqs: list[_Sequence], which: list[bool], block: int,
                config: DecodeConfig) -> float:
    """Draft a fresh block after the last committed token of each selected sequence; returns seconds."""
    start = time.perf_counter()
    requests = [
        DraftRequest(seq.tokens[engine.cache_lens[r] :], [BlockSpec(len(seq.tokens) - 1)]) if which[r] else None
        for r, seq in enumerate(seqs)
    ]
    predictions = engine.forward(requests)
    engine.keep([len(req.chain) if req else 0 for req in requests])
    for r, seq in enumerate(seqs):
        if which[r]:
            seq.draft = _new_draft(seq.tokens[-1], predictions[r][0], 0, block, config)
    return time.perf_counter() - start


def _new_draft(bonus: int, prediction: BlockPrediction, first_slot: int, block: int, config: DecodeConfig) -> _Draft:
    """The next round's draft after `bonus` from `prediction`'s slots from `first_slot` on, as `config` shapes
    it (width policy; a tree where `config.tree_branches` > 0 and decoding is greedy)."""
    branches = config.tree_branches if config.temperature == 0 else 0
    return _Draft.from_slots(bonus, prediction, first_slot, block - 1, config.width_policy, branches)


def sync_round(engine: DraftEngine, seqs: list[_Sequence], block: int, config: DecodeConfig, lookahead: bool) -> None:
    """One sync round of every unfinished sequence: verify its draft, commit, draft again (`lookahead` unused)."""
    round_start = time.perf_counter()
    active = [not seq.done for seq in seqs]
    for r, seq in enumerate(seqs):
        if active[r]:
            verify_start = time.perf_counter()
            a, width = seq.step()
            seq.rounds.append(Round(accepted=a, verify_s=time.perf_counter() - verify_start, width=width or 1,
                                    drafted=width is not None))
    drafting = [active[r] and seq.drafts_next for r, seq in enumerate(seqs)]
    for r, seq in enumerate(seqs):
        if not drafting[r]:
            seq.draft = None
    draft_s = _sync_draft(engine, seqs, drafting, block, config)
    total = time.perf_counter() - round_start
    for r, seq in enumerate(seqs):
        if active[r]:
            seq.rounds[-1].draft_s, seq.rounds[-1].total_s = draft_s, total


def async_round(engine: DraftEngine, seqs: list[_Sequence], block: int, config: DecodeConfig,
                lookahead: bool) -> None:
    """One async round of every unfinished sequence (the module docstring): the packed pass runs with the verify
    pass (concurrently unless `config.concurrent` is off), or after it with `lookahead` (replay)."""
    concurrent = config.concurrent and not lookahead
    round_start = time.perf_counter()
    active = [not seq.done for seq in seqs]
    drafted_before = [active[r] and seq.draft is not None for r, seq in enumerate(seqs)]  # else a target step
    widths = [seq.width if drafted_before[r] else 1 for r, seq in enumerate(seqs)]
    planned = [_plan_packed_request(engine, seq, r, widths[r], config) if drafted_before[r] else (None, [])
               for r, seq in enumerate(seqs)]
    requests, plans = [request for request, _ in planned], [plan for _, plan in planned]

    # A row without candidates skips the packed pass (its fallback draft follows verification, as in sync);
    # the lookahead still uses its pass for that draft.
    fed = requests if lookahead else [request if request and request.blocks else None for request in requests]
    drafted = [False] * len(seqs)
    concurrent = concurrent and any(fed)

    def packed_pass():
        t0 = time.perf_counter()
        predictions = engine.forward(fed)
        return predictions, t0, time.perf_counter()

    old_lengths = [len(seq.tokens) for seq in seqs]
    # The cores are split between the two passes only while both run (decode/worker.py); a round without
    # a packed pass verifies and drafts its fallback with all of them.
    with thread_split(engine.device, config.draft_threads) if concurrent else contextlib.nullcontext():
        if concurrent:
            engine.mark_ready()
        future = draft_worker().submit(packed_pass) if concurrent else None
        if future is None and not lookahead:
            predictions, p_start, p_end = packed_pass() if any(fed) else ([[] for _ in seqs], 0.0, 0.0)
        v_start = time.perf_counter()
        accepted = [seq.step()[0] if active[r] else 0 for r, seq in enumerate(seqs)]
        v_end = time.perf_counter()
        if future is not None:
            predictions, p_start, p_end = future.result()
    if lookahead:
        fed, plans, drafted = _usable_parts(seqs, requests, plans, old_lengths, engine.cache_lens)
        predictions, p_start, p_end = packed_pass()

    # The committed part of each chain: the uncached committed tokens, t, and d1 .. da on the main chain (and
    # b where the lookahead drafted the fallback in the same pass).
    engine.keep(
        [len(request.chain) if request else 0 for request in fed] if lookahead else
        [old_lengths[r] - engine.cache_lens[r] + seq.chain_accepted if fed[r] else 0 for r, seq in enumerate(seqs)]
    )
    # A row whose gate closed steps the target alone next; one whose gate opened after target steps
    # drafts afresh (neither is a hit or a miss).
    hits = [None] * len(seqs)
    resumed = [active[r] and not drafted_before[r] and seq.drafts_next for r, seq in enumerate(seqs)]
    for r, seq in enumerate(seqs):
        if not (active[r] and seq.drafts_next):
            seq.draft = None
        elif drafted[r]:
            seq.draft = _new_draft(seq.tokens[-1], predictions[r][0], 0, block, config)
            hits[r] = False
        elif not resumed[r]:
            hits[r] = _take_candidate(seq, plans[r], predictions[r], block, config)
    missed = [resumed[r] or (active[r] and hits[r] is False and not drafted[r]) for r in range(len(seqs))]
    fallback_s = _sync_draft(engine, seqs, missed, block, config) if any(missed) else 0.0

    overlap = max(0.0, min(v_end, p_end) - max(v_start, p_start))
    total = time.perf_counter() - round_start
    for r, seq in enumerate(seqs):
        if active[r]:
            packed_tokens = len(requests[r].chain) + sum(
                engine.block_size + (b.guess is not None) for b in requests[r].blocks
            ) if requests[r] and requests[r].blocks else 0
            seq.rounds.append(
                Round(
                    accepted=accepted[r],
                    hit=hits[r],
                    verify_s=v_end - v_start,
                    draft_s=p_end - p_start,
                    overlap_s=overlap,
                    fallback_s=fallback_s if missed[r] else 0.0,
                    packed_tokens=packed_tokens,
                    total_s=total,
                    width=widths[r],
                    drafted=drafted_before[r],
                )
            )


def _plan_packed_request(engine: DraftEngine, seq: _Sequence, row: int, width: int, config: DecodeConfig):
    """The packed-pass request of one row (its chain: uncached committed tokens, t and the unverified drafts;
    its candidate blocks) and the candidates' plan."""
    draft = seq.draft
    chain = seq.tokens[engine.cache_lens[row] :] + draft.tokens[1 : draft.chain_width]
    policy = config.candidate_policy
    keep = policy and (lambda values, costs: policy.count(width, len(chain), values, costs))
    plan = plan_candidates(draft.confidences, draft.chain_alternatives(), draft.chain_width, config.packed_budget,
                           config.fan_out, engine.block_size, keep=keep)
    s = len(seq.tokens) - 1  # position of t
    return DraftRequest(chain, [BlockSpec(s + c.accepted, c.guess) for c in plan]), plan


def _usable_parts(seqs, requests, plans, old_lengths, cache_lens):
    """The part of each row's packed request that the known outcome (a, b) can use, its plan, and
    whether the row's fallback draft rides along.

    The chain keeps the uncached committed tokens, t and d1 .. da (exactly what `keep` retains); the
    blocks keep the candidates for outcome a whose guess is b or the all-accepted one (whose first slot
    decides). A candidate block attends only to the chain up to its anchor and to itself, so what it
    predicts does not depend on the parts left out. Where no candidate can match, the miss is known
    before the pass, so the pass feeds b as well and drafts the fallback block after it: what the
    separate fallback pass would feed, one pass earlier.
    """
    fed, kept_plans, drafted = [], [], []
    for r, (seq, request, plan) in enumerate(zip(seqs, requests, plans)):
        if request is None:
            fed.append(None)
            kept_plans.append([])
            drafted.append(False)
            continue
        bonus, a = seq.tokens[-1], seq.chain_accepted
        usable = [] if not seq.drafts_next or seq.left_chain else [
            (candidate, spec) for candidate, spec in zip(plan, request.blocks)
            if candidate.accepted == a and candidate.guess in (None, bonus)
        ]
        chain = request.chain[: old_lengths[r] - cache_lens[r] + a]
        blocks = [spec for _, spec in usable]
        miss = seq.drafts_next and not usable
        if miss:
            chain, blocks = seq.tokens[cache_lens[r] :], [BlockSpec(len(seq.tokens) - 1)]
        fed.append(DraftRequest(chain, blocks))
        kept_plans.append([candidate for candidate, _ in usable])
        drafted.append(miss)
    return fed, kept_plans, drafted


def _take_candidate(seq: _Sequence, plan, predictions: list[BlockPrediction], block: int,
                    config: DecodeConfig) -> bool:
    """Make the candidate matching the outcome (a, b) the next draft; False when none matches (a fallback is
    needed), as for every outcome that left the main chain of a tree."""
    if seq.left_chain:
        return False
    bonus, a = seq.tokens[-1], seq.chain_accepted
    for candidate, prediction in zip(plan, predictions):
        if candidate.accepted != a:
            continue
        if candidate.guess is None and prediction.tokens[0] == bonus:
            # All accepted: slot 1 drafted b itself; slots 2 .. B are the next drafts.
            seq.draft = _new_draft(bonus, prediction, 1, block, config)
            return True
        if candidate.guess == bonus:
            seq.draft = _new_draft(bonus, prediction, 0, block, config)
            return True
    return False
