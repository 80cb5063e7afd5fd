"""A draft vocabulary (models/draft_vocab.py): the head computed on K rows in every pass, proposals mapped back
to target ids, greedy output still the target's, and the ids carried through save, load and validation."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from _pairs import prompt_ids, replays_in_a_batch_and_alone, tiny_target, trained_drafter
from conftest import TINY_REAL_VOCAB, build_tiny_drafter
from decode import cost
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.draft_vocab import (FILE, check_ids, cut_ids, draft_vocab, head_rows, proposable_ids, set_draft_vocab,
                                with_draft_vocab)
from models.drafter import load_drafter, save_drafter, validate_checkpoint
from models.errors import CheckpointError, ConfigError
from models.inference import decoder_runner, draft_logits, masked_logits
from models.lean import LeanDecoder
from prune.cache import fingerprint

POLICY = cost.WidthPolicy(slope=0.05, fixed=0.8)


def outputs_first(target, prompts, config, keep: int) -> torch.Tensor:
    """`keep` ids: the tokens of the target's greedy outputs on `prompts` first (most frequent first), then the
    other real tokens: a draft vocabulary that covers what the target says."""
    counts = torch.zeros(TINY_REAL_VOCAB)
    for prompt in prompts:
        for token in decode_ar(target, prompt, config).output_ids:
            counts[token] += 1
    order = sorted(range(TINY_REAL_VOCAB), key=lambda i: (-counts[i], i))
    return torch.tensor(order[:keep])


def run(decoder, drafter, verifier, prompt, config):
    return decode_speculative(decoder, drafter, [verifier], [prompt], config)[0]


@pytest.fixture(scope="module")
def cut_pair():
    """(target, trained drafter, the same drafter proposing from the 40 ids the target says most, prompts)."""
    target, drafter = trained_drafter()
    prompts = [prompt_ids(n, seed=100 + n) for n in (1, 6, 40)]
    ids = outputs_first(target, prompts, DecodeConfig(max_new_tokens=40), 40)
    return target, drafter, with_draft_vocab(drafter, ids, source="test"), prompts


RUNNERS = {"lean": lambda model: decoder_runner(model, fused=True),
           "lean, weights in place": lambda model: LeanDecoder(model, copies=False, fused=True),  # as on a GPU
           "transformers": lambda model: decoder_runner(model, lean=False)}


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_head_over_a_draft_vocabulary_is_those_columns_of_the_full_head(runner):
    drafter = build_tiny_drafter(seed=3)
    ids = torch.tensor([5, 90, 0, 41, 17, 63])
    cut = with_draft_vocab(drafter, ids)
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(0))
    full, _ = draft_logits(drafter, hidden, RUNNERS[runner](drafter))
    for rows in (hidden[:1], hidden):  # one row (plain head) and several (prepacked where the CPU allows)
        logits, columns = draft_logits(cut, rows, RUNNERS[runner](cut))
        assert torch.equal(columns, ids) and logits.shape == (len(rows), len(ids))
        torch.testing.assert_close(logits, full[: len(rows), ids], rtol=1e-5, atol=1e-5)
    # training's full-width view: the ids outside the vocabulary at -inf, the others as the head gives them
    masked = masked_logits(cut, hidden)
    assert torch.isfinite(masked).sum(-1).tolist() == [len(ids)] * 7
    torch.testing.assert_close(masked[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decoder,concurrent", [("sync", True), ("async", True), ("async", False)])
def test_greedy_output_with_a_draft_vocabulary_equals_ar(cut_pair, decoder, concurrent):
    target, drafter, cut, prompts = cut_pair
    config = DecodeConfig(max_new_tokens=40, concurrent=concurrent)
    longest = 0
    for prompt in prompts:
        reference = decode_ar(target, prompt, config).output_ids
        full = run(decoder, drafter, LiveVerifier(target), prompt, config)
        live = run(decoder, cut, LiveVerifier(target), prompt, config)
        replayed = run(decoder, cut, ReplayVerifier(prompt + reference), prompt, config)
        assert live.output_ids == replayed.output_ids == reference
        assert live.round_trace == replayed.round_trace
        # the vocabulary holds every token the target says here: the drafter accepts as much as with its full head
        assert sum(live.acceptance) == sum(full.acceptance)
        longest = max(longest, *live.acceptance)
    assert longest >= 3


def test_replayed_rows_with_a_draft_vocabulary_decide_as_each_prompt_alone(cut_pair):
    target, _, cut, prompts = cut_pair
    config = DecodeConfig(max_new_tokens=32)
    for _, batched, singles in replays_in_a_batch_and_alone(target, cut, prompts, config):
        assert [r.round_trace for r in batched] == [r.round_trace for r in singles]


@pytest.mark.parametrize("decoder", ["sync", "async"])
def test_draft_trees_over_a_draft_vocabulary_equal_ar(cut_pair, decoder):
    target, _, cut, prompts = cut_pair
    config = DecodeConfig(max_new_tokens=40, width_policy=POLICY, tree_branches=3)
    for prompt in prompts:
        reference = decode_ar(target, prompt, config).output_ids
        live = run(decoder, cut, LiveVerifier(target), prompt, config)
        replayed = run(decoder, cut, ReplayVerifier(prompt + reference), prompt, config)
        assert live.output_ids == replayed.output_ids == reference
        assert live.round_trace == replayed.round_trace


def test_a_vocabulary_missing_the_targets_tokens_costs_acceptance_never_correctness(cut_pair):
    target, drafter, _, prompts = cut_pair
    config = DecodeConfig(max_new_tokens=40, context_vocab=False)  # the vocabulary alone: no context ids
    said = set(outputs_first(target, prompts, config, TINY_REAL_VOCAB)[:10].tolist())
    # the ten tokens the target says most are left out, and so are a third of the others
    missing = with_draft_vocab(drafter, torch.tensor([i for i in range(0, TINY_REAL_VOCAB, 3) if i not in said]))
    for decoder in ("sync", "async"):
        for prompt in prompts:
            reference = decode_ar(target, prompt, config).output_ids
            result = run(decoder, missing, LiveVerifier(target), prompt, config)
            assert result.output_ids == reference
            assert sum(result.acceptance) < sum(run(decoder, drafter, LiveVerifier(target), prompt, config).acceptance)
            assert all(token not in said for token in result.output_ids if token in missing.draft_vocab_ids.tolist())


def test_proposals_are_target_ids_from_the_vocabulary_only(cut_pair):
    from decode.engine import DraftEngine, DraftRequest
    from models.masks import BlockSpec

    _, _, cut, prompts = cut_pair
    engine = DraftEngine(cut, rows=1, fan_out=4, context_vocab=False)
    prompt = prompts[2]
    (prediction,) = engine.forward([DraftRequest(prompt, [BlockSpec(len(prompt) - 1)])])[0]
    allowed = set(cut.draft_vocab_ids.tolist())
    proposed = prediction.tokens + [token for slot in prediction.alternatives for token, _ in slot]
    assert set(proposed) <= allowed and len(prediction.alternatives[0]) == 4
    # probabilities renormalised over the vocabulary: each slot's top five sum to at most 1
    assert all(p + sum(q for _, q in alts) <= 1 + 1e-5 for p, alts in zip(prediction.probs, prediction.alternatives))


def test_each_row_also_proposes_its_own_context_ids_as_a_vocabulary_holding_them_would(cut_pair):
    from decode.engine import DraftEngine, DraftRequest
    from models.masks import BlockSpec

    _, drafter, cut, _ = cut_pair
    vocab = set(cut.draft_vocab_ids.tolist())
    outside = [token for token in range(TINY_REAL_VOCAB) if token not in vocab]
    # two prompts made mostly of ids the vocabulary lacks, each with its own
    prompts = [outside[: len(outside) // 2] + [3, 4], outside[len(outside) // 2:] + [5]]
    engine = DraftEngine(cut, rows=2, fan_out=4)
    together = engine.forward([DraftRequest(p, [BlockSpec(len(p) - 1)]) for p in prompts])
    proposed_outside = 0
    for row, prompt in enumerate(prompts):
        # the reference: a drafter whose vocabulary holds this row's context ids, proposing from it alone
        held = with_draft_vocab(drafter, torch.tensor(sorted(vocab | set(prompt))))
        (alone,) = DraftEngine(held, rows=1, fan_out=4, context_vocab=False).forward(
            [DraftRequest(prompt, [BlockSpec(len(prompt) - 1)])])[0]
        (mine,) = together[row]
        assert mine.tokens == alone.tokens
        assert [[t for t, _ in slot] for slot in mine.alternatives] == [[t for t, _ in slot] for slot in alone.alternatives]
        torch.testing.assert_close(torch.tensor(mine.probs), torch.tensor(alone.probs), rtol=1e-4, atol=1e-6)
        proposed = set(mine.tokens) | {t for slot in mine.alternatives for t, _ in slot}
        assert proposed <= vocab | set(prompt)  # never the other row's context ids
        proposed_outside += len(proposed - vocab)
    assert proposed_outside > 0  # the context ids did compete


def test_a_draft_vocabulary_survives_save_load_and_loads_as_plain_qwen3(tmp_path):
    drafter = build_tiny_drafter(seed=4)
    ids = torch.tensor([9, 3, 60, 1, 44])
    folder = save_drafter(with_draft_vocab(drafter, ids, source="demo x1", coverage=0.5), tmp_path / "cut")
    assert (folder / FILE).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab"]["tokens"] == 5 and config["draft_vocab"]["source"] == "demo x1"
    loaded = load_drafter(folder)
    # without a draft vocabulary the head computes the proposable prefix: rows 97 and 98 are padding
    assert torch.equal(draft_vocab(loaded), ids) and head_rows(loaded) == 5 and head_rows(drafter) == 97
    assert fingerprint(loaded) == fingerprint(with_draft_vocab(drafter, ids)) != fingerprint(drafter)
    plain = AutoModelForCausalLM.from_pretrained(str(folder))  # the whole head, as any Qwen3 folder
    assert plain.lm_head.weight.shape[0] == 99
    with pytest.raises(ConfigError, match="load_drafter"):
        draft_vocab(plain)
    again = save_drafter(loaded, tmp_path / "again")
    assert (again / FILE).read_bytes() == (folder / FILE).read_bytes()
    assert set_draft_vocab(loaded, None) is loaded and draft_vocab(loaded) is None and head_rows(loaded) == 97


def test_validate_refuses_a_vocabulary_file_that_does_not_match_its_config(tmp_path):
    folder = save_drafter(with_draft_vocab(build_tiny_drafter(), torch.tensor([1, 2, 3])), tmp_path / "cut")
    validate_checkpoint(folder)
    (folder / FILE).unlink()
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        validate_checkpoint(folder)
    from models.draft_vocab import write_draft_vocab

    write_draft_vocab(folder, torch.tensor([1, 2, 4]))
    with pytest.raises(CheckpointError, match="do not match"):
        load_drafter(folder)


def test_bad_vocabularies_are_refused_with_the_fix():
    drafter = build_tiny_drafter()
    for ids, match in ((torch.tensor([1, 97]), "not a proposable"), (torch.tensor([1, 98]), "not a proposable"),
                       (torch.tensor([4, 4]), "repeat"), (torch.tensor([]), "non-empty"),
                       (torch.tensor([1.0]), "integer")):
        with pytest.raises(ConfigError, match=match):
            check_ids(ids, drafter.config)
    config = dict(drafter.config.to_dict(), draft_vocab={"file": "../x", "tokens": 3})
    from models.drafter_config import validate_config

    with pytest.raises(ConfigError, match="prune vocab"):
        validate_config(config)


def test_a_cut_takes_the_best_ranked_of_the_ids_proposed_now():
    config = build_tiny_drafter().config
    ranking = torch.tensor([50, 7, 97, 3])  # the mask id ranks, but is never proposable
    assert cut_ids(None, ranking, 4, config).tolist() == [50, 7, 3, 0]  # unranked ids follow, in id order
    assert cut_ids(torch.tensor([3, 9, 7]), ranking, 2, config).tolist() == [7, 3]
    assert proposable_ids(config).tolist() == list(range(97))  # below draft_vocab_size, the mask id past it
    with pytest.raises(ConfigError, match="smaller --size"):
        cut_ids(torch.tensor([3, 9, 7]), ranking, 4, config)


def test_training_over_a_draft_vocabulary_stays_finite_when_a_target_is_outside_it():
    from prune.training.loss import Example, build_batch, drafter_loss

    drafter = build_tiny_drafter(block_size=4, seed=2)
    example = Example.from_prompt_response(prompt_ids(5), prompt_ids(20, seed=1))
    batch = build_batch([example], 4, 97, 4, torch.Generator().manual_seed(0))
    cut = with_draft_vocab(drafter, torch.arange(0, 60))  # some of the response's ids are outside it
    loss = drafter_loss(cut, batch, teacher=drafter, distill_weight=0.5)
    assert torch.isfinite(loss.total)
    loss.total.backward()
    assert torch.isfinite(cut.lm_head.weight.grad).all()


# Which ids: ranking the target's answers, the held-out check, `prune vocab` and `prune validate`


def write_distill_folder(folder, records: list[dict]):
    """A one-shard distillation folder of `records` ({"prompt", "response_ids"}, prompt ids added)."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"id": str(i), "prompt_ids": [5, 6], **r}) for i, r in enumerate(records)]
    (folder / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "manifest.json").write_text(json.dumps({"shards": 1, "max_new_tokens": 20}))
    return folder


