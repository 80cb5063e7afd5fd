"""The training loop: it learns, and an interrupted run resumes to the same weights."""

import pytest
import torch

from models.errors import ConfigError
from prune.training.config import TrainConfig
from prune.training.loop import lr_factor, train
from prune.training.loss import Example, build_batch, drafter_loss

B = 4



def tiny_dataset(count: int = 6) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    data = []
    for n in range(count):
        prompt = torch.randint(0, 97, (3 + n % 3,), generator=g).tolist()
        # A learnable response: a repeated short pattern.
        response = [(10 + n + k % 3) for k in range(12 + n)]
        data.append(Example.from_prompt_response(prompt, response))
    return data


def small_config(**overrides) -> TrainConfig:
    settings = dict(steps=6, batch_size=3, grad_accum=2, lr=1e-2, warmup_steps=2, blocks_per_sequence=3,
                    max_length=64, pad_multiple=8, progress=False, seed=3)
    return TrainConfig(**{**settings, **overrides})


def test_training_lowers_the_loss_on_a_fixed_batch(make_tiny_drafter):
    model = make_tiny_drafter(block_size=B)
    data = tiny_dataset()
    fixed = build_batch(data, B, 97, 3, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = drafter_loss(model, fixed).total.item()
    history = train(model, data, small_config(steps=12, grad_accum=1))
    with torch.no_grad():
        after = drafter_loss(model, fixed).total.item()
    assert after < 0.7 * before
    assert [r["step"] for r in history] == list(range(1, 13))
    assert history[-1]["loss"] < history[0]["loss"]
    assert {"lr", "diff", "ar", "grad_norm", "slot1_acc", "accept_proxy", "seconds", "tokens"} <= set(history[0])


def test_resume_gives_the_same_weights(make_tiny_drafter, tmp_path):
    data = tiny_dataset()
    reference_model = make_tiny_drafter(block_size=B)
    reference = train(reference_model, data, small_config())

    class Interrupt(Exception):
        pass

    def stop_at_4(step, model):
        if step == 4:
            raise Interrupt

    model = make_tiny_drafter(block_size=B)
    config = small_config(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3, eval_every=1)
    with pytest.raises(Interrupt):
        train(model, data, config, callback=stop_at_4)
    resumed_model = make_tiny_drafter(block_size=B, seed=1)  # other initial weights: the checkpoint wins
    seen = []
    history = train(resumed_model, data, config, callback=lambda step, m: seen.append(step) or {"seen": step})
    assert seen == [4, 5, 6]
    for (name, a), b in zip(reference_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert [r["loss"] for r in history] == [r["loss"] for r in reference]
    assert history[-1]["seen"] == 6
    # A finished run resumes to nothing and returns its history; other settings are refused by name.
    assert len(train(resumed_model, data, config)) == 6
    with pytest.raises(ConfigError, match="lr"):
        train(resumed_model, data, small_config(checkpoint_dir=str(tmp_path / "ckpt"), lr=5e-3))


def test_progress_in_a_log_file_is_a_line_now_and_then(make_tiny_drafter, monkeypatch, capsys):
    """Off a terminal (a background job's log) a long training run or heal says it is alive in plain lines."""
    from prune import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    train(make_tiny_drafter(block_size=B), tiny_dataset(), small_config(steps=3, progress=True))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["train: 1/3", "train: 2/3", "train: 3/3"]
    monkeypatch.setattr(progress, "LOG_EVERY_S", 3600.0)  # a short job stays quiet
    train(make_tiny_drafter(block_size=B), tiny_dataset(), small_config(steps=3, progress=True))
    assert capsys.readouterr().err == ""


def test_schedule_and_validation():
    config = TrainConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert lr_factor(0, config) == 0.5 and lr_factor(1, config) == 1.0
    assert lr_factor(9, config) == pytest.approx(0.1)
    assert lr_factor(9, TrainConfig(steps=10, warmup_steps=2, schedule="linear", min_lr_ratio=0.0)) == 0.0
    with pytest.raises(ConfigError, match="schedule"):
        TrainConfig(schedule="step").validate()
    with pytest.raises(ConfigError, match="batch_size"):
        TrainConfig(batch_size=0).validate()
