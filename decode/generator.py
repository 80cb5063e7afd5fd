"""Generate with a drafter: the public Python API (`prune generate` is a thin layer over it).

    from decode.generator import Generator

    generator = Generator("pruned/final", "path/to/target")   # a drafter folder and a target folder or .gguf
    reply = generator.generate("Write a haiku about the sea.", max_new_tokens=64)
    print(reply.text, reply.stats["tokens_per_s"], reply.stats["tau"])
    for piece in generator.stream("Tell me a joke."):        # text pieces as tokens are committed
        print(piece, end="", flush=True)

Any drafter folder works, the unpruned one or an exported `step-XX` / `final`; the target is a folder, a
`.gguf` file or an already-loaded transformers model. Prompts are text (through the tokenizer's chat
template, as `prune bench` applies it), a chat (a list of {role, content}) or token ids. Greedy replies
equal the target's own greedy reply token for token in float32 (the decoders are exact); with
temperature > 0 replies follow the target's distribution and are reproducible for a seed.
"""

import queue
import threading
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from models.demo import demo_drafter_dir, resolve_demo_target
from models.errors import ConfigError, DataError
from models.pair import Pair, load_pair, pair_with_target
from models.precision import resolve_dtype

from .config import GATE_MODES, WIDTH_MODES, DecodeConfig
from .decoders import DECODERS, DecodeResult, decode_one
from .detokenize import TextStream
from .metrics import summarize
from .prompts import Prompt, check_context, check_record, tokenize_records
from .timing import measure_pass_times


@dataclass
class Generation:
    """One reply.

    Attributes:
        text: the reply as text, special tokens (EOS) left out; None when there is no tokenizer.
        ids: generated token ids (prompt excluded), ending at the first stop id or at max_new_tokens.
        prompt_ids: the prompt's token ids (chat template applied).
        stats: see `generation_stats`.
        result: the decoder's full record (rounds with acceptances, hits and times).
    """

    text: str | None
    ids: list[int]
    prompt_ids: list[int]
    stats: dict
    result: DecodeResult


def generation_stats(results: list[DecodeResult], block_size: int | None) -> dict:
    """Speed and acceptance of one reply or several, pooled.

    Returns:
        tokens (generated), tokens_per_s (timed as `prune bench` times them: tokens after the first over
        the decode time, prefill excluded), tau (mean committed tokens per drafting round, pooled over rounds;
        1 for ar), gated_share (share of rounds the speculation gate ran as plain target steps; None for ar),
        hit_rate (async: share of rounds whose next draft came from the packed pass; else None), prefill_s and
        decode_s (seconds).
    """
    summary = summarize(results, block_size)
    return {"tokens": summary["output_tokens"], "tokens_per_s": summary["tokens_per_s"], "tau": summary["tau_micro"],
            "gated_share": summary.get("gated_share"), "hit_rate": summary.get("hit_rate"),
            "prefill_s": summary["prefill_s"], "decode_s": summary["decode_s"]}


