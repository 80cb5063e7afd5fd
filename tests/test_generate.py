"""`prune generate`, the Python API behind it (decode.generator), streaming detokenization, and the
assisted-generation baseline of `prune bench`, on the tiny pair with a byte-level tokenizer."""

import json

import pytest
import torch

from _pairs import byte_level_tokenizer, save_chat_pair, tiny_target
from decode.decoders import DecodeConfig, decode_ar
from decode.detokenize import TextStream
from decode.generator import Generator
from decode.prompts import tokenize_records
from models.surgery import remove_layers
from models.target import load_target
from prune.cli import main
from prune.export import export_step

PROMPT = "write hello to the world"
TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = save_chat_pair(tmp_path_factory.mktemp("chat-pair"))
    (root / "prompts.jsonl").write_text(
        "\n".join(json.dumps(record) for record in ({"id": "a", "prompt": PROMPT}, {"id": "b", "prompt": "hi there"},
                                                  {"id": "c", "input_ids": [5, 9, 14, 20]})) + "\n")
    return root


def ar_text(root, prompt: str = PROMPT, tokens: int = TOKENS) -> tuple[str, list[int]]:
    """The target's own greedy reply (the ar decoder on the chat-templated prompt): text and ids."""
    tokenizer = byte_level_tokenizer()
    ids = tokenize_records([{"prompt": prompt}], tokenizer)[0].input_ids
    output = decode_ar(load_target(root / "target"), ids, DecodeConfig(max_new_tokens=tokens, stop_ids=(3,))).output_ids
    return tokenizer.decode(output, skip_special_tokens=True), output


def generate_args(root, *extra) -> list[str]:
    return ["generate", "--drafter", str(root / "drafter"), "--target", str(root / "target"), "--dtype", "float32",
            "--cache-dir", str(root / "cache"), "--max-new-tokens", str(TOKENS), *extra]


@pytest.mark.parametrize("decoder", ["async", "sync", "ar"])
def test_generate_prints_the_targets_greedy_reply(pair, capsys, decoder):
    text, ids = ar_text(pair)
    assert len(ids) > 5 and text.strip()
    assert main(generate_args(pair, "--prompt", PROMPT, "--decoder", decoder)) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    stats = err.strip().splitlines()[-1]
    assert stats.startswith(f"{decoder}: {len(ids)} tokens, ") and "tokens/s, tau " in stats and "hit rate" in stats
    assert ("gated -" in stats) == (decoder == "ar")  # the speculation gate is on for the speculative decoders


def test_generate_prompts_file_writes_one_json_record_per_prompt(pair, capsys):
    assert main(generate_args(pair, "--prompts", str(pair / "prompts.jsonl"), "--decoder", "sync")) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c"]
    text, ids = ar_text(pair)
    assert records[0]["text"] == text and records[0]["output_ids"] == ids and records[0]["decoder"] == "sync"
    assert records[1]["text"] == ar_text(pair, "hi there")[0]
    assert {"tokens", "tokens_per_s", "tau", "hit_rate", "prefill_s", "decode_s"} <= set(records[0])
    assert err.strip().splitlines()[-1].startswith("sync: 3 prompts, ")


def test_sampling_is_seeded_and_reproducible(pair, capsys):
    def sampled(seed: int) -> list[int]:
        assert main(generate_args(pair, "--prompt", PROMPT, "--temperature", "0.9", "--seed", str(seed),
                                  "--json")) == 0
        return json.loads(capsys.readouterr().out)["output_ids"]

    first = sampled(5)
    assert sampled(5) == first and sampled(6) != first and first != ar_text(pair)[1]


