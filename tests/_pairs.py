"""Tiny drafter/target pairs for decoder tests, built in seconds on the CPU.

- `tiny_target`: a random Llama (grouped-query attention) over the tiny vocabulary of conftest.
- `constant_pair`: a target that always predicts one token and a drafter that always drafts it (every
  draft accepted) or always drafts another (none accepted): the extremes of transformers' assisted
  decoding tests.
- `trained_drafter`: a drafter trained for a few hundred steps on the target's own greedy outputs, so
  acceptance lengths, hits and misses all occur.
"""

import functools
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_REAL_VOCAB, build_tiny_drafter
from models.drafter import save_drafter


def tiny_target(seed: int = 1, layers: int = 2, hidden: int = 48) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=TINY_REAL_VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden + 5,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=hidden // 6,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def bigram_target(seed: int = 1, layers: int = 2, hidden: int = 48) -> LlamaForCausalLM:
    """A target whose next token depends only on the current one (silent layers): easy to draft for.

    The layers still compute, so a larger `layers`/`hidden` makes verification costlier without
    changing what the target says.
    """
    target = tiny_target(seed, layers, hidden)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


def save_tiny_pair(root, drafter_layers: int = 2, block_size: int = 4):
    """Write a tiny target (eos id 3) to ROOT/target and a random tiny drafter to ROOT/drafter; returns root."""
    target = tiny_target()
    target.config.eos_token_id = 3
    target.save_pretrained(root / "target")
    save_drafter(build_tiny_drafter(num_hidden_layers=drafter_layers, block_size=block_size), root / "drafter")
    return root


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    """A reproducible random prompt of real tokens."""
    return torch.randint(0, TINY_REAL_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _constant_head(model, token: int, embed_vector: torch.Tensor) -> None:
    """Make `model` predict `token` at every position: constant embeddings, silent layers, one head row."""
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed_vector.expand_as(model.get_input_embeddings().weight))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.get_output_embeddings().weight
        head.mul_(0.01)
        head[token] = 10 * torch.sign(embed_vector)


def constant_pair(block_size: int, drafted: int, predicted: int = 7):
    """(target, drafter): the target always predicts `predicted`; the drafter always drafts `drafted`."""
    target = tiny_target()
    drafter = build_tiny_drafter(num_hidden_layers=2, block_size=block_size)
    vector = torch.ones(48)
    _constant_head(target, predicted, vector)
    _constant_head(drafter, drafted, torch.ones(32))
    drafter.get_output_embeddings().weight.data[drafter.config.mask_token_id] = 0
    return target, drafter


@functools.lru_cache(maxsize=None)
def trained_drafter(block_size: int = 8, steps: int = 150, seed: int = 0, target_layers: int = 2,
                    target_hidden: int = 48, num_layers: int = 2):
    """A 2-layer drafter trained on greedy continuations of `bigram_target()`; returns (target, drafter)."""
    from decode.decoders import DecodeConfig, decode_ar
    from prune.training.config import TrainConfig
    from prune.training.loop import train
    from prune.training.loss import Example

    target = bigram_target(layers=target_layers, hidden=target_hidden)
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(32):
        prompt = torch.randint(0, TINY_REAL_VOCAB, (int(torch.randint(1, 12, (1,), generator=generator)),),
                               generator=generator).tolist()
        response = decode_ar(target, prompt, DecodeConfig(max_new_tokens=40)).output_ids
        examples.append(Example.from_prompt_response(prompt, response))
    drafter = build_tiny_drafter(num_hidden_layers=num_layers, block_size=block_size, seed=seed)
    config = TrainConfig(steps=steps, batch_size=16, lr=3e-3, warmup_steps=20, blocks_per_sequence=8,
                         max_length=64, seed=seed, progress=False)
    train(drafter, examples, config)
    return target, drafter.eval()