ANSWERS = [{"prompt": "sort a list", "response_ids": [7, 7, 7, 12, 12, 40, 97, 98]},
           {"prompt": "add two numbers", "response_ids": [12, 7, 3, 3]}]
HELD_OUT = ({"Complete the following Python function:\ndef held_out():"}, {"HumanEval/10"})


def test_ids_rank_by_how_often_the_target_says_them(tmp_path):
    from prune.vocab import rank_tokens

    folder = write_distill_folder(tmp_path / "data", ANSWERS)
    ranking = rank_tokens([str(folder)], build_tiny_drafter().config, held_out=HELD_OUT)
    # 7 four times, 12 three, 3 twice, 40 once; the mask id (97) and the padding row (98) never count
    assert ranking.ids.tolist() == [7, 12, 3, 40] and ranking.counts.tolist() == [4, 3, 2, 1]
    assert ranking.tokens == 10 and ranking.coverage(torch.tensor([7, 12])) == pytest.approx(0.7)
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("\n".join(json.dumps(line) for line in (
        {"id": "a", "decoder": "ar", "output_ids": [40, 40, 40, 40, 40]},
        {"id": "a", "decoder": "async", "drafter": "d", "output_ids": [9] * 50})) + "\n")
    both = rank_tokens([str(folder), str(outputs)], build_tiny_drafter().config, held_out=HELD_OUT)
    assert both.ids.tolist() == [40, 7, 12, 3] and both.sha256 != ranking.sha256  # only the ar lines count


