"""Distillation data: prompts disjoint from evaluation, deterministic, and resumable generation."""

import ast
import collections
import json
import os

import pytest
import torch

from prune.training.data import distillation_summary, generate_distillation_data, load_distillation_data
from prune.training.prompts import collect_training_prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAKE_MODULE = '''
def add(a, b):
    """Return the sum of two numbers, converting strings to integers first when needed."""
    if isinstance(a, str):
        a = int(a)
    return a + b


class Counter:
    """Count how many times each hashable item was seen, like a tiny multiset container."""

    def __init__(self):
        self.items = {}

    def add(self, item):
        self.items[item] = self.items.get(item, 0) + 1
        return self.items[item]
'''


def test_no_evaluation_prompt_in_training_prompts():
    from models.errors import D3DError
    from prune.training.prompts import evaluation_prompts

    try:
        eval_texts = evaluation_prompts(strict=True)
    except D3DError as exc:
        pytest.skip(f"evaluation suites cannot be loaded here ({exc})")
    assert len(eval_texts) > 400
    prompts = [p["prompt"] for style in ("general", "suites")
               for p in collect_training_prompts(600, seed=0, style=style)]
    leaks = [(e[:60], p[:60]) for e in eval_texts for p in prompts if e in p]
    assert not leaks


def test_train_style_is_the_suites_training_parts_and_no_held_out_prompt():
    from decode.suites import HELD_OUT_PARTS, SUITES, load_suite
    from models.errors import ConfigError, D3DError
    from prune.training.prompts import evaluation_prompts

    try:
        held_out = evaluation_prompts(strict=True, parts=HELD_OUT_PARTS)
    except D3DError as exc:
        pytest.skip(f"evaluation suites cannot be loaded here ({exc})")
    prompts = collect_training_prompts(257, seed=0, style="train")
    train = {r["prompt"] for name in SUITES for r in load_suite(f"{name}:train")}
    assert {p["prompt"] for p in prompts} == train and len(train) == 82 + 135 + 40
    assert not [p["id"] for p in prompts for e in held_out if e in p["prompt"]]
    assert prompts == collect_training_prompts(257, seed=0, style="train")
    assert collect_training_prompts(10, seed=1, style="train") != prompts[:10]
    with pytest.raises(ConfigError, match="--num-prompts 257 or fewer"):
        collect_training_prompts(258, style="train")


def test_champ_style_is_champ_formats_on_training_part_problems_only():
    from decode.suites import champ_prompt_variants, load_suite
    from models.errors import ConfigError, D3DError

    try:
        problems = {part: {r["id"]: r["prompt"].split("\n\n", 1)[1] for r in load_suite(f"champ:{part}")}
                    for part in ("train", "calib", "eval")}
    except D3DError as exc:
        pytest.skip(f"the champ suite cannot be loaded here ({exc})")
    prompts = collect_training_prompts(921, seed=0, style="champ")
    assert len({p["prompt"] for p in prompts}) == 921
    # Every prompt is about a training-part problem (named in its id, its text quoted except for the
    # concept-first formats), and no held-out problem's text appears anywhere.
    for p in prompts:
        pid, fmt = p["id"].split("|")
        assert pid in problems["train"]
        assert problems["train"][pid] in p["prompt"] or fmt.startswith(("Name C", "Example C"))
    held_out = [*problems["calib"].values(), *problems["eval"].values()]
    assert not [p["id"] for p in prompts for text in held_out if text in p["prompt"]]
    plain = set(r["prompt"] for r in load_suite("champ:train"))
    assert not plain & {p["prompt"] for p in prompts}
    assert prompts == collect_training_prompts(921, seed=0, style="champ")
    assert {p["id"] for p in champ_prompt_variants("train")} == {p["id"] for p in prompts}
    with pytest.raises(ConfigError, match="--num-prompts 921 or fewer"):
        collect_training_prompts(922, style="champ")


def test_overlap_filter_drops_prompts_that_contain_an_evaluation_prompt():
    from prune.training.prompts import drop_evaluation_overlap

    prompts = [{"prompt": "Explain:\n\ndef f(x):\n    return x"}, {"prompt": "What is 2 * 3?"}, {"prompt": "hello"}]
    kept = drop_evaluation_overlap(prompts, ["def f(x):\n    return x", "hello"])
    assert kept == [{"prompt": "What is 2 * 3?"}]


def test_prompt_selection_is_deterministic():
    first = collect_training_prompts(40, seed=3)
    assert first == collect_training_prompts(40, seed=3)
    assert first != collect_training_prompts(40, seed=4)
    assert len({p["prompt"] for p in first}) == 40
    assert {"synthetic/math"} < {p["source"] for p in first}


