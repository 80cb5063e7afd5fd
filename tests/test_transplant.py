"""prune.training.transplant: slicing a wide target into a drafter.

At full width with one key/value group and all neurons the slice is a pure rotation of the residual
stream, so the drafter must compute the target's logits; narrower slices must give a valid drafter.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from _pairs import TINY_REAL_VOCAB, prompt_ids, tiny_target
from models.drafter import load_drafter, save_drafter, validate_config
from models.errors import ConfigError
from prune.training.transplant import drafter_from_target

VOCAB, MASK = 128, TINY_REAL_VOCAB


def qwen3_target(layers: int = 3, hidden: int = 32) -> Qwen3ForCausalLM:
    """A random Qwen3 target with one key/value group (so a full-width slice drops nothing)."""
    config = Qwen3Config(vocab_size=TINY_REAL_VOCAB, hidden_size=hidden, intermediate_size=48,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # random norm gains, except a uniform final one (a rotation cannot move a diagonal)
        for module in model.modules():
            if module.__class__.__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.fill_(1.3)
    return model


def calibration(count: int = 6, length: int = 40) -> list[torch.Tensor]:
    return [torch.tensor(prompt_ids(length, seed=s)) for s in range(count)]


def test_full_width_slice_computes_the_target_logits():
    target = qwen3_target()
    drafter, stats = drafter_from_target(target, calibration(), vocab_size=VOCAB, mask_token_id=MASK,
                                         hidden_size=32, intermediate_size=48, num_hidden_layers=5)
    assert stats["kept_variance"] == pytest.approx(1.0)
    assert drafter.config.num_hidden_layers == 5  # two extra layers start as identities
    ids = torch.tensor([prompt_ids(30, seed=99)])
    with torch.no_grad():
        expected = target(input_ids=ids).logits
        got = drafter(input_ids=ids).logits[..., :TINY_REAL_VOCAB]
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_narrow_slice_of_a_llama_target_is_a_valid_drafter(tmp_path):
    target = tiny_target(layers=2, hidden=48)  # Llama, 6 heads in 2 groups, head_dim 8
    drafter, stats = drafter_from_target(target, calibration(), vocab_size=VOCAB, mask_token_id=MASK,
                                         hidden_size=16, intermediate_size=20, num_hidden_layers=4, block_size=8)
    config = drafter.config
    validate_config(config)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 3, 1, 8)
    assert config.mask_token_id == MASK and config.block_size == 8 and config.draft_vocab_size == TINY_REAL_VOCAB
    assert 0 < stats["kept_variance"] < 1 and set(stats["kv_groups"]) <= {0, 1}
    assert torch.equal(drafter.model.layers[3].mlp.down_proj.weight, torch.zeros(16, 20))
    folder = save_drafter(drafter, tmp_path / "d")
    reloaded = load_drafter(folder)
    ids = torch.tensor([prompt_ids(12)])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, drafter(input_ids=ids).logits)


def test_slice_wider_than_the_target_is_refused():
    with pytest.raises(ConfigError, match="no larger than the target"):
        drafter_from_target(tiny_target(), calibration(), vocab_size=VOCAB, mask_token_id=MASK,
                            hidden_size=64, intermediate_size=20, num_hidden_layers=2)
