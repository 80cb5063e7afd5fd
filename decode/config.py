"""Decoder settings: the one home of their defaults, read by the library and by the `prune` command line.

Nothing here imports torch, so the CLI builds its flags (defaults and choices) from these classes without
loading a model library. The decoders themselves are in decode/decoders.py, the benchmark in decode/bench.py.
"""

from dataclasses import dataclass, field, replace

from models.errors import ConfigError

from .cost import CandidatePolicy, PassTimes, WidthPolicy
from .gate import GatePolicy
from .registry import ASSISTED, BASELINE, DECODERS, OURS, check_decoder_names

# Choices of the decoder flags; the first of WIDTH_MODES and CANDIDATE_MODES is the default; GATE_MODES' default
# depends on the command (prune.commands._common.add_gate_arg).
VERIFY_MODES = ("live", "replay")  # the target verifies, or its recorded greedy trajectory answers (decode.verifiers)
WIDTH_MODES = ("adaptive", "fixed")  # verify width per round: chosen by the cost model, or the block size
CANDIDATE_MODES = ("adaptive", "all")  # async candidates: as many as pay for themselves, or all that fit
GATE_MODES = ("adaptive", "off")  # speculation gate: plain target steps where drafting does not pay, or draft always


@dataclass
class DecodeConfig:
    """Settings shared by every decoder.

    Attributes:
        max_new_tokens: generated tokens at most (the first token from prefill included).
        block_size: most tokens verified per round (t plus B-1 drafts); None uses the drafter's block
            size. Smaller values keep the drafter's trained geometry and use only its first slots.
        width_policy: chooses each round's verify width (2 .. block_size) from the drafter's confidences
            and the cost model (decode.cost.WidthPolicy); None verifies block_size tokens every round.
            Decisions depend on drafter outputs only, so replay and live decoding make the same ones.
        candidate_policy: async only; how many of the planned candidates each packed pass drafts, 0 for
            none (the round then verifies and drafts as sync), from their probabilities and the cost model
            (decode.cost.CandidatePolicy); None drafts every candidate that fits packed_budget.
        gate_policy: where each sequence's recent rounds commit fewer tokens than their cost buys on
            one-token target steps, run plain target steps for a while (decode.gate.GatePolicy); None drafts
            every round. Decisions depend on committed tokens only, so replay and live make the same ones.
        tree_branches: sync and async, greedy only: next-best ids per slot a round may verify beside the
            drafts, as a draft tree chosen by the width policy's cost model (decode/tree.py); 0 verifies a
            chain. Sampling (temperature > 0) always verifies chains.
        temperature: 0 for greedy; > 0 samples (speculative sampling for sync/async).
        seed: seeds the sampling generator of every sequence.
        stop_ids: token ids that end a sequence (kept in the output), e.g. EOS.
        packed_budget: async only; query tokens the packed pass may spend on candidate blocks.
        fan_out: async only; most bonus guesses per outcome.
        concurrent: async only; overlap the verify pass and the packed pass (False: one after the other).
        draft_threads: async only, CPU: intra-op threads of the concurrent packed pass; the verify pass
            gets the rest (None: decode.worker.default_draft_threads).
        lookahead: async only, and only where every verifier knows its answers ahead (replay): verify
            first, then let the packed pass compute only what the known outcome (a, b) can use - the
            chain up to d_a and the candidates for that outcome, or on a known miss the fallback draft
            itself (one pass per round instead of two). Acceptances and hits are those of the full
            decoder (`round_trace` is unchanged; `packed_tokens` still counts the full pass), at a
            fraction of the drafter work; live verification ignores it.
        context_vocab: where the drafter has a draft vocabulary, each sequence may also propose the ids of its
            own prompt and output that the vocabulary lacks (decode.engine.ContextIds); False proposes from
            the vocabulary alone, as a serving stack with a fixed token map does.
    """

    max_new_tokens: int = 128
    block_size: int | None = None
    width_policy: WidthPolicy | None = None
    candidate_policy: CandidatePolicy | None = None
    gate_policy: GatePolicy | None = None
    tree_branches: int = 0
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    packed_budget: int = 64
    fan_out: int = 3
    concurrent: bool = True
    draft_threads: int | None = None
    lookahead: bool = True
    context_vocab: bool = True

    def verify_block(self, drafter_block: int) -> int:
        """The most tokens a round verifies with a drafter of block size `drafter_block` (ConfigError if unusable)."""
        block = self.block_size or drafter_block
        if not 2 <= block <= drafter_block:
            raise ConfigError(
                f"block size {block} must be in 2..{drafter_block} (the drafter's block_size); "
                "lower --block-size or use a drafter trained with larger blocks"
            )
        return block

    def tuned_to(self, times: PassTimes, width: bool = True, candidates: bool = True, gate: bool = False
                 ) -> "DecodeConfig":
        """These settings with the cost model's policies for pass times `times`: the adaptive verify width
        (when `width`), the packed pass's candidate count (when `candidates`) and the speculation gate (when
        `gate`); others unchanged."""
        return replace(self, width_policy=WidthPolicy.from_times(times) if width else self.width_policy,
                       candidate_policy=CandidatePolicy.from_times(times) if candidates else self.candidate_policy,
                       gate_policy=GatePolicy.from_times(times) if gate else self.gate_policy)

    @property
    def stop_rule(self):
        """The decode.acceptance.StopRule of these settings."""
        from .acceptance import StopRule  # imports torch

        return StopRule(self.max_new_tokens, frozenset(self.stop_ids))


