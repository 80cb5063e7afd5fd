"""The measured end of a pruning run: the unpruned and the final drafter against the target alone.

Predicted speedups guide the run; this check is what a user asks of its result. The unpruned drafter,
the final drafter and ar decode the same held-out prompts, interleaved per prompt after a warm-up, with
the live target and the run's scoring decoder (ScoreConfig.decoder; decode.bench: one ar baseline, several
drafters), and the state gets `speed` (prune.state.SpeedCheck):

    {"prompts": N, "source": "humaneval:eval", "max_new_tokens": T,
     "base":  {"tau", "measured_speedup", "predicted_speedup", "speedup_limit", "exact"},
     "final": {...}, "retention_error": E}

predicted_speedup is the cost model at the tau, verify width and fallback rate measured in this check,
with the campaign's pass times, so predicted and measured compare like for like.
"""


from decode.bench import run_bench
from decode.config import BenchConfig
from models.draft_vocab import head_rows
from models.drafter import load_drafter

from .config import DEFAULT_DECODER
from .scoring import retention_error
from .state import RunState, SpeedCheck, SpeedRow


def measure_speed(state: RunState, out, drafter, target, prompts, decode, source: str) -> SpeedCheck:
    """Measure the unpruned `drafter` and OUT/final (when a step was taken) on `prompts` (decode.prompts
    Prompt list) with the run's decoder; returns the state's `speed` (see the module docstring)."""
    decoder = state.config.get("score", {}).get("decoder", DEFAULT_DECODER)
    weight = next(drafter.parameters())
    final = None
    if state.history:
        final = load_drafter(f"{out}/{state.last.folder}", weight.dtype, weight.device)
    drafters = [("base", drafter)] + ([("final", final)] if final is not None else [])
    times = {name: state.timing.pass_times(model.config.num_hidden_layers, head_rows(model)) for name, model in drafters}
    configs = {name: decode.tuned_to(t, width=decode.width_policy is not None,
                                     candidates=decode.candidate_policy is not None) if t else decode
               for name, t in times.items()}
    config = BenchConfig(decode=decode, decoders=("ar", decoder))
    report, _ = run_bench(drafters, target, prompts, config, decode_by_drafter=configs,
                          times_by_drafter={name: t for name, t in times.items() if t is not None})
    rows = ({"base": report["decoders"]} if final is None else
            {entry["drafter"]: entry["decoders"] for entry in report["drafters"]})
    speed = SpeedCheck(len(prompts), source, decode.max_new_tokens)
    for name, decoders in rows.items():
        row = decoders[decoder]
        setattr(speed, name, SpeedRow(row["tau_macro"], row["speedup_vs_ar"], row.get("predicted_speedup"),
                                      row.get("speedup_limit"), row["exact_match_vs_ar"], row.get("speedup_error")))
    if "final" in rows:
        speed.retention_error = retention_error(rows["final"][decoder]["tau_per_prompt"],
                                                rows["base"][decoder]["tau_per_prompt"])
    return speed