def test_suite_style_prompts_use_the_suites_instructions_on_material_of_their_own():
    from decode.suites import CHAMP_INSTRUCTION, HUMANEVAL_INSTRUCTION
    from models.errors import ConfigError

    prompts = collect_training_prompts(60, seed=0, style="suites")
    assert prompts == collect_training_prompts(60, seed=0, style="suites")
    by_source = {}
    for p in prompts:
        by_source.setdefault(p["source"], []).append(p["prompt"])
    assert {k: len(v) for k, v in by_source.items()} == {"stdlib/signature": 30, "synthetic/competition": 30}
    head, tail = HUMANEVAL_INSTRUCTION.split("{prompt}")
    for text in by_source["stdlib/signature"]:  # a signature and its docstring, nothing of the body
        code = text[len(head) : -len(tail)]
        assert text.startswith(head) and text.endswith(tail) and code.startswith("def ")
        function = ast.parse(code + "    ...\n").body[0]
        assert ast.get_docstring(function) and len(function.body) == 2
    champ_head = CHAMP_INSTRUCTION.split("{text}")[0]
    assert all(t.startswith(champ_head) and len(t) > len(champ_head) + 20 for t in by_source["synthetic/competition"])
    # The general style is unchanged by the new one (data folders made before it stay valid).
    assert collect_training_prompts(40, seed=3) == collect_training_prompts(40, seed=3, style="general")
    with pytest.raises(ConfigError, match="--style"):
        collect_training_prompts(4, style="chatty")


def make_tiny_target(folder):
    """A random 2-layer Llama with a byte-level tokenizer and a ChatML template, saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|pad|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_generation_writes_shards_and_a_restart_skips_them(tmp_path, monkeypatch):
    target = make_tiny_target(tmp_path / "target")
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "alpha.py").write_text(FAKE_MODULE)
    (stdlib / "beta.py").write_text(FAKE_MODULE.replace("add", "merge").replace("Counter", "Tally"))
    out = tmp_path / "data"
    kwargs = dict(num_prompts=6, max_new_tokens=4, batch_size=2, seed=0, shard_size=4, progress=False,
                  stdlib_dir=stdlib)
    generate_distillation_data(target, out, **kwargs)
    shards = sorted(p.name for p in out.glob("shard-*.jsonl"))
    assert shards == ["shard-00000.jsonl", "shard-00001.jsonl"]
    records = load_distillation_data(out)
    assert len(records) == 6
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    for record in records:
        assert 1 <= len(record["response_ids"]) <= 4
        text = tokenizer.decode(record["prompt_ids"])
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
        assert record["prompt"] in text

    # Restart after losing the second shard: the first is skipped, the second regenerated identically.
    first = out / "shard-00000.jsonl"
    before = (first.stat().st_ino, first.stat().st_mtime_ns)
    lost = (out / "shard-00001.jsonl").read_text()
    os.remove(out / "shard-00001.jsonl")
    # What `prune distill --json` reports: finished shards of all, and the responses they hold.
    summary = distillation_summary(out)
    assert (summary["shards_finished"], summary["shards"], summary["responses"]) == (1, 2, 4)
    assert summary["response_tokens"] == sum(len(r["response_ids"]) for r in records[:4])
    assert summary["num_prompts"] == 6 and 0 <= summary["stopped_at_eos"] <= 1
    calls = []
    import prune.training.data as distill

    real = distill._generate
    monkeypatch.setattr(distill, "_generate", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    generate_distillation_data(target, out, **kwargs)
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == before
    assert (out / "shard-00001.jsonl").read_text() == lost
    assert sum(calls) == 2  # only the two prompts of the lost shard
    # A finished folder needs no model at all; other settings are refused.
    monkeypatch.setattr("models.target.load_target", lambda *a, **k: pytest.fail("model loaded"))
    generate_distillation_data(target, out, **kwargs)
    from models.errors import CheckpointError

    with pytest.raises(CheckpointError, match="max_new_tokens"):
        generate_distillation_data(target, out, **{**kwargs, "max_new_tokens": 5})
    assert json.loads((out / "manifest.json").read_text())["num_prompts"] == 6


def test_everyday_style_is_seeded_distinct_balanced_and_never_a_suite_prompt():
    from models.errors import ConfigError, D3DError
    from prune.training.everyday import KINDS, everyday_prompts
    from prune.training.prompts import evaluation_prompts

    prompts = collect_training_prompts(400, seed=3, style="everyday")
    assert prompts == everyday_prompts(400, seed=3) == collect_training_prompts(400, seed=3, style="everyday")
    assert everyday_prompts(400, seed=4) != prompts
    assert len({p["prompt"] for p in prompts}) == len({p["id"] for p in prompts}) == 400
    kinds = collections.Counter(p["source"].split("/")[1] for p in prompts)
    assert set(kinds) == set(KINDS) and max(kinds.values()) - min(kinds.values()) <= len(KINDS)
    # A larger draw keeps every kind's first prompts: asking for more does not reshuffle what a kind makes.
    assert {p["id"]: p["prompt"] for p in prompts} | {p["id"]: p["prompt"] for p in everyday_prompts(800, 3)} \
        == {p["id"]: p["prompt"] for p in everyday_prompts(800, 3)}
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="--num-prompts must be at least 1"):
            everyday_prompts(bad)
    with pytest.raises(ConfigError, match=r"ask for at most \d+ prompts"):
        everyday_prompts(10**6)
    try:
        suite_texts = evaluation_prompts(strict=True)
    except D3DError as exc:
        pytest.skip(f"evaluation suites cannot be loaded here ({exc})")
    assert not [p["id"] for p in everyday_prompts(2000) for text in suite_texts
                if text in p["prompt"] or p["prompt"] in text]
