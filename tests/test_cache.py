"""Cache keys (prune.cache): `prune score`, `prune run` and `prune sweep` key a scoring round alike, so a run
and a sweep trial read the round that `prune score` stored; keys hold the models' dtype and device."""

import pytest
import torch

from _pairs import save_prompt_sets, save_tiny_pair, tiny_target
from decode.decoders import DecodeConfig
from prune.cache import model_identity, score_key, trajectory_key
from prune.cli import main
from prune.config import ScoreConfig


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=2)
    save_prompt_sets(root)
    (root / "space.toml").write_text("[fixed]\ncriterion = 'tau'\ncalibration_prompts = 3\nlayers_to_remove = 1\n"
                                     "stop_on_speedup = false\n")
    return root


def test_keys_hold_the_dtype_and_device_of_the_models():
    model = tiny_target()
    assert model_identity(model)[1:] == ["torch.float32", "cpu"]
    prompts, decode = [[5, 6, 7]], DecodeConfig(max_new_tokens=4)
    timing = {"layers": 2}
    key = score_key(model, model, prompts, ScoreConfig(decode=decode), timing)
    assert key == score_key(model, model, prompts, ScoreConfig(decode=decode), timing)
    half = tiny_target().to(torch.bfloat16)
    assert score_key(half, model, prompts, ScoreConfig(decode=decode), timing) != key
    assert trajectory_key(half, prompts, decode) != trajectory_key(model, prompts, decode)


def test_score_run_and_sweep_key_a_round_alike_and_share_it(pair_dirs, tmp_path, monkeypatch, capsys):
    import prune.scoring

    keys, scored = [], []
    real_key, real_score = prune.scoring.score_key, prune.scoring.score_layers
    monkeypatch.setattr(prune.scoring, "score_key", lambda *args: keys.append(real_key(*args)) or keys[-1])
    monkeypatch.setattr(prune.scoring, "score_layers", lambda *a, **k: scored.append(1) or real_score(*a, **k))
    common = ["--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"), "--prompts",
              str(pair_dirs / "calib.jsonl"), "--max-new-tokens", "12", "--cache-dir", str(tmp_path / "cache"),
              "--no-wandb"]

    assert main(["score", *common, "--json", str(tmp_path / "scores.json")]) == 0
    assert len(keys) == 1 and scored == [1]
    assert main(["run", *common, "--out", str(tmp_path / "run"), "--layers-to-remove", "1", "--min-retention",
                 "0.01", "--no-stop-on-speedup", "--speed-prompts", "0"]) == 0
    assert keys[1] == keys[0] and scored == [1]  # the run's only round came from what prune score stored

    # A sweep scores with fewer bootstrap resamples (sweeps.config.TRIAL_BOOTSTRAP): the same with prune score.
    assert main(["score", *common, "--bootstrap", "200", "--json", str(tmp_path / "scores-200.json")]) == 0
    assert keys[2] != keys[0] and scored == [1, 1]
    assert main(["sweep", *common, "--study", "keys", "--out", str(tmp_path / "sweep"), "--space",
                 str(pair_dirs / "space.toml"), "--eval-prompts", str(pair_dirs / "eval.jsonl"),
                 "--retention-floor", "0.05", "--n-trials", "1"]) == 0
    assert keys[3] == keys[2] and scored == [1, 1]  # the trial's only round came from the cache too
    capsys.readouterr()
