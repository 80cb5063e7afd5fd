"""Where the target's greedy trajectories come from: the one seam between the target and the pipeline.

Replayed scoring (prune.scoring), a campaign's judging (prune.progressive) and sweep trials (sweeps.objective)
need of the target only its greedy trajectory (prompt + output) per prompt. A `TrajectorySource` says where
those come from; SOURCES names the kinds:

    "live target"    LiveTarget: the loaded target decodes them (prune.scoring.record_trajectories), kept in
                     CACHE/trajectories under prune.cache.trajectory_key (its weights, dtype and device)
    "recorded file"  RecordedFile: read from a JSONL file of the target's outputs (`RecordedOutputs`), recorded
                     once by `prune bench --save-outputs` or by another engine (vLLM, SGLang); the target's
                     weights are never read, so a pair whose target does not fit beside the drafter still scores

A source also says what cache keys hold of the target side (`identity`: a loaded target's weights, dtype and
device; a recorded file's content and the target's config) and which target model is loaded (`target`, None
where none is): live verification, the pass times and a run's speed check need one.

A recorded file holds JSON records, one a line:

    {"output_ids": [...], "prompt_ids": [...], "id": "...", "decoder": "ar"}

`output_ids` (required): the target's greedy output, the prompt left out, cut at its first stop id or at its
cap; recorded with a cap at least the one decoding here (`--max-new-tokens`, `--check-tokens`), it serves
every smaller one (decode.acceptance.StopRule.replayed). `prompt_ids` (or `input_ids`; optional): the prompt's
token ids as the engine saw them, checked against the prompt as tokenized here. `id` (optional): the prompt's
id; where the records carry ids they are matched to the prompts by id, else by position (the n-th record for
the n-th prompt: the calibration prompts, then a run's check prompts, then a sweep's evaluation prompts).
`decoder` (optional): a record naming a decoder other than "ar" is a drafter's output (the other lines of a
`prune bench --save-outputs` file) and is skipped.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from decode.config import DecodeConfig
from models.errors import DataError

from . import cache as keys
from .cache import cached_json, fingerprint, trajectory_key

OUTPUT_FIELD = "output_ids"
PROMPT_FIELDS = ("prompt_ids", "input_ids")  # the first one a record holds is read
ID_FIELD = "id"
TARGET_DECODER = "ar"  # records naming another decoder are drafters' outputs
FIX = ("record the target's greedy output of every prompt the command decodes (prune run: --limit plus "
       "--check-prompts of them; prune sweep: the evaluation prompts too) with prune bench --decoder ar "
       "--save-outputs FILE, or another engine (see prune.trajectories)")


class TrajectorySource(Protocol):
    """Where the target's greedy trajectories come from (see the module docstring).

    Attributes:
        kind: its entry in SOURCES.
        target: the loaded target model, or None where this source has none.
    """

    kind: str
    target: torch.nn.Module | None

    def identity(self) -> list[str]:
        """What cache keys hold of the target side (prune.cache.target_identity)."""

    def trajectories(self, prompts: list[list[int]], decode: DecodeConfig, cache: Path | None = None
                     ) -> list[list[int]]:
        """prompt + the target's greedy output under `decode`'s stop rule, per prompt of `prompts` (token ids);
        `cache`: the cache folder (prune.cache), or None."""


@dataclass
class LiveTarget:
    """Trajectories decoded by the loaded `target` (greedy, the decoders' stop rule), cached by
    prune.cache.trajectory_key."""

    target: torch.nn.Module
    kind: ClassVar[str] = "live target"

    def identity(self) -> list[str]:
        return keys.model_identity(self.target)

    def trajectories(self, prompts, decode, cache=None):
        from . import scoring  # scoring imports this module; its recorder is looked up at the call

        return cached_json(cache and Path(cache) / "trajectories", trajectory_key(self, prompts, decode),
                           lambda: scoring.record_trajectories(self.target, prompts, decode))


@dataclass(frozen=True)
class Recorded:
    """One record of a recorded file: its line, record number (1-based, among the target's records), id and
    prompt ids where it has them, and the output ids."""

    line: int
    number: int
    id: str | None
    prompt_ids: tuple[int, ...] | None
    output_ids: tuple[int, ...]

    def where(self, path) -> str:
        return f"record {self.number} ({path}:{self.line})"


@dataclass
class RecordedOutputs:
    """The target's records of a recorded file (see the module docstring) and the sha256 of its bytes."""

    path: str
    records: list[Recorded]
    digest: str

    @classmethod
    def read(cls, path: str | Path) -> "RecordedOutputs":
        """Read and check every record; a DataError names the file, the line and the fix."""
        from decode.prompts import read_jsonl

        try:
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            lines = read_jsonl(path)
        except (OSError, UnicodeDecodeError, EOFError) as exc:
            raise DataError(f"cannot read the recorded outputs {path} ({exc}); {FIX}") from None
        records = []
        for line, record in lines:
            if isinstance(record, dict) and record.get("decoder", TARGET_DECODER) != TARGET_DECODER:
                continue
            records.append(_record(record, f"{path}:{line}", line, len(records) + 1))
        if not records:
            raise DataError(f"{path} holds no target outputs (records with {OUTPUT_FIELD}); {FIX}")
        if len({r.id is None for r in records}) > 1:
            lacking = next(r for r in records if r.id is None)
            raise DataError(f"{lacking.where(path)} has no {ID_FIELD} where others have one; give every record "
                            "its prompt's id, or none (records then match the prompts by position)")
        return cls(str(path), records, digest)

    def match(self, prompts) -> dict[tuple[int, ...], Recorded]:
        """{prompt token ids: its record} for `prompts` (decode.prompts.Prompt: id and token ids), by id where
        the records carry ids, else by position; a record's prompt ids, where it has them, must be its
        prompt's. A DataError names the first prompt without a record, or the record that does not match."""
        by_id = self.records[0].id is not None
        if by_id:
            _check_distinct_ids(prompts)
            recorded = {}
            for record in self.records:
                recorded.setdefault(record.id, record)
            missing = [p for p in prompts if p.id not in recorded]
            if missing:
                raise DataError(f"{self.path} has no record for prompt {missing[0].id!r} ({len(missing)} of "
                                f"{len(prompts)} prompts without one); {FIX}")
            chosen = [recorded[p.id] for p in prompts]
        else:
            if len(self.records) < len(prompts):
                missing = prompts[len(self.records)]
                raise DataError(f"{self.path} holds {len(self.records)} records for {len(prompts)} prompts (none for "
                                f"prompt {len(self.records) + 1}, id {missing.id!r}); records without ids match the "
                                f"prompts by position: {FIX}")
            chosen = self.records[:len(prompts)]
        matched = {}
        for index, (prompt, record) in enumerate(zip(prompts, chosen), start=1):
            if record.prompt_ids is not None and list(record.prompt_ids) != list(prompt.input_ids):
                raise DataError(f"{record.where(self.path)}: its prompt ids differ from prompt {index}'s (id "
                                f"{prompt.id!r}; {_difference(record.prompt_ids, prompt.input_ids)}); record the "
                                "outputs from the prompts as tokenized here (same prompts, order, --limit, chat "
                                "template)")
            matched.setdefault(tuple(prompt.input_ids), record)
        return matched


@dataclass
class RecordedFile:
    """Trajectories from a recorded file of the target's outputs (`RecordedOutputs`), matched to the prompts
    when it is opened; the target's weights are never read.

    Attributes:
        outputs: the file's records.
        matched: {prompt token ids: record} of every prompt it serves (RecordedOutputs.match).
        target_config: the target's config (a transformers config), part of the identity.
        target: a target loaded beside it (live verification), part of the identity too; else None.
    """

    outputs: RecordedOutputs
    matched: dict = field(repr=False)
    target_config: object = None
    target: torch.nn.Module | None = None
    kind: ClassVar[str] = "recorded file"

    @classmethod
    def open(cls, path: str | Path, prompts, target_config=None, target=None) -> "RecordedFile":
        """The recorded file at `path` for `prompts` (decode.prompts.Prompt, every prompt the command decodes)."""
        outputs = RecordedOutputs.read(path)
        return cls(outputs, outputs.match(prompts), target_config, target)

    def identity(self) -> list[str]:
        """[kind, the file's sha256, the target config's digest (where it lies and the transformers version
        that read it left out), and a loaded target's model_identity where there is one]."""
        config = self.target_config.to_dict() if hasattr(self.target_config, "to_dict") else self.target_config
        config = {k: v for k, v in (config or {}).items() if not k.startswith("_") and k != "transformers_version"}
        loaded = keys.model_identity(self.target) if self.target is not None else []
        return [self.kind, self.outputs.digest, fingerprint("target config", config), *loaded]

    def outputs_for(self, prompts: list[list[int]], decode: DecodeConfig) -> list[list[int]]:
        """The target's greedy output of each prompt of `prompts` (token ids) under `decode`'s stop rule."""
        rule = decode.stop_rule
        outputs = []
        for prompt in prompts:
            record = self.matched.get(tuple(prompt))
            if record is None:
                raise DataError(f"{self.outputs.path} was not matched to a prompt of {len(prompt)} tokens decoded "
                                f"here; open it with every prompt (RecordedFile.open)")
            output = rule.replayed(record.output_ids)
            if output is None:
                raise DataError(
                    f"{record.where(self.outputs.path)}: its output of {len(record.output_ids)} tokens ends before "
                    f"{decode.max_new_tokens} tokens at id {record.output_ids[-1] if record.output_ids else None}, "
                    f"which is not a stop id of this target ({sorted(decode.stop_ids)}); record the outputs with at "
                    "least --max-new-tokens (and --check-tokens) new tokens and the target's own stop ids")
            outputs.append(output)
        return outputs

    def trajectories(self, prompts, decode, cache=None):
        return [list(prompt) + output for prompt, output in zip(prompts, self.outputs_for(prompts, decode))]


# kind -> the source; a new place trajectories come from adds its entry here.
SOURCES = {LiveTarget.kind: LiveTarget, RecordedFile.kind: RecordedFile}


def as_source(target) -> TrajectorySource | None:
    """`target` as a trajectory source: a loaded target model is its live source; a source (or None) is itself."""
    return LiveTarget(target) if isinstance(target, torch.nn.Module) else target


class HasSource:
    """Mixin of a dataclass with a `source` field (a TrajectorySource, or a loaded target that becomes its live
    source): the loaded target, where the source has one, as `target`."""

    def __post_init__(self):
        self.source = as_source(self.source)

    @property
    def target(self):
        """The loaded target model (None where the source has none)."""
        return self.source.target if self.source is not None else None


def _record(record, where: str, line: int, number: int) -> Recorded:
    """A Recorded of one JSON record of a recorded file; a DataError naming `where` unless it is one."""
    if not isinstance(record, dict) or not _token_ids(record.get(OUTPUT_FIELD), empty=True):
        raise DataError(f"{where}: a record needs {OUTPUT_FIELD}, the target's output as a list of token ids "
                        "(integers >= 0)")
    prompt_field = next((name for name in PROMPT_FIELDS if name in record), None)
    prompt = record.get(prompt_field) if prompt_field else None
    if prompt_field and not _token_ids(prompt):
        raise DataError(f"{where}: {prompt_field} must be a non-empty list of token ids (integers >= 0)")
    record_id = record.get(ID_FIELD)
    return Recorded(line, number, str(record_id) if record_id is not None else None,
                    tuple(prompt) if prompt_field else None, tuple(record[OUTPUT_FIELD]))


def _token_ids(value, empty: bool = False) -> bool:
    return (isinstance(value, list) and (empty or bool(value))
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value))


def _check_distinct_ids(prompts) -> None:
    """A DataError where two different prompts share an id: records matched by id could not tell them apart."""
    seen = {}
    for prompt in prompts:
        other = seen.setdefault(prompt.id, prompt.input_ids)
        if other != prompt.input_ids:
            raise DataError(f"two different prompts share the id {prompt.id!r}, so records matched by id cannot tell "
                            "them apart; give the prompts distinct ids, or record the outputs without ids, one a "
                            "prompt in order")


def _difference(recorded, here) -> str:
    """Where two token id lists part, in words."""
    first = next((i for i, (a, b) in enumerate(zip(recorded, here)) if a != b), min(len(recorded), len(here)))
    return f"{len(recorded)} tokens recorded, {len(here)} here, first difference at token {first}"


def source_record(source) -> dict:
    """A source as a report's settings hold it: its kind and, for a recorded file, the file and its sha256."""
    if isinstance(source, RecordedFile):
        return {"kind": source.kind, "file": source.outputs.path, "sha256": source.outputs.digest}
    return {"kind": getattr(source, "kind", LiveTarget.kind)}
