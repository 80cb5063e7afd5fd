"""The decoders by name: the one table that the decoders, the benchmark, the generator and the CLI read.

An entry names a decoder, says what kind it is and where its function lives ("module:function", imported
on first use, so reading the table - for `--help` - imports no torch). Adding a decoder is one entry here
plus its function; every `--decoder` choice, help text and dispatch follows from the table.

Kinds and the signature of their function:

    target       the target alone, through our forward (ar):
                 function(target, prompt ids, DecodeConfig, on_commit=None) -> DecodeResult
    speculative  a drafter verified by the target (sync, async): one round of decode.decoders.decode_speculative,
                 function(engine, sequences, block, DecodeConfig, lookahead) -> None
    baseline     transformers' own generate() on the target (greedy, live target only):
                 function(target, prompt ids, DecodeConfig, BaselineConfig) -> DecodeResult

The table's order is the report order of `prune bench`.
"""

import importlib
from dataclasses import dataclass
from typing import Iterable

from models.errors import ConfigError

TARGET, SPECULATIVE, BASELINE = "target", "speculative", "baseline"
ASSISTED = "assisted"  # the baseline that runs only where an assistant model is given


@dataclass(frozen=True)
class Decoder:
    """One decoder of the table (see the module docstring); calling it calls its function.

    Attributes:
        name: the `--decoder` name and the report's row name.
        kind: TARGET, SPECULATIVE or BASELINE.
        help: what it does, in a few words (shown by --help).
        entry: "module:function" of its implementation.
        needs_assistant: runs only with an assistant model (decode.config.BaselineConfig.assistant_model).
    """

    name: str
    kind: str
    help: str
    entry: str
    needs_assistant: bool = False

    @property
    def function(self):
        module, attribute = self.entry.split(":")
        return getattr(importlib.import_module(module), attribute)

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


DECODERS: dict[str, Decoder] = {decoder.name: decoder for decoder in (
    Decoder("ar", TARGET, "the target alone, one token per pass: the baseline and the reference output",
            "decode.decoders:decode_ar"),
    Decoder("sync", SPECULATIVE, "draft a block, verify it, repeat", "decode.decoders:sync_round"),
    Decoder("async", SPECULATIVE, "D3D: the next block is drafted while the target verifies",
            "decode.decoders:async_round"),
    Decoder("pld", BASELINE, "transformers' prompt lookup", "decode.baselines:decode_pld"),
    Decoder("generate", BASELINE, "transformers' greedy generate()", "decode.baselines:decode_generate"),
    Decoder(ASSISTED, BASELINE, "transformers' assisted generation with --assistant",
            "decode.baselines:decode_assisted", needs_assistant=True),
)}


def names(*kinds: str) -> tuple[str, ...]:
    """The names of the decoders of `kinds`, in table order."""
    return tuple(name for name, decoder in DECODERS.items() if decoder.kind in kinds)


OURS = names(TARGET, SPECULATIVE)  # the decoders of decode.decoders: ar, sync, async
BASELINES = {name: DECODERS[name] for name in names(BASELINE)}


def check_decoder_names(given: Iterable[str], allow_all: bool = False) -> None:
    """ConfigError naming the choices unless every name is a decoder (or "all", where allowed)."""
    known = tuple(DECODERS) + (("all",) if allow_all else ())
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ConfigError(f"unknown decoder {unknown[0]!r}; choose from {', '.join(DECODERS)} or all")


def describe(*kinds: str) -> str:
    """`name (help), ...` of the decoders of `kinds`, for --help."""
    return ", ".join(f"{name} ({DECODERS[name].help})" for name in names(*kinds))