def test_streaming_emits_the_text_in_pieces_before_the_reply_returns(pair):
    generator = Generator(pair / "drafter", pair / "target", dtype="float32", width="fixed")
    pieces = []
    reply = generator.generate(PROMPT, max_new_tokens=TOKENS, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == reply.text == ar_text(pair)[0]
    iterator = generator.stream([{"role": "user", "content": PROMPT}], max_new_tokens=TOKENS)
    streamed = list(iterator)
    assert len(streamed) > 1 and "".join(streamed) == iterator.generation.text == reply.text
    assert generator.generate(reply.prompt_ids, max_new_tokens=TOKENS).ids == reply.ids  # ids in, same reply
    early = generator.stream(PROMPT, max_new_tokens=TOKENS)
    assert next(iter(early)) == streamed[0]  # leaving after one piece stops the helper thread
    assert early.generation is None


def test_text_stream_never_splits_a_character():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer("café au lait € 5 , e€é", add_special_tokens=False)["input_ids"] + [3]
    assert len(ids) > len("café au lait € 5 , e€é") // 2  # "€" is three tokens
    stream = TextStream(tokenizer)
    pieces = [stream.push([token]) for token in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == "café au lait € 5 , e€é"
    assert not any("\ufffd" in piece for piece in pieces)
    lone = TextStream(tokenizer)  # a character that never completes is released at the end
    euro = tokenizer("€", add_special_tokens=False)["input_ids"]
    assert lone.push(euro[:2]) == "" and lone.finish() == tokenizer.decode(euro[:2])


def test_api_on_an_exported_pruned_step(pair, tmp_path):
    from models.drafter import load_drafter

    history = [{"step": 1, "removed_original": [1], "layers": 1, "tau": 1.0}]
    step = export_step(remove_layers(load_drafter(pair / "drafter"), [1]), tmp_path / "step-01", pair / "drafter",
                       {}, history)
    card = (step / "README.md").read_text()
    assert "from decode.generator import Generator" in card and f'Generator("{step}", "TARGET")' in card
    text, ids = ar_text(pair)
    reply = Generator(step, pair / "target", dtype=torch.float32).generate(PROMPT, max_new_tokens=TOKENS)
    assert reply.text == text and reply.ids == ids and reply.stats["tau"] >= 1 and reply.stats["tokens"] == len(ids)
    loaded = load_target(pair / "target")  # an already-loaded target; the tokenizer comes from the step folder
    same = Generator(step, loaded, decoder="sync", width="fixed").generate(PROMPT, max_new_tokens=TOKENS)
    assert same.text == text and same.stats["hit_rate"] is None


@pytest.mark.parametrize("decoder", ["async", "sync"])
def test_generate_with_a_draft_vocabulary_prints_the_targets_greedy_reply(pair, tmp_path, decoder):
    from models.draft_vocab import with_draft_vocab
    from models.drafter import load_drafter, save_drafter

    text, ids = ar_text(pair)
    said = list(dict.fromkeys(ids))  # half the tokens the target says are left out: acceptance drops, not text
    vocab = torch.tensor(said[: len(said) // 2] + [i for i in range(40, 90) if i not in said])
    cut = save_drafter(with_draft_vocab(load_drafter(pair / "drafter"), vocab), tmp_path / "cut",
                       tokenizer_source=pair / "drafter")
    reply = Generator(cut, pair / "target", dtype=torch.float32, decoder=decoder).generate(PROMPT,
                                                                                          max_new_tokens=TOKENS)
    assert reply.text == text and reply.ids == ids


def test_assisted_generation_baseline_matches_ar(pair, capsys, tmp_path):
    tiny_target(seed=2, layers=1, hidden=24).save_pretrained(tmp_path / "assistant")
    args = ["bench", "--drafter", str(pair / "drafter"), "--target", str(pair / "target"), "--prompts",
            str(pair / "prompts.jsonl"), "--max-new-tokens", "12", "--dtype", "float32", "--cache-dir",
            str(pair / "cache"), "--assistant", str(tmp_path / "assistant"), "--json", "-"]
    assert main(args + ["--decoder", "ar,assisted"]) == 0
    report = json.loads(capsys.readouterr().out)
    assisted = report["decoders"]["assisted"]
    assert assisted["exact_match_vs_ar"] is True and assisted["tau_macro"] is None and assisted["speedup_vs_ar"]
    assert report["settings"]["baselines"]["assistant"] == str(tmp_path / "assistant")
    small = tiny_target()
    small.config.vocab_size = 60
    small.config.save_pretrained(tmp_path / "other")
    assert "vocabulary mismatch" in error_of(capsys, args[:-2] + ["--assistant", str(tmp_path / "other")])
    assert "--assistant" in error_of(capsys, args[:-4] + ["--decoder", "assisted"])


def error_of(capsys, argv: list[str]) -> str:
    """The one-line error of a failing command: exit code 1 (a known error) or 2 (a usage error), no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and "\n" not in err and "Traceback" not in err, (code, err)
    return err


def test_bad_input_is_a_one_line_error(pair, capsys, tmp_path):
    assert "no prompt" in error_of(capsys, generate_args(pair))
    both = generate_args(pair, "--prompt", PROMPT, "--prompts", str(pair / "prompts.jsonl"))
    assert "both" in error_of(capsys, both)
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = error_of(capsys, generate_args(pair, "--prompts", str(tmp_path / "empty.jsonl")))
    assert "empty" in empty or "holds no prompts" in empty
    assert "does not exist" in error_of(capsys, generate_args(pair, "--prompts", str(tmp_path / "missing.jsonl")))
    assert "non-empty" in error_of(capsys, generate_args(pair, "--prompt", ""))
    assert "--max-new-tokens" in error_of(capsys, generate_args(pair, "--prompt", "hi " * 300))
    assert "fast" in error_of(capsys, generate_args(pair, "--prompt", PROMPT, "--decoder", "fast"))


def test_the_generator_names_an_unknown_gate_before_loading_anything(pair):
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown gate 'sometimes'; choose adaptive or off"):
        Generator(pair / "drafter", pair / "target", gate="sometimes")