def tiny_campaign(root):
    """A pruning campaign on a trained 3-layer drafter saved as ROOT/source: (target, drafter, three calibration
    prompts, the decoder settings (24 tokens, packed budget 27), their replayed trajectories, and those as
    healing examples)."""
    from decode.decoders import DecodeConfig
    from prune.training.loss import Example
    from prune.scoring import record_trajectories

    target, drafter = trained_drafter(num_layers=3)
    save_drafter(drafter, root / "source")
    prompts = [prompt_ids(n, seed=n) for n in (3, 7, 12)]
    decode = DecodeConfig(max_new_tokens=24, packed_budget=27)
    trajectories = record_trajectories(target, prompts, decode)
    examples = [Example.from_prompt_response(t[: len(p)], t[len(p):]) for p, t in zip(prompts, trajectories)]
    return target, drafter, prompts, decode, trajectories, examples


def save_prompt_sets(root):
    """Write ROOT/calib.jsonl (3 prompts) and ROOT/eval.jsonl (2) of token ids, as a sweep reads them."""
    for name, count in (("calib", 3), ("eval", 2)):
        (root / f"{name}.jsonl").write_text("\n".join(
            json.dumps({"id": f"{name}{i}", "input_ids": list(range(5 + 7 * i, 9 + 8 * i))}) for i in range(count)))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer():
    """A byte-level BPE tokenizer of exactly TINY_REAL_VOCAB ids with a ChatML template and EOS id 3.

    Its alphabet holds ASCII letters, digits, punctuation and the bytes of "é" (merged into one token) and
    "€" (three tokens, never merged), so decoded ids can end inside a character as real byte-level
    tokenizers' do; the rest of the ids are merges of a space or a letter with a letter.
    """
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = string.ascii_lowercase + string.digits + " \n.,:!?'-()é€"
    alphabet = sorted({char for piece, _ in byte_level.pre_tokenize_str(text) for char in piece})
    vocab = {token: index for index, token in enumerate(specials + alphabet)}
    e_acute = byte_level.pre_tokenize_str("é")[0][0]
    merges = [(e_acute[0], e_acute[1])]
    pairs = [(first, second) for first in "Ġtaeoinsrh" for second in "theainorsdlu"]
    for first, second in pairs:
        if len(vocab) + len(merges) >= TINY_REAL_VOCAB:
            break
        merges.append((first, second))
    for first, second in merges:
        vocab[first + second] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<|pad|>",
                                        eos_token="<|im_end|>", additional_special_tokens=specials[2:3])
    tokenizer.chat_template = CHATML
    assert len(tokenizer) == TINY_REAL_VOCAB and tokenizer.eos_token_id == 3
    return tokenizer


def save_chat_pair(root, drafter_layers: int = 2, block_size: int = 4):
    """`save_tiny_pair` with `byte_level_tokenizer()` saved beside both models (text prompts, chat template)."""
    save_tiny_pair(root, drafter_layers, block_size)
    tokenizer = byte_level_tokenizer()
    for folder in ("target", "drafter"):
        tokenizer.save_pretrained(str(root / folder))
    return root


def replays_in_a_batch_and_alone(target, drafter, prompts: list[list[int]], config):
    """For sync and async: (decoder, batched results, results of each prompt alone) of replaying the target's
    greedy trajectories of `prompts` under `config`, once in one lockstep batch and once a prompt at a time;
    the batch's outputs are checked against the trajectories here."""
    from decode.decoders import decode_ar, decode_speculative
    from decode.verifiers import ReplayVerifier

    trajectories = [p + decode_ar(target, p, config).output_ids for p in prompts]
    for decoder in ("sync", "async"):
        batched = decode_speculative(decoder, drafter, [ReplayVerifier(t) for t in trajectories], prompts, config)
        singles = [decode_speculative(decoder, drafter, [ReplayVerifier(t)], [p], config)[0]
                   for p, t in zip(prompts, trajectories)]
        assert [r.output_ids for r in batched] == [t[len(p):] for p, t in zip(prompts, trajectories)]
        yield decoder, batched, singles
