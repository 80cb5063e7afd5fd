"""`prune run`: progressive pruning - score, remove, heal with LoRA, export - repeated until a stop rule."""

import argparse
import functools
import sys

from decode.config import VERIFY_MODES
from prune.config import HealConfig, RunConfig, ScoreConfig
from prune.criteria import CRITERIA, describe

from . import _types
from ._checkpoint_args import add_max_shard_size_arg
from ._common import (
    add_command,
    add_debug,
    add_decode_args,
    add_prescreen_args,
    add_screen_args,
    add_export_dtype_arg,
    add_model_args,
    add_prompt_args,
    add_tracking_args,
    cache_dir,
    decode_config,
    defaults,
    drafter_layers,
    load_pair_and_prompts,
    make_tracker,
    prompt_records,
    show_progress,
    write_json,
)
from ._heal import add_heal_data_arg, add_loss_data_arg, heal_examples, loss_data
from ._help import PROMPTS, add_alias
from ._settings import build
from ._target import add_target_args, check_pass_times, target_for, trajectory_source

EXAMPLES = """
examples:
  prune run --out pruned --layers-to-remove 5              (the demo pair and its heal data)
  prune run --drafter D --target T --prompts calib.jsonl --heal-data data/distill --out pruned
  prune run --out pruned --resume                          (continue an interrupted run)
  prune run --out pruned --layers-to-remove 5 --prescreen block-influence   (tau for 12 layers a round)
  prune run --drafter D --target T --out pruned --ar-outputs ar.jsonl --pass-times bench.json
        (the target's outputs recorded once: its weights load only for the speed check at the end)
"""
RUN, SCORE, HEAL = defaults(RunConfig), defaults(ScoreConfig), defaults(HealConfig)
# Flags renamed to their settings' names (prune/commands/_settings.py); the old spellings still work.
OLD_FLAGS = {"--no-speedup-stop": "--no-stop-on-speedup", "--lora-rank": "--heal-rank", "--lora-alpha": "--heal-alpha",
             "--heal-distill": "--heal-distill-weight"}


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "run",
        help="prune layers progressively: score, remove, heal with LoRA, export each step",
        description="Progressive pruning: score the layers on calibration prompts, remove the least harmful, heal "
        "with LoRA when the drafter lost enough tau, export OUT/step-XX; repeat until --layers-to-remove, "
        "--min-retention or a drop in predicted speedup. OUT/final is the last step taken." + EXAMPLES,
        common=("--drafter", "--target", *PROMPTS, "--out", "--resume", "--layers-to-remove", "--min-retention",
                "--heal-steps", "--json", "--heal-data", "--device", "--config"),
    )
    add_model_args(parser)
    add_prompt_args(parser, default_suite="humaneval:calib", max_new_tokens=64, limit=16)
    parser.add_argument("--out", required=True, type=_types.output_dir,
                        help="output folder (must be empty unless --resume)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in OUT where it was interrupted (starts one when OUT holds none)")
    parser.add_argument("--layers-to-remove", type=_types.positive_int, default=None, metavar="N",
                        help="stop after removing this many layers (default: no budget; the other stop "
                        "rules end the run)")
    parser.add_argument("--min-retention", type=_types.positive_fraction, default=RUN["min_retention"], metavar="F",
                        help="never take a step below this fraction of the unpruned tau (on the check prompts)")
    parser.add_argument("--per-step", type=_types.positive_int, default=RUN["per_step"], help="layers removed per step")
    parser.add_argument("--check-prompts", type=_types.non_negative_int, default=RUN["check_prompts"], metavar="N",
                        help="prompts after the first --limit of the same suite part or file on which every step is "
                        "judged (tau, retention, heals, stop rules): the calibration prompts chose the removed layers "
                        "for measuring well there, so a step reads better on them than it is. Fewer when the source "
                        "runs out; 0: judge on the calibration prompts")
    parser.add_argument("--check-tokens", type=_types.non_negative_int, default=RUN["check_tokens"], metavar="N",
                        help="tokens each check prompt decodes: a step's check tau is the figure every decision "
                        "reads, and longer decodes measure it closer (the calibration prompts decode "
                        "--max-new-tokens; 0: as many as --max-new-tokens, as runs saved before this flag did)")
    parser.add_argument("--check-candidates", type=_types.positive_int, default=RUN["check_candidates"], metavar="N",
                        help="with check prompts and --per-step 1: layers a step may try, lowest score first; it "
                        "takes the first that the stop rules accept and that lost less than --heal-min-drop of "
                        "the unpruned tau (healing on or off), else the one judged best, healed when the run "
                        "heals (1: the lowest only)")
    parser.add_argument("--check-try-discount", type=_types.non_negative_float, default=RUN["check_try_discount"],
                        metavar="F", help="judge a step's i-th candidate at its check tau lowered by F times the "
                        "optimism of the best of i noisy reads (standard errors of its retention on the check "
                        "prompts): the first of several tries that passes is selected on those prompts (0: judge "
                        "every try as it reads)")
    parser.add_argument("--no-stop-on-speedup", dest="stop_on_speedup", action="store_false",
                        help="do not stop when predicted speedup falls below the best so far (default: stop)")
    parser.add_argument("--speedup-tolerance", type=_types.fraction, default=RUN["speedup_tolerance"], metavar="F",
                        help="take a step whose predicted speedup is less than this fraction below the best so far "
                        "(0: every step must improve on the best)")
    add_vocab_args(parser)
    parser.add_argument("--no-carry-screen", dest="carry_screen", action="store_false",
                        help="screen every layer afresh in every scoring round (default: after the first step, "
                        "a round scores the previous round's --screen-keep lowest layers, and the others only "
                        "when those no longer score below them)")
    parser.add_argument("--criterion", choices=tuple(CRITERIA), default=SCORE["criterion"],
                        help=f"layer scoring criterion ({describe()})")
    parser.add_argument("--verify", choices=VERIFY_MODES, default=SCORE["verify"], help="verification in scoring")
    add_screen_args(parser)
    add_prescreen_args(parser)
    add_loss_data_arg(parser)
    add_target_args(parser)
    add_decode_args(parser)
    add_heal_data_arg(parser)
    parser.add_argument("--heal-steps", type=_types.non_negative_int, default=HEAL["steps"], metavar="N",
                        help="LoRA updates per heal (0: no healing)")
    parser.add_argument("--heal-rank", type=_types.positive_int, default=HEAL["rank"], help="LoRA rank")
    parser.add_argument("--heal-alpha", type=_types.positive_int, default=HEAL["alpha"],
                        help="LoRA alpha (scale = alpha / rank)")
    parser.add_argument("--heal-lr", type=_types.positive_float, default=HEAL["lr"], help="LoRA learning rate")
    parser.add_argument("--heal-distill-weight", type=_types.fraction, default=HEAL["distill_weight"], metavar="W",
                        help="share of the heal loss that matches the unpruned drafter's predictions (KL) instead of "
                        "the target's tokens (1: KL only; 0: cross entropy on the target's tokens only)")
    parser.add_argument("--heal-min-drop", type=_types.fraction, default=HEAL["min_drop"], metavar="F",
                        help="heal a step only when its drafter has lost at least this fraction of the unpruned "
                        "tau (on the check prompts; 0: heal every step)")
    parser.add_argument("--seed", type=_types.non_negative_int, default=SCORE["seed"],
                        help="seeds healing, the bootstrap, the loss criterion's draw and the random criterion")
    add_export_dtype_arg(parser)
    add_max_shard_size_arg(parser)
    parser.add_argument("--speed-suite", default="humaneval:eval", metavar="NAME[:train|:calib|:eval] | FILE.jsonl",
                        type=_types.suite_or_prompt_file,
                        help="held-out prompts of the measured speed check at the end (a built-in suite or a JSONL "
                        "prompt file): the unpruned and the final drafter against the target alone (live, async, "
                        "interleaved); skipped when the prompts are text and the pair has no tokenizer")
    parser.add_argument("--speed-prompts", type=_types.non_negative_int, default=4, metavar="N",
                        help="prompts of the speed check (0: skip it; --max-new-tokens tokens each)")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the final state as JSON ('-' = stdout)")
    add_tracking_args(parser)
    add_debug(parser)
    for old, flag in OLD_FLAGS.items():
        add_alias(parser, old, flag)
    parser.set_defaults(run=run)


