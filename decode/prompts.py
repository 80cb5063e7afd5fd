"""Prompt files and their tokenization.

A prompt file is JSONL; each record holds one of
    "prompt":    text (the tokenizer's chat template is applied when it has one, unless disabled),
    "messages":  a chat list [{"role": ..., "content": ...}, ...] (needs a chat template),
    "input_ids": pre-tokenized ids (no tokenizer needed),
and optionally "id". Built-in suites (decode.suites) yield the same records.
"""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from models.errors import DataError

PROMPT_KEYS = ("prompt", "messages", "input_ids")


@dataclass
class Prompt:
    """A prompt ready for decoding: its id and token ids."""

    id: str
    input_ids: list[int]


def read_jsonl(path: str | Path) -> list[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSONL file (gzip-compressed when its name ends in
    .gz); a line that is not JSON is a DataError naming the file and the line."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    values = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                values.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not valid JSON ({exc.msg}); write one JSON object per "
                                "line") from None
    return values


def read_prompt_file(path: str | Path) -> list[dict]:
    """Read and validate a JSONL prompt file; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist; pass a JSONL file with one prompt per line")
    records = []
    for number, record in read_jsonl(path):
        check_record(record, f"{path}:{number}")
        record.setdefault("id", str(len(records)))
        records.append(record)
    if not records:
        raise DataError(f"prompt file {path} holds no prompts")
    return records


def check_record(record, where: str) -> None:
    """DataError naming `where` unless `record` is a valid prompt record (see the module docstring)."""
    if not isinstance(record, dict) or sum(key in record for key in PROMPT_KEYS) != 1:
        raise DataError(f"{where}: each record needs exactly one of {', '.join(PROMPT_KEYS)}")
    if "input_ids" in record:
        ids = record["input_ids"]
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DataError(f"{where}: input_ids must be a non-empty list of non-negative integers")
    if "prompt" in record and not (isinstance(record["prompt"], str) and record["prompt"]):
        raise DataError(f"{where}: prompt must be a non-empty string")
    if "messages" in record and not (isinstance(record["messages"], list) and record["messages"]):
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")


def tokenize_records(records: list[dict], tokenizer=None, chat_template: bool = True) -> list[Prompt]:
    """Token ids for each record (see the module docstring for the record kinds)."""
    prompts = []
    for index, record in enumerate(records):
        record_id = str(record.get("id", index))
        if "input_ids" in record:
            prompts.append(Prompt(record_id, list(record["input_ids"])))
            continue
        if tokenizer is None:
            raise DataError(
                f"prompt {record_id!r} is text but no tokenizer is available; "
                "give the target folder its tokenizer files or use input_ids records"
            )
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if "messages" in record:
            if not has_template:
                raise DataError(f"prompt {record_id!r} is a chat but the tokenizer has no chat template")
            ids = _apply_template(tokenizer, record["messages"])
        elif chat_template and has_template:
            ids = _apply_template(tokenizer, [{"role": "user", "content": record["prompt"]}])
        else:
            ids = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        prompts.append(Prompt(record_id, list(ids)))
    return prompts


def _apply_template(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_context(prompts: list[Prompt], max_new_tokens: int, block_size: int, max_positions: int) -> None:
    """Raise DataError if a prompt plus its generation (and one draft block) exceeds the context."""
    for prompt in prompts:
        need = len(prompt.input_ids) + max_new_tokens + 2 * block_size
        if need > max_positions:
            raise DataError(
                f"prompt {prompt.id!r} has {len(prompt.input_ids)} tokens; with --max-new-tokens {max_new_tokens} "
                f"and two blocks of {block_size} it needs {need} positions but the models allow {max_positions}; "
                "shorten the prompt or lower --max-new-tokens"
            )



def select_records(records: list[dict], limit: int | None = None) -> list[dict]:
    """The first `limit` records (all when None)."""
    if limit is not None and limit < 1:
        raise DataError(f"--limit {limit} must be at least 1")
    return records[:limit] if limit else records
