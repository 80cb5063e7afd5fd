"""The run state (prune.state): a state.json written by the previous version loads, writes back unchanged, and a
run resumes from it; so does one with the timing of the older pre-cost-model form."""

import json
from dataclasses import replace

import pytest

from _pairs import tiny_campaign
from models.drafter import load_drafter, save_drafter
from models.surgery import remove_layers
from prune.config import HealConfig, RunConfig, ScoreConfig
from prune.progressive import Campaign, RunHooks, config_record, run_pruning, with_defaults
from prune.state import RunState, Timing, load_state, state_text

# OUT/state.json of `prune run` as the version before the typed state wrote it, after step 1 of a two-layer
# budget (the tiny campaign below: a trained 3-layer drafter, 3 prompts, 24 tokens, packed budget 27).
PREVIOUS = """
{
  "base": {
    "fallback_rate": 0.5882352941176471,
    "predicted_speedup": 1.0753748357627173,
    "tau": 3.9611111111111112
  },
  "config": {
    "heal": {
      "alpha": 4,
      "batch_size": 2,
      "blocks_per_sequence": 16,
      "dropout": 0.0,
      "lr": 0.001,
      "max_length": 320,
      "rank": 2,
      "seed": 0,
      "steps": 2,
      "target_modules": [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj"
      ],
      "warmup_steps": 5
    },
    "layers_to_remove": 2,
    "min_retention": 0.05,
    "per_step": 1,
    "score": {
      "batch_size": 16,
      "bootstrap": 20,
      "confidence": 0.95,
      "criterion": "tau",
      "decode": {
        "block_size": null,
        "candidate_policy": null,
        "concurrent": true,
        "draft_threads": null,
        "fan_out": 3,
        "lookahead": true,
        "max_new_tokens": 24,
        "packed_budget": 27,
        "seed": 0,
        "stop_ids": [],
        "temperature": 0.0,
        "width_policy": null
      },
      "seed": 0,
      "timing_repeats": 1,
      "verify": "replay"
    },
    "stop_on_speedup": false
  },
  "history": [
    {
      "folder": "step-01",
      "heal_loss": [
        2.1468353271484375,
        0.5385585427284241
      ],
      "heal_rolled_back": true,
      "layers": 2,
      "predicted_speedup": 1.071825412717937,
      "removed": [
        1
      ],
      "removed_original": [
        1
      ],
      "retention": 1.063049853372434,
      "scores": [
        {
          "ci_high": 3.1944444444444446,
          "ci_low": 1.084004884004884,
          "delta_tau": 1.971896621896622,
          "draft_pass_ms": 2.4344630000996403,
          "fallback_rate": 0.8181818181818182,
          "layer": 0,
          "original_layer": 0,
          "packed_pass_ms": 1.817766999693049,
          "packed_share": 1.0,
          "packed_tokens": 33.638888888888886,
          "predicted_speedup": 0.4896052468761303,
          "score": 1.971896621896622,
          "tau_without": 1.9892144892144892,
          "verify_width": 8
        },
        {
          "ci_high": 0.8397032828282825,
          "ci_low": -0.9583333333333335,
          "delta_tau": -0.24974747474747439,
          "draft_pass_ms": 2.4344630000996403,
          "fallback_rate": 0.7368421052631579,
          "layer": 1,
          "original_layer": 1,
          "packed_pass_ms": 1.817766999693049,
          "packed_share": 1.0,
          "packed_tokens": 33.5,
          "predicted_speedup": 1.071825412717937,
          "score": -0.24974747474747439,
          "tau_without": 4.210858585858586,
          "verify_width": 8
        },
        {
          "ci_high": 0.0,
          "ci_low": 0.0,
          "delta_tau": 0.0,
          "draft_pass_ms": 2.4344630000996403,
          "fallback_rate": 0.5882352941176471,
          "layer": 2,
          "original_layer": 2,
          "packed_pass_ms": 1.817766999693049,
          "packed_share": 1.0,
          "packed_tokens": 33.7,
          "predicted_speedup": 1.0753748357627173,
          "score": 0.0,
          "tau_without": 3.9611111111111112,
          "verify_width": 8
        }
      ],
      "step": 1,
      "tau": 4.210858585858586,
      "tau_before_heal": 4.210858585858586
    }
  ],
  "source": "SOURCE",
  "stopped_by": null,
  "timing": {
    "draft": [
      2.4344630000996403,
      0.0
    ],
    "layers": 3,
    "packed": [
      0.7000709995281795,
      0.5588480000824347
    ],
    "target": {
      "ar_ms": 1.4753830000699963,
      "contention": 1.0,
      "draft_ms": 2.4344630000996403,
      "draft_tokens": 9,
      "packed_ms": 2.3766149997754837,
      "packed_tokens": 35,
      "per_token_ms": 0.013235169478583098
    }
  }
}
"""
# The timing of states written before the cost model: whole passes, verify of the drafter's block of 16.
PRE_COST_MODEL_TIMING = {"layers": 3, "draft_ms": 2.4, "packed_ms": 3.0, "verify_ms": 1.8, "ar_ms": 1.5}
SPEED = {"prompts": 2, "source": "humaneval:eval", "max_new_tokens": 16,
         "base": {"tau": 3.5, "measured_speedup": 1.1, "predicted_speedup": 1.2, "speedup_limit": 2.0, "exact": True},
         "final": {"tau": 3.25, "measured_speedup": 1.2, "predicted_speedup": None, "speedup_limit": 2.5,
                   "exact": False}}