def run(args) -> int:
    """`prune run`, holding the lock of --out (models.lock): a second run on the same folder fails at once."""
    from models.lock import output_lock

    with output_lock(args.out):
        return _run(args)


def _run(args) -> int:
    from prune.progress import progress_bar
    from prune.progressive import Campaign, RunHooks, config_record, run_pruning
    from prune.cache import fingerprint
    from prune.scoring import cached_trajectories
    from prune.state import campaign_timing, has_run

    check_layer_budget(args)
    # One read of the source: the first --limit prompts calibrate, the next --check-prompts judge the steps.
    with_checks = argparse.Namespace(**{**vars(args), "limit": args.limit + args.check_prompts})
    pair, tokenized, drafter_dir, target_path, prompts_source = load_pair_and_prompts(with_checks)
    args.dtype = with_checks.dtype
    prompts = [p.input_ids for p in tokenized[:args.limit]]
    checks = [p.input_ids for p in tokenized[args.limit:]]
    if len(checks) < args.check_prompts:
        print(check_prompts_note(prompts_source, len(prompts), len(checks), args.check_prompts), file=sys.stderr)
        args.check_prompts = len(checks)
    decode, times = decode_config(args, pair, max_new_tokens=args.max_new_tokens)
    examples, heal_data = heal_examples(args) if args.heal_steps > 0 else (None, None)  # no heal: no data to read
    ranking = vocab_ranking(args, pair.drafter)
    config = run_config(args, decode, healing=bool(examples), vocab=ranking is not None)
    config.validate(pair.drafter.config.num_hidden_layers)
    check_pass_times(config.score.criterion, times)
    cache = cache_dir(args)
    replay = args.verify == "replay"
    source = trajectory_source(args, pair, tokenized)
    trajectories = cached_trajectories(cache, source, prompts, decode) if replay else None
    check_trajectories = (cached_trajectories(cache, source, checks, config.check_score.decode)
                          if replay and checks else None)
    drafter_hash = fingerprint(pair.drafter)
    tracker = make_tracker(args, "run", {
        "settings": config_record(config), "drafter": drafter_dir, "drafter_hash": drafter_hash,
        "target": target_path, "prompts": prompts_source, "prompt_count": len(prompts),
        "check_prompt_count": len(checks), "ar_outputs": args.ar_outputs,
        "heal_data": heal_data,
        "out": args.out, "resume": args.resume}, drafter_hash, out=args.out)
    campaign = Campaign(pair.drafter, drafter_dir, prompts, source, trajectories, examples, cache, checks,
                        check_trajectories, heal_data, ranking)
    shown = show_progress(args.json)
    hooks = RunHooks(log=lambda message: print(message, file=sys.stderr), on_step=tracker.on_step,
                     progress=functools.partial(progress_bar, enabled=shown), heal_progress=shown)
    try:
        timing = (None if args.resume and has_run(args.out) else
                  campaign_timing(pair.drafter, config.score, source, times, cache))
        state = run_pruning(campaign, args.out, config, resume=args.resume, timing=timing,
                            export_dtype=args.export_dtype, hooks=hooks, max_shard_size=args.max_shard_size)
    except BaseException:
        tracker.finish(exit_code=1)
        raise
    if args.speed_prompts > 0 and state.speed is None:
        _check_speed(args, state, pair, decode, target_path)
    tracker.finish(state, args.out)
    write_json(state.to_dict(), args.json)
    print("\n".join(summary_lines(state.to_dict(), args.out)), file=sys.stderr)
    return 0