class Generator:
    """A drafter and its target, ready to answer prompts.

    Args:
        drafter: a drafter folder (None: the demo drafter).
        target: a target folder or `.gguf` file (None: the demo target, prepared once in the cache), or a
            loaded transformers causal LM (the drafter then loads on its device).
        tokenizer: the tokenizer to use (default: the target folder's, else the drafter folder's).
        decoder: "async" (D3D: drafting overlaps verification), "sync" or "ar" (the target alone).
        dtype: compute dtype of loaded models: "auto" (bfloat16 where the device computes it natively),
            "float32", "bfloat16", "float16" or a torch dtype.
        drafter_dtype: the drafter's compute dtype, read the same way, except that "auto" is float32 on a CPU
            and the target's dtype elsewhere (models/precision.py).
        device: torch device of loaded models.
        width: "adaptive" verifies per round the width the cost model prefers (pass times measured once
            here, a few seconds); "fixed" verifies the drafter's whole block.
        gate: "adaptive" runs plain target steps for a while where a reply's recent rounds commit fewer tokens
            than their cost buys on one-token steps (decode.gate; pass times measured as for `width`); "off"
            drafts every round.
        tree_branches: greedy replies: next-best ids per slot a round may verify as a draft tree
            (decode/tree.py; 0: chains).
        chat_template: run text prompts through the tokenizer's chat template.
        cache_dir: where the demo target is cached (None: $D3D_PRUNE_CACHE or $XDG_CACHE_HOME/d3d-prune).
        drafter_keys: {"block_size": B, "mask_token_id": ID} for a drafter whose config.json lacks them
            (models.drafter_config.with_drafter_keys).

    Attributes:
        pair: the loaded models.Pair (drafter, target, tokenizer, stop ids).
        config: the decode.config.DecodeConfig of every call; `generate` sets its max_new_tokens,
            temperature and seed. Replace it to change the decoder settings.
    """

    def __init__(self, drafter=None, target=None, *, tokenizer=None, decoder: str = "async",
                 dtype: str | torch.dtype = "auto", drafter_dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "cpu", width: str = "adaptive", gate: str = "adaptive",
                 tree_branches: int = DecodeConfig.tree_branches, chat_template: bool = True, cache_dir=None,
                 drafter_keys: dict | None = None):
        if decoder not in DECODERS:
            raise ConfigError(f"unknown decoder {decoder!r}; choose from {', '.join(DECODERS)}")
        if width not in WIDTH_MODES:
            raise ConfigError(f"unknown width {width!r}; choose {' or '.join(WIDTH_MODES)}")
        if gate not in GATE_MODES:
            raise ConfigError(f"unknown gate {gate!r}; choose {' or '.join(GATE_MODES)}")
        if tree_branches < 0:
            raise ConfigError(f"tree_branches must be >= 0 (got {tree_branches}); 0 verifies chains")
        self.pair = _load_pair(drafter, target, tokenizer, dtype, drafter_dtype, torch.device(device), cache_dir,
                               drafter_keys)
        self.decoder = decoder
        self.chat_template = chat_template
        self.config = DecodeConfig(stop_ids=self.pair.stop_ids, tree_branches=tree_branches)
        if "adaptive" in (width, gate) and decoder != "ar":
            times = measure_pass_times(self.pair.target, self.pair.drafter, self.config)
            self.config = self.config.tuned_to(times, width=width == "adaptive", gate=gate == "adaptive")

    def prompt_ids(self, prompt, max_new_tokens: int | None = None) -> list[int]:
        """The token ids of `prompt`: text, a chat list, token ids (a list or a 1-D tensor) or a prompt-file
        record ({"prompt" | "messages" | "input_ids": ...}). With `max_new_tokens`, a DataError if the
        prompt and the reply do not fit the models' context."""
        record = _record(prompt)
        check_record(record, "the prompt")
        ids = tokenize_records([record], self.pair.tokenizer, self.chat_template)[0].input_ids
        if max_new_tokens is not None:
            check_context([Prompt(str(record.get("id", "prompt")), ids)], max_new_tokens,
                          self.pair.drafter.config.block_size, self.pair.max_positions)
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 on_text: Callable[[str], None] | None = None) -> Generation:
        """Reply to `prompt` (see prompt_ids); `on_text(piece)` receives the text as tokens are committed.

        Greedy at temperature 0; otherwise speculative sampling seeded by `seed`, so a seed reproduces a reply.
        """
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if temperature < 0:
            raise ConfigError("temperature must be >= 0 (0 is greedy)")
        if on_text is not None and self.pair.tokenizer is None:
            raise DataError("streaming text needs a tokenizer; give the target folder its tokenizer files, pass "
                            "tokenizer=..., or read Generation.ids")
        ids = self.prompt_ids(prompt, max_new_tokens)
        config = replace(self.config, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        stream = TextStream(self.pair.tokenizer) if on_text is not None else None

        def on_commit(_row: int, committed: list[int]) -> None:
            piece = stream.push(committed)
            if piece:
                on_text(piece)

        result = decode_one(self.decoder, self.pair.drafter, self.pair.target, ids, config,
                            on_commit=on_commit if stream is not None else None)
        tail = stream.finish() if stream is not None else ""
        if tail:
            on_text(tail)
        text = self.pair.tokenizer.decode(result.output_ids, skip_special_tokens=True) if self.pair.tokenizer else None
        return Generation(text, result.output_ids, ids, generation_stats([result], self.block_size), result)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0) -> "TextIterator":
        """`generate` as an iterator of text pieces; the Generation is its `.generation` once exhausted."""
        return TextIterator(self, prompt, dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))

    @property
    def block_size(self) -> int | None:
        """The drafter's block size for the acceptance statistics (None for ar, which drafts nothing)."""
        return None if self.decoder == "ar" else self.pair.drafter.config.block_size


class TextIterator:
    """Text pieces of one reply, decoded on a helper thread while the caller reads them.

    Leaving the loop early stops the decoding at its next piece. Errors of the decoding are raised here.
    """

    def __init__(self, generator: Generator, prompt, options: dict):
        self.generation: Generation | None = None
        self._pieces: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        threads = torch.get_num_threads()  # torch's thread count is per thread: the helper takes the caller's

        def put(piece: str) -> None:
            if self._stop.is_set():
                raise _Stopped
            self._pieces.put(piece)

        def decode() -> None:
            torch.set_num_threads(threads)
            try:
                self._pieces.put(_End(generator.generate(prompt, on_text=put, **options)))
            except _Stopped:
                self._pieces.put(_End(None))
            except BaseException as error:  # noqa: BLE001 - handed to the reading thread
                self._pieces.put(_End(None, error))

        self._thread = threading.Thread(target=decode, name="d3d-generate", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                item = self._pieces.get()
                if isinstance(item, str):
                    yield item
                    continue
                if item.error is not None:
                    raise item.error
                self.generation = item.generation
                return
        finally:
            self._stop.set()
            self._thread.join()


class _Stopped(Exception):
    """Raised inside the decoding thread when the reader has left."""


@dataclass
class _End:
    generation: Generation | None
    error: BaseException | None = None


def _record(prompt) -> dict:
    """The prompt-file record of a prompt given as text, a chat, token ids or a record."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return {"messages": list(prompt)}
    if isinstance(prompt, (list, tuple)):
        return {"input_ids": list(prompt)}
    raise DataError(f"a prompt is text, a list of chat messages or a list of token ids, not {type(prompt).__name__}")


def _load_pair(drafter, target, tokenizer, dtype, drafter_dtype, device: torch.device, cache_dir,
               drafter_keys=None) -> Pair:
    """The pair of the Generator's arguments (see its docstring)."""
    drafter = drafter if drafter is not None else demo_drafter_dir()
    if isinstance(target, torch.nn.Module):
        return pair_with_target(drafter, target, tokenizer, drafter_dtype, drafter_keys)
    target = target if target is not None else resolve_demo_target(cache_dir)
    pair = load_pair(drafter, target, resolve_dtype(dtype, device), device, drafter_dtype, drafter_keys)
    if tokenizer is not None:
        pair.tokenizer = tokenizer
    return pair