def test_a_vocabulary_counted_on_calib_or_eval_prompts_is_refused(tmp_path):
    from models.errors import DataError
    from prune.vocab import rank_tokens

    config = build_tiny_drafter().config
    text = next(iter(HELD_OUT[0]))
    leaked = write_distill_folder(tmp_path / "leaked", [*ANSWERS, {"prompt": text + "\n    pass", "response_ids": [9]}])
    with pytest.raises(DataError, match="calib or eval prompt"):
        rank_tokens([str(leaked)], config, held_out=HELD_OUT)
    outputs = tmp_path / "eval-outputs.jsonl"
    outputs.write_text(json.dumps({"id": "HumanEval/10", "decoder": "ar", "output_ids": [4, 5]}) + "\n")
    with pytest.raises(DataError, match="HumanEval/10"):
        rank_tokens([str(outputs)], config, held_out=HELD_OUT)
    rank_tokens([str(leaked)], config, check=False)  # what the check guards is the only difference


def test_prune_vocab_cuts_a_folder_that_validates_and_decodes_as_ar(tmp_path, capsys, monkeypatch):
    from prune import vocab
    from prune.cli import main
    from prune.export import read_report, verify_export

    monkeypatch.setattr(vocab, "held_out_prompts", lambda: HELD_OUT)
    data = write_distill_folder(tmp_path / "data", ANSWERS)
    drafter = save_drafter(build_tiny_drafter(seed=5), tmp_path / "drafter")
    out = tmp_path / "cut"
    assert main(["vocab", str(drafter), str(out), "--size", "3", "--data", str(data), "--json", "-"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == 3 and record["coverage"] == pytest.approx(0.9)
    assert torch.equal(draft_vocab(load_drafter(out)), torch.tensor([7, 12, 3]))
    report, history = read_report(out)
    assert report["draft_vocab"]["tokens"] == 3 and report["draft_vocab"]["ranking"]["tokens"] == 10
    assert history[-1] == {"step": "vocab", "head_rows": 3, "layers": 2, "coverage": 0.9}
    assert verify_export(out) == [] and "proposes only from the 3 token ids" in (out / "README.md").read_text()
    assert main(["validate", "--drafter", str(out), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_tokens"] == 3
    # a second cut of a cut keeps the best of its own ids; one larger than it is refused
    assert main(["vocab", str(out), str(tmp_path / "two"), "--size", "2", "--data", str(data)]) == 0
    assert draft_vocab(load_drafter(tmp_path / "two")).tolist() == [7, 12]
    capsys.readouterr()
    assert main(["vocab", str(out), str(tmp_path / "big"), "--size", "5", "--data", str(data)]) == 1
    assert "in 1..3" in capsys.readouterr().err and not (tmp_path / "big").exists()
    assert main(["vocab", str(drafter), str(tmp_path / "none"), "--size", "5"]) == 1
    assert "pass --data" in capsys.readouterr().err