def run_config(args, decode, healing: bool, vocab: bool = False) -> RunConfig:
    """The RunConfig of `prune run`'s flags and --config file (prune/commands/_settings.py) with the tuned
    `decode` settings (`healing`: there are heal examples; without, no heal steps; `vocab`: there is a token
    ranking; without, no head steps)."""
    overrides = {"score.decode": decode, "score.loss_data": loss_data(args, (args.criterion, args.prescreen))}
    overrides.update({} if healing else {"heal.steps": 0})
    overrides.update({} if vocab else {"vocab_sizes": ()})
    return build(args, "run", overrides)


def add_vocab_args(parser) -> None:
    """--vocab-sizes, --no-vocab-steps and --vocab-data of `prune run` and `prune sweep`: the head steps."""
    parser.add_argument("--vocab-sizes", type=_types.sizes, default=RUN["vocab_sizes"], metavar="K,K,...",
                        help="draft vocabulary sizes a head step may cut the drafter's head to, largest first: "
                        "before each layer step the run tries the next size below the ids the drafter proposes, "
                        "judged on the check prompts by the same rules as a layer step, and takes it when they "
                        "accept it (the head's rows are a large share of a small drafter's pass)")
    parser.add_argument("--no-vocab-steps", action="store_true",
                        help="take no head steps: the drafter keeps the ids it proposes from")
    parser.add_argument("--vocab-data", type=_types.vocab_source, nargs="+", default=None, metavar="DIR|FILE.jsonl",
                        help="what head steps rank the ids on: distillation data folders or prune bench "
                        "--save-outputs files of training prompts (default: the healing data, --heal-data or the "
                        "demo drafter's shipped folders; without any, no head steps)")


