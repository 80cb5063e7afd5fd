"""Verifiers: the target side of a decoder, live or replayed (docs/design.md, Decoders).

Every verifier follows the `Verifier` protocol: it keeps a position counter; `prefill(prompt)` feeds the
prompt, `verify(tokens)` feeds the next tokens and returns the target's choice after each of them, and
`commit(length)` rolls the state back to the first `length` positions (the committed ones). A decoder
runs unchanged against any of them: `LiveVerifier` runs the target, `ReplayVerifier` answers from its
recorded greedy trajectory. A verify may feed a draft tree (decode/tree.py: each token after its parent);
the commit that follows then names the fed tokens it keeps.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from models.errors import DataError
from models.inference import target_runner
from models.masks import tree_mask
from models.transfer import upload

from .tree import depths


@dataclass
class TargetOutput:
    """The target's answer for n fed tokens.

    Attributes:
        tokens: n greedy choices, the argmax after each fed token (-1 where a replay does not know it).
        probs: float32 Tensor `(n, vocab)` of sampling distributions, on the target's device (the acceptance
            rule reads the few entries it needs from there), or None when greedy.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


@runtime_checkable
class Verifier(Protocol):
    """The target side of a decoder, for one sequence.

    Attributes:
        temperature: 0 when the answers are greedy choices; > 0 when they carry sampling distributions.
        answers_ahead: True when the answer to a verification is known before the target's pass (a replay):
            the async decoder may then compute only the packed-pass work that the known outcome can use.
    """

    temperature: float
    answers_ahead: bool

    def prefill(self, prompt: list[int]) -> TargetOutput:
        """Start a new sequence with `prompt`; returns the target's output after its last token (one row)."""
        ...

    def verify(self, tokens: list[int], parents: list[int] | None = None) -> TargetOutput:
        """Feed `tokens` after the current position; one output row per token. `parents` (greedy only): token
        i follows token parents[i] instead of token i - 1 (a draft tree; -1 for the first token)."""
        ...

    def commit(self, length: int, kept: list[int] | None = None) -> None:
        """Keep only the first `length` positions (the committed tokens); the next verify feeds from there.
        `kept`: after a tree verify, the indices of the fed tokens that hold the committed positions from the
        verify's start on, in order (None: the fed tokens in the order fed, as after a chain)."""
        ...


class LiveVerifier:
    """Runs the target model with a KV cache (batch 1).

    Args:
        model: any transformers causal LM (Llama-family models run the lean forward of models/lean.py, on
            prepacked weights on a CPU: the target must not change while verifiers exist).
        temperature: 0 for greedy; > 0 returns softmax(logits / temperature) as well.
        lean: False forces transformers' own forward.
    """

    answers_ahead = False  # the answer exists only after the target's pass

    def __init__(self, model: torch.nn.Module, temperature: float = 0.0, lean: bool = True):
        self.model = model
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.runner = target_runner(model, lean)  # the target is frozen: prepacked where that is faster
        self.cache = None
        self.length = 0
        self.fed_from = 0  # the position the last verify fed from
        self.runner_dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def _forward(self, tokens: list[int], last_only: bool, parents: list[int] | None = None) -> TargetOutput:
        ids = upload(torch.tensor([tokens], dtype=torch.long), self.device)  # no host wait on CUDA
        if parents is None:
            positions, mask = torch.arange(self.length, self.length + len(tokens), device=self.device)[None], None
        else:
            positions = upload(torch.tensor([depths(parents)], dtype=torch.long), self.device) + self.length
            mask = tree_mask(parents, self.cache.length, self.runner_dtype, self.device)
        self.fed_from = self.length
        hidden = self.runner.forward(ids, positions, mask, self.cache)
        self.length += len(tokens)
        logits = self.runner.logits(hidden[0, -1:] if last_only else hidden[0]).float()
        greedy = logits.argmax(-1).tolist()
        probs = None
        if self.temperature > 0:
            probs = torch.softmax(logits / self.temperature, dim=-1)
        return TargetOutput(greedy, probs)

    def prefill(self, prompt: list[int]) -> TargetOutput:
        """Start a new sequence; returns the target's output after the last prompt token (1 row)."""
        self.cache = self.runner.new_cache(1, capacity=len(prompt) + 256)
        self.length = 0
        return self._forward(prompt, last_only=True)

    def verify(self, tokens: list[int], parents: list[int] | None = None) -> TargetOutput:
        """Feed `tokens` after the current position (as a tree where `parents` is given); one output row per
        token."""
        if parents is not None and self.temperature > 0:
            raise ValueError("draft trees are verified greedily only")
        return self._forward(tokens, last_only=False, parents=parents)

    def commit(self, length: int, kept: list[int] | None = None) -> None:
        """Keep only the first `length` positions; after a tree verify, the fed tokens `kept` hold those from
        the verify's start on (their cache slots move down to follow the committed prefix)."""
        if kept is not None and length > self.fed_from:
            kept = kept[: length - self.fed_from]
            if kept != list(range(len(kept))):
                slots = list(range(self.fed_from)) + [self.fed_from + i for i in kept]
                self.cache.keep_rows(torch.tensor([slots], dtype=torch.long))
        self.cache.crop(length)
        self.length = length


class ReplayVerifier:
    """Answers greedy verification from a recorded target trajectory, without running the target.

    At temperature 0 the committed text is the target's greedy trajectory whatever the drafter does, so
    the target's choice after position j is trajectory[j + 1] for every position on it. Positions past
    the trajectory's end answer -1, which never equals a draft; the stop rule ends decoding there.

    Args:
        trajectory: prompt + the target's greedy continuation (as produced by the `ar` decoder).
    """

    temperature = 0.0
    answers_ahead = True  # the async decoder may skip packed-pass work the outcome cannot use

    def __init__(self, trajectory: list[int]):
        self.trajectory = list(trajectory)
        self.length = 0

    def _answer(self, start: int, count: int) -> TargetOutput:
        end = len(self.trajectory)
        return TargetOutput([self.trajectory[j + 1] if j + 1 < end else -1 for j in range(start, start + count)])

    def prefill(self, prompt: list[int]) -> TargetOutput:
        if self.trajectory[: len(prompt)] != list(prompt):
            raise DataError("the replay trajectory does not start with this prompt; rebuild the trajectory cache")
        self.length = len(prompt)
        return self._answer(len(prompt) - 1, 1)

    def verify(self, tokens: list[int], parents: list[int] | None = None) -> TargetOutput:
        if parents is None:
            out = self._answer(self.length, len(tokens))
        else:  # a node's answer is known where its path is the trajectory's; elsewhere -1, never read
            offsets, on_path = depths(parents), []
            for token, parent, depth in zip(tokens, parents, offsets):
                j = self.length + depth
                on_path.append((parent < 0 or on_path[parent]) and j < len(self.trajectory)
                               and self.trajectory[j] == token)
            answers = self._answer(self.length, max(offsets) + 1).tokens
            out = TargetOutput([answers[depth] if on else -1 for on, depth in zip(on_path, offsets)])
        self.length += len(tokens)
        return out

    def commit(self, length: int, kept: list[int] | None = None) -> None:
        self.length = length