@dataclass
class BaselineConfig:
    """Options of transformers' baselines (decode.baselines).

    Attributes:
        pld_tokens: pld only; tokens proposed per prompt lookup (transformers' prompt_lookup_num_tokens).
        assistant: assisted only; where the assistant model came from (a path; reported, never loaded here).
        assistant_model: assisted only; the loaded assistant (a torch.nn.Module), on the target's device and
            dtype.
    """

    pld_tokens: int = 10
    assistant: str | None = None
    assistant_model: object | None = field(default=None, repr=False, compare=False)

    def settings(self) -> dict:
        """The JSON-ready options (the assistant, where one is given, by name, not its weights)."""
        return {"pld_tokens": self.pld_tokens, **({"assistant": self.assistant} if self.assistant else {})}


@dataclass
class BenchConfig:
    """What to benchmark (decode.bench.run_bench).

    Attributes:
        decoders: names of decode.registry.DECODERS ("ar" runs regardless, as the baseline); see
            decode.bench.select_decoders.
        verify: "live" runs the target; "replay" answers the speculative rows' verification from the `ar`
            trajectory (greedy only; acceptance metrics are exact, times then exclude the target).
        warmup_tokens: max_new_tokens of the untimed warm-up run of each row on the first prompt.
        replay_batch: prompts decoded in lockstep by sync / async under replay (1: one at a time, timed).
        baselines: options of the transformers baselines (pld's lookup length).
    """

    decode: DecodeConfig = field(default_factory=DecodeConfig)
    decoders: tuple[str, ...] = OURS
    verify: str = "live"
    warmup_tokens: int = 16
    replay_batch: int = 1
    baselines: BaselineConfig = field(default_factory=BaselineConfig)

    def validate(self) -> None:
        check_decoder_names(self.decoders)
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"unknown verify mode {self.verify!r}; choose {' or '.join(VERIFY_MODES)}")
        if self.verify == "replay" and self.decode.temperature > 0:
            raise ConfigError("replay verification is greedy only; use --verify live with --temperature > 0")
        sampled_baselines = [d for d in self.decoders if DECODERS[d].kind == BASELINE and self.decode.temperature > 0]
        if sampled_baselines:
            raise ConfigError(f"{sampled_baselines[0]} is a greedy baseline; drop it from --decoder or use "
                              "--temperature 0")
        if self.replay_batch < 1:
            raise ConfigError("--replay-batch must be at least 1")
        if self.replay_batch > 1 and self.verify != "replay":
            raise ConfigError("--replay-batch needs --verify replay (live verification decodes one prompt at a time)")
        if self.decode.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens must be at least 1")
        if self.decode.temperature < 0:
            raise ConfigError("--temperature must be >= 0")
        if self.baselines.pld_tokens < 1:
            raise ConfigError("--pld-tokens must be at least 1")
        if ASSISTED in self.decoders and self.baselines.assistant_model is None:
            raise ConfigError("the assisted decoder needs a draft model; pass --assistant MODEL")