def previous_state(source) -> dict:
    return json.loads(PREVIOUS.replace("SOURCE", str(source)))


def test_a_previous_state_loads_and_writes_back_the_same_text():
    document = previous_state("drafters/source")
    state = RunState.from_dict(document)
    assert state.history[0].removed_original == [1] and state.history[0].scores[2].tau_without == state.base.tau
    assert state.timing.layers == 3 and state.timing.pass_times(2).draft_ms == state.timing.draft.at(2)
    assert state.to_dict() == document
    assert state_text(state) == json.dumps(document, indent=2, sort_keys=True) + "\n"
    with_errors = {**SPEED, "retention_error": 0.02, "base": {**SPEED["base"], "measured_speedup_error": 0.04}}
    for speed in (SPEED, with_errors):  # a check from before the errors, and one with them
        with_speed = {**document, "speed": speed}
        assert RunState.from_dict(with_speed).to_dict() == with_speed
    older = {**document, "timing": PRE_COST_MODEL_TIMING}
    for record in older["history"][0]["scores"]:  # layer scores from before the verify-width fields
        for name in ("verify_width", "packed_share", "packed_tokens"):
            del record[name]
    state = RunState.from_dict(older)
    assert state.to_dict()["timing"] == PRE_COST_MODEL_TIMING and state.history[0].scores[0].verify_width is None


def test_the_pre_cost_model_timing_predicts_as_it_did():
    timing = Timing.from_dict(PRE_COST_MODEL_TIMING)
    times = timing.pass_times(2)
    assert times.ar_ms == 1.5 and times.per_token_ms == pytest.approx(0.3 / 15) and times.contention == 0.0
    assert times.draft_ms == pytest.approx(2.4 * 2 / 3) and times.packed_ms == pytest.approx(3.0 * 2 / 3)
    assert timing.packed_ms(1) == pytest.approx(1.0) and timing.to_dict() == PRE_COST_MODEL_TIMING


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    target, _, prompts, decode, trajectories, examples = tiny_campaign(root)
    # judged on the calibration prompts, as every run was before check prompts existed
    config = RunConfig(layers_to_remove=2, min_retention=0.05, stop_on_speedup=False, check_prompts=0,
                       check_candidates=1, check_tokens=None, check_try_discount=0.0, vocab_sizes=(),
                       score=ScoreConfig(decode=replace(decode, context_vocab=False), timing_repeats=1, bootstrap=20),
                       heal=HealConfig(steps=2, rank=2, alpha=4, batch_size=2, lr=1e-3))
    return Campaign(load_drafter(root / "source"), root / "source", prompts, target, trajectories, examples), config


@pytest.mark.parametrize("form", ["previous", "pre-cost-model"])
def test_a_run_resumes_from_a_previous_state(campaign, form, tmp_path):
    campaign, config = campaign
    out = tmp_path / "out"
    document = previous_state(campaign.source_dir)
    if form == "pre-cost-model":
        document["timing"] = PRE_COST_MODEL_TIMING
    # The state is of this campaign's settings; the ones added since it was written read at their defaults.
    assert document["config"] != config_record(config)
    assert with_defaults(document["config"], config_record(RunConfig())) == config_record(config)
    out.mkdir()
    (out / "state.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    save_drafter(remove_layers(campaign.drafter, [1]), out / "step-01")  # the step the state records

    state = run_pruning(campaign, out, config, resume=True, hooks=RunHooks(log=lambda *_: None))
    assert state.stopped_by == "layer budget" and [h.step for h in state.history] == [1, 2]
    assert state.history[1].removed_original[0] in (0, 2) and state.history[1].layers == 1
    saved = json.loads((out / "state.json").read_text())
    assert saved["history"][0] == document["history"][0] and saved["timing"] == document["timing"]
    assert saved["base"] == document["base"] and saved["config"] == document["config"]
    assert load_state(out).to_dict() == saved
    assert (out / "final").resolve() == (out / "step-02").resolve() and (out / "report.md").is_file()