def vocab_ranking(args, drafter):
    """The token ranking of the run's head steps (prune.vocab.rank_tokens on --vocab-data, else the healing
    data), or None with a note when there are none (--no-vocab-steps, no size below the drafter's ids, no data)."""
    from prune.vocab import next_head_size, rank_tokens

    from .vocab import vocab_data

    if args.no_vocab_steps or next_head_size(args.vocab_sizes, drafter) is None:
        return None
    sources = vocab_data(args.vocab_data or args.heal_data, args.drafter, flag="--vocab-data")
    if sources is None:
        print("note: no head steps: no data to rank the draft vocabulary's ids on (--vocab-data)", file=sys.stderr)
        return None
    return rank_tokens(sources, drafter.config)


def check_prompts_note(source: str, calibration: int, found: int, asked: int) -> str:
    """The note of a prompt source that holds fewer check prompts than --check-prompts asks for."""
    if found:
        return (f"note: {source} holds {calibration + found} prompts: the first {calibration} calibrate and the other "
                f"{found} judge the steps (fewer than --check-prompts {asked})")
    return (f"note: {source} holds no prompt beyond the {calibration} calibration prompts, so the steps are judged on "
            "them, and a step reads better there than it is; give more prompts, or lower --limit")


def check_layer_budget(args) -> None:
    """--layers-to-remove and --per-step against the drafter's layer count (its config.json), before any
    model loads: a budget the drafter cannot meet fails at once, not after the pair is loaded."""
    from models.errors import ConfigError

    layers = drafter_layers(args)
    RunConfig(layers_to_remove=args.layers_to_remove, min_retention=args.min_retention,
              per_step=args.per_step).validate(layers)
    if args.per_step >= layers:
        raise ConfigError(f"--per-step {args.per_step} must be below the drafter's {layers} layers (at least one "
                          "must remain); lower --per-step")


def _check_speed(args, state, pair, decode, target_path: str) -> None:
    """Run the measured speed check (prune.speed) and record it in `state` (a prune.state.RunState),
    OUT/state.json and OUT/report.md; the target's weights load here where --ar-outputs left them unloaded."""
    from decode.prompts import tokenize_records
    from prune.report import write_report
    from prune.speed import measure_speed
    from prune.state import save_state

    from_file = args.speed_suite.endswith(".jsonl")
    records_args = argparse.Namespace(**{**vars(args), "suite": None if from_file else args.speed_suite,
                                         "prompts": args.speed_suite if from_file else None,
                                         "limit": args.speed_prompts})
    records, source = prompt_records(records_args)
    if pair.tokenizer is None and any("input_ids" not in record for record in records):
        print(f"note: no speed check: {source} holds text and the pair has no tokenizer (--speed-suite FILE.jsonl "
              "with input_ids records, or --speed-prompts 0)", file=sys.stderr)
        return
    prompts = tokenize_records(records, pair.tokenizer, not args.no_chat_template)
    target = target_for(args, pair, target_path, "the speed check (--speed-prompts 0 skips it)")
    print(f"measuring speed on {len(prompts)} held-out prompts ({source}) ...", file=sys.stderr)
    state.speed = measure_speed(state, args.out, pair.drafter, target, prompts, decode, source)
    save_state(args.out, state)
    write_report(args.out, state)


def equal_tau_gain(state: dict) -> float | None:
    """The final drafter's predicted speedup over the unpruned one at equal tau (prune.state.RunState
    .equal_tau_speedup) from the JSON of a run's state; None before a step or without what it needs."""
    from prune.state import RunState

    # a state from before the round shape was recorded (or a partial one) has no width: nothing to model
    if not state.get("history") or not state.get("timing") or state["base"].get("width") is None:
        return None
    run = RunState.from_dict(state)
    return run.equal_tau_speedup(run.layers, run.head_rows)


