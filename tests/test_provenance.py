"""A drafter's record of its training prompts (models/provenance.py) and the overlap warning of the
measuring commands: prompts it was trained on are flagged, disjoint ones are not, and the record survives
pruning and export."""

import json

import pytest

from _pairs import save_chat_pair
from models.provenance import (FILE, overlap, prompt_digest, prompt_set, read_training_prompts, record_text,
                               training_prompts_text)
from prune.cli import main

SEEN = ["Write a haiku about rain.", "What is 12 * 7?", "Explain recursion briefly."]
UNSEEN = ["Name three rivers in Africa.", "Why is snow white?"]


def record(folder, *sets):
    (folder / FILE).write_text(training_prompts_text(list(sets)))


def test_prompt_sets_digest_stripped_text_and_hash_the_set_not_its_order():
    first, second = prompt_set("a", SEEN), prompt_set("b", list(reversed(SEEN)) + ["  " + SEEN[0] + "\n", ""])
    assert first["prompts"] == second["prompts"] == 3 and first["sha256"] == second["sha256"]
    assert first["digests"] == sorted(prompt_digest(text) for text in SEEN)
    assert prompt_set("a", SEEN[:2])["sha256"] != first["sha256"]
    assert record_text({"prompt": "x"}) == "x"
    assert record_text({"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"},
                                     {"role": "user", "content": "q2"}]}) == "q2"


def test_overlap_counts_distinct_prompts_once_across_sets(tmp_path):
    record(tmp_path, prompt_set("one", SEEN[:2]), prompt_set("two", SEEN[1:]))
    sets = read_training_prompts(tmp_path)
    assert overlap(sets, SEEN + UNSEEN) == (3, {"one": 2, "two": 2})
    assert overlap(sets, UNSEEN) == (0, {})
    assert read_training_prompts(tmp_path / "elsewhere") is None


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    root = save_chat_pair(tmp_path_factory.mktemp("provenance"))
    for name, texts in (("seen", SEEN), ("unseen", UNSEEN)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"{name}{i}", "prompt": t}) + "\n"
                                                    for i, t in enumerate(texts)))
    record(root / "drafter", prompt_set("my-distill", SEEN))
    return root


def run_args(root, prompts, out):
    return ["run", "--drafter", str(root / "drafter"), "--target", str(root / "target"), "--prompts",
            str(root / prompts), "--max-new-tokens", "6", "--out", str(out), "--layers-to-remove", "1",
            "--heal-steps", "0", "--min-retention", "0.01", "--no-stop-on-speedup", "--speed-prompts", "0",
            "--no-wandb"]


def test_prune_run_warns_when_it_calibrates_on_training_prompts_and_keeps_the_record(chat_pair, tmp_path, capsys):
    assert main(run_args(chat_pair, "seen.jsonl", tmp_path / "seen")) == 0
    err = capsys.readouterr().err
    assert "warning: 3 of 3 prompts" in err and "my-distill 3" in err
    # The pruned step was trained on what its source was trained on.
    assert read_training_prompts(tmp_path / "seen" / "step-01") == read_training_prompts(chat_pair / "drafter")

    assert main(run_args(chat_pair, "unseen.jsonl", tmp_path / "unseen")) == 0
    assert "training data" not in capsys.readouterr().err
