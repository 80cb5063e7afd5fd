"""Healing, tested as peft tests merging: adapter == merged, nothing of peft remains, it changes weights; and the
full fine-tune: every decoder weight moves, the embedding does not."""

import pytest
import torch

from conftest import build_tiny_drafter
from models.drafter import load_drafter, save_drafter
from prune.training.loss import Example
from prune.heal import HealConfig, add_lora, heal


def examples(count: int = 8) -> list[Example]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 97, (24,), generator=generator).tolist()
        out.append(Example.from_prompt_response(ids[:6], ids[6:]))
    return out


@pytest.fixture(scope="module")
def healed():
    base = build_tiny_drafter(num_hidden_layers=2, block_size=4)
    config = HealConfig(steps=6, rank=4, alpha=8, batch_size=4, lr=1e-2)
    model, history = heal(base, examples(), config)
    return base, model, history, config


def test_adapter_logits_equal_merged_logits():
    base = build_tiny_drafter(num_hidden_layers=2, block_size=4)
    peft_model = add_lora(base, HealConfig(rank=4, alpha=8))
    with torch.no_grad():  # make the adapters non-trivial (B starts at zero)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_adapter = peft_model(ids).logits
        merged = peft_model.merge_and_unload()
        assert (merged(ids).logits - with_adapter).abs().max() < 1e-4
        assert (base(ids).logits - with_adapter).abs().max() > 1e-3  # the negative control


def test_heal_merges_lowers_loss_and_leaves_no_lora(healed, tmp_path):
    base, model, history, _ = healed
    assert len(history) == 6 and history[-1]["loss"] < history[0]["loss"]
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert type(model).__name__ == "Qwen3ForCausalLM"
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all(".layers." in n for n in changed)
    save_drafter(model, tmp_path / "healed")
    reloaded = load_drafter(tmp_path / "healed")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_heal_is_deterministic_and_leaves_its_input_alone(healed):
    base, model, _, config = healed
    again, _ = heal(base, examples(), config)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    fresh = build_tiny_drafter(num_hidden_layers=2, block_size=4)
    for (name, a), (_, b) in zip(base.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def test_bad_heal_settings():
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="--heal-rank"):
        HealConfig(rank=0).validate()
    with pytest.raises(ConfigError, match="unknown heal weights 'adapter'; choose lora or full"):
        HealConfig(train="adapter").validate()


def test_every_heal_weights_choice_has_a_trainer():
    from prune.config import HEAL_WEIGHTS
    from prune.heal import TRAINERS

    assert set(TRAINERS) == set(HEAL_WEIGHTS) and HealConfig().lr == HEAL_WEIGHTS[HealConfig().train].lr


def test_a_full_heal_trains_the_decoder_layers_and_leaves_the_embedding(tmp_path):
    base = build_tiny_drafter(num_hidden_layers=2, block_size=4)
    config = HealConfig(steps=6, train="full", batch_size=4, lr=1e-3)
    model, history = heal(base, examples(), config)
    assert len(history) == 6 and history[-1]["loss"] < history[0]["loss"]
    assert type(model).__name__ == "Qwen3ForCausalLM" and not any(p.requires_grad for p in model.parameters())
    original = dict(base.named_parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, original[n])}
    # Every weight of every layer moves (an adapter would only move its target modules' weights), the final
    # norm too; the embedding, which the head shares, does not.
    assert changed == {n for n in original if ".layers." in n or n == "model.norm.weight"}
    again, _ = heal(base, examples(), config)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    fresh = build_tiny_drafter(num_hidden_layers=2, block_size=4)
    assert all(torch.equal(a, b) for a, b in zip(base.parameters(), fresh.parameters()))
    save_drafter(model, tmp_path / "healed")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(load_drafter(tmp_path / "healed")(ids).logits, model(ids).logits)


def test_a_heal_with_a_teacher_pulls_a_pruned_drafter_towards_it():
    from models.surgery import remove_layers

    teacher = build_tiny_drafter(num_hidden_layers=3, block_size=4)
    pruned = remove_layers(teacher, [1])
    config = HealConfig(steps=6, rank=4, alpha=8, batch_size=4, lr=1e-2, distill_weight=1.0)
    healed, history = heal(pruned, examples(), config, teacher=teacher)
    assert history[-1]["loss"] < history[0]["loss"]  # the divergence from the teacher falls
    again, _ = heal(pruned, examples(), config, teacher=teacher)
    assert all(torch.equal(a, b) for a, b in zip(healed.parameters(), again.parameters()))
    # Its divergence from the teacher on sequences it was not healed on falls too.
    from prune.training.loss import build_batch, drafter_loss

    held_out = [Example.from_prompt_response(ex.input_ids[:6].tolist(), ex.input_ids[6:].flip(0).tolist())
                for ex in examples(4)]
    batch = build_batch(held_out, 4, 97, 4, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        def divergence(model):
            return drafter_loss(model, batch, teacher=teacher, distill_weight=1.0).total.item()
        assert divergence(healed) < divergence(pruned)
    with pytest.raises(Exception, match="distill_weight"):
        heal(pruned, examples(), HealConfig(steps=1, distill_weight=1.5), teacher=teacher)


def test_a_remembering_teacher_runs_once_per_batch_and_heals_the_same():
    """A campaign's heals draw the same batches: a Teacher that remembers runs its layers in the first heal only,
    and every heal ends with the weights and losses of a heal with the plain teacher."""
    from models.surgery import remove_layers
    from prune.training.loss import Teacher

    teacher = build_tiny_drafter(num_hidden_layers=3, block_size=4)
    pruned = remove_layers(teacher, [1])
    config = HealConfig(steps=3, rank=4, alpha=8, batch_size=4, lr=1e-2, distill_weight=0.5)
    plain, plain_history = heal(pruned, examples(), config, teacher=teacher)
    passes = []
    hook = teacher.model.register_forward_hook(lambda *_: passes.append(1))
    remembering = Teacher(teacher, remember=True)
    first, first_history = heal(pruned, examples(), config, teacher=remembering)
    assert len(passes) == config.steps and len(remembering.remembered) == config.steps
    second, second_history = heal(pruned, examples(), config, teacher=remembering)
    assert len(passes) == config.steps  # nothing new to compute
    other, _ = heal(pruned, examples(), HealConfig(**{**vars(config), "seed": 1}), teacher=remembering)
    assert len(passes) == 2 * config.steps  # other batches: the teacher runs again
    hook.remove()
    for model, history in ((first, first_history), (second, second_history)):
        assert [h["loss"] for h in history] == [h["loss"] for h in plain_history]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