def summary_lines(state: dict, out: str) -> list[str]:
    """The end-of-run summary a person reads (stderr): what was removed, before -> after, where things are.

    `state`: the run's state as the JSON document `--json` writes (prune.state.RunState.to_dict()), whose
    parts it reads as far as they are there. The tau steps were judged on (check or calibration prompts,
    prune.state.judged_on) and predicted speedup come from it. Held-out tau and measured speedup are printed
    when the state holds them: `state["speed"]` = {"base": {...}, "final": {...}, "retention_error": E}, each
    row with any of "tau", "predicted_speedup", "measured_speedup" (its predicted speedup, when given, replaces
    the calibration one). Layer indices are 0-based, in the unpruned drafter.
    """
    from pathlib import Path

    from models.shards import stored_dtype
    from prune.state import judged_on
    from prune.text import number, plus_minus

    history, base = state["history"], state["base"]
    final = history[-1] if history else {}
    speed = state.get("speed") or {}
    speed_base, speed_final = speed.get("base") or {}, speed.get("final") or {}
    removed = [i for h in history for i in h["removed_original"]]
    unpruned = state.get("timing", {}).get("layers")
    of = f" of {unpruned}" if unpruned else ""
    heads = [h["head_rows"] for h in history if h.get("head_rows")]
    cut = f" and cut the head to {heads[-1]} ids" if heads else ""
    lines = [f"removed {len(removed)}{of} layers (original indices {', '.join(map(str, removed))}){cut} in "
             f"{len(history)} step{'s' * (len(history) != 1)}; stopped by {state['stopped_by']}"
             if history else f"removed no layer; stopped by {state['stopped_by']}"]

    def before_after(label: str, before, after, digits: int, suffix: str = "", retention: bool = False,
                     error: float | None = None, errors: tuple = (None, None)) -> None:
        """Add "label: before -> after" (just "before" when no step was taken), if there is a number to show,
        each with its standard error from `errors` where known; with `retention`, the ratio too (and its
        standard `error` where known)."""
        if before is None and (after is None or not history):
            return
        values = ((before, errors[0]), (after, errors[1])) if history else ((before, errors[0]),)
        text = " -> ".join(number(v, digits, suffix) + (plus_minus(e) if v is not None else "") for v, e in values)
        if retention and history and before and after is not None:
            text += f" (retention {after / before:.4f}{plus_minus(error, 4)})"
        lines.append(f"{label}: {text}")

    judged = judged_on(state.get("config", {}).get("check_prompts"))
    before_after(f"{judged} tau", base["tau"], final.get("tau"), 3, retention=True)
    before_after("held-out tau", speed_base.get("tau"), speed_final.get("tau"), 3, retention=True,
                 error=speed.get("retention_error"))
    predicted = (speed_base, speed_final) if "predicted_speedup" in speed_base | speed_final else (base, final)
    before_after("predicted speedup", *(p.get("predicted_speedup") for p in predicted), 2, "x")
    before_after("measured speedup", speed_base.get("measured_speedup"), speed_final.get("measured_speedup"), 2, "x",
                 errors=(speed_base.get("measured_speedup_error"), speed_final.get("measured_speedup_error")))
    gain = equal_tau_gain(state)
    if gain is not None:
        lines.append(f"fewer layers{' and head rows' if heads else ''} alone, at equal tau (predicted): {gain:.3f}x")
    if history:
        layers = final["layers"]
        lines.append(f"pruned drafter: {Path(out) / 'final'} -> {final['folder']} ({layers} "
                     f"layer{'s' * (layers != 1)}, {stored_dtype(Path(out) / final['folder'])})")
        # The per-step heals are short and judged on the calibration prompts; one longer heal distilled from the
        # unpruned drafter recovers most of what held-out prompts lost (docs/design.md, Healing a finished drafter).
        lines.append(f"heal it longer: prune heal {Path(out) / 'final'} {Path(out)}-healed")
    else:
        lines.append("pruned drafter: none (no step was taken; the source drafter stands)")
    lines.append(f"report: {Path(out) / 'report.md'}")
    return lines
