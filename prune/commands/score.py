"""`prune score`: per-layer importance, the drop in acceptance length when one layer is removed (or a ranking
criterion's score of every layer, prune.ranking)."""

import sys

from decode.config import VERIFY_MODES
from prune.config import ScoreConfig
from prune.criteria import CRITERIA, describe

from . import _types
from ._heal import add_loss_data_arg, loss_data
from ._common import (
    add_command,
    add_debug,
    add_decode_args,
    add_prescreen_args,
    add_screen_args,
    add_model_args,
    add_prompt_args,
    add_tracking_args,
    cache_dir,
    decode_config,
    defaults,
    load_pair_and_prompts,
    make_tracker,
    show_progress,
    stdout_console,
    write_json,
)
from ._help import PAIR, PROMPTS
from ._settings import build
from ._target import add_target_args, check_pass_times, trajectory_source

EXAMPLES = """
examples:
  prune score --limit 16                                  (the demo pair, humaneval calibration prompts)
  prune score --drafter DRAFTER --target TARGET --prompts calib.jsonl --criterion speedup --json scores.json
  prune score --criterion block-influence                 (every layer from one pass per batch, no decoder)
  prune score --prescreen angular --prescreen-keep 12     (tau measured for the 12 layers angular ranks lowest)
  prune bench --target TARGET --suite humaneval:calib --limit 16 --max-new-tokens 64 --decoder ar \
      --save-outputs ar.jsonl --json bench.json                (record the target's outputs and pass times once)
  prune score --drafter DRAFTER --target TARGET --ar-outputs ar.jsonl --pass-times bench.json
                                                          (then score without loading the target's weights)
"""
SCORE = defaults(ScoreConfig)


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "score",
        help="score every drafter layer by the drop in acceptance length without it",
        description="Score each layer of the drafter: tau of the drafter minus tau without that layer, "
        "measured by the async (or --decoder sync) decoder on calibration prompts (replayed target trajectories "
        "by default, decoded by the target or read from --ar-outputs), "
        "with a bootstrap confidence interval over prompts and the drafter's pass times without it. "
        "A ranking criterion (block-influence, angular, loss, last, random) scores every layer at once without "
        "the decoder. Layer indices are 0-based. Results are cached by drafter, target, prompts and settings."
        + EXAMPLES,
        common=(*PAIR, *PROMPTS, "--criterion", "--json", "--config"),
    )
    add_model_args(parser)
    add_prompt_args(parser, default_suite="humaneval:calib", max_new_tokens=64, limit=16)
    parser.add_argument("--criterion", choices=tuple(CRITERIA), default=SCORE["criterion"], help=describe())
    parser.add_argument("--verify", choices=VERIFY_MODES, default=SCORE["verify"],
                        help="replay: target trajectories recorded once; live: the target in every evaluation")
    add_target_args(parser)
    add_decode_args(parser)
    parser.add_argument("--batch-size", type=_types.positive_int, default=SCORE["batch_size"],
                        help="prompts per batched drafter pass (replay)")
    add_screen_args(parser)
    add_prescreen_args(parser)
    add_loss_data_arg(parser)
    parser.add_argument("--bootstrap", type=_types.positive_int, default=SCORE["bootstrap"],
                        help="bootstrap resamples for the intervals")
    parser.add_argument("--seed", type=_types.non_negative_int, default=SCORE["seed"],
                        help="seeds the bootstrap, the loss criterion's draw and the random criterion")
    parser.add_argument("--no-cache", action="store_true", help="recompute even when cached results exist")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the JSON report to OUT ('-' = stdout)")
    add_tracking_args(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    import time

    from prune.progress import progress_bar
    from prune.cache import fingerprint
    from prune.ranking import skipped_note
    from prune.scoring import cached_scores, cached_trajectories, round_evaluations
    from prune.state import campaign_timing

    from prune.trajectories import source_record

    pair, prompts, drafter_dir, target_path, source = load_pair_and_prompts(args)
    trajectories_from = trajectory_source(args, pair, prompts)
    decode, times = decode_config(args, pair, max_new_tokens=args.max_new_tokens)
    config = build(args, "score", {"decode": decode, "loss_data": loss_data(args, (args.criterion, args.prescreen))})
    config.validate()
    check_pass_times(config.criterion, times)
    ids = [p.input_ids for p in prompts]
    cache = cache_dir(args)
    trajectories = cached_trajectories(cache, trajectories_from, ids, decode) if args.verify == "replay" else None
    # Every reduced drafter has one layer fewer: its pass times come from the drafter's cost per layer
    # (decode.cost.LayerCost, fitted on two depths) instead of 36 timings that differ only by noise. The
    # timing and the report are those `prune run` uses and caches for its first round.
    timing = campaign_timing(pair.drafter, config, trajectories_from, times, cache)
    evaluations = round_evaluations(config, pair.drafter.config.num_hidden_layers, len(ids))
    started = time.monotonic()
    with progress_bar("score", evaluations, enabled=show_progress(args.json)) as advance:
        report = cached_scores(cache, pair.drafter, ids, config, timing, trajectories_from, trajectories,
                               on_layer=lambda *_: advance()).to_dict()
    # wall_s: this command's scoring round (near 0 when the report came from the cache; --no-cache measures it)
    report["settings"].update({"drafter": drafter_dir, "target": target_path, "prompts_source": source,
                               "trajectories": source_record(trajectories_from), "wall_s": time.monotonic() - started})
    note = skipped_note(report)
    if note:
        print(note, file=sys.stderr)
    drafter_hash = fingerprint(pair.drafter)
    tracker = make_tracker(args, "score", {"settings": report["settings"], "drafter_hash": drafter_hash},
                           drafter_hash)
    tracker.log_scores(report)
    tracker.finish()
    write_json(report, args.json)
    if args.json != "-":
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    from dataclasses import asdict

    from rich.table import Table

    from prune.scoring import ScoreReport

    from prune.text import number

    base, settings = report["base"], report["settings"]
    screened = (f"; screened on the first {settings['screen_prompts']}, {settings['screen_keep']} layers on all"
                if settings.get("screen_prompts") else "")
    if settings.get("prescreen"):
        screened += f"; pre-screened by {settings['prescreen']}"
    measured = f"base tau {base['tau']:.3f} on " if base else ""
    title = (f"prune score: {measured}{settings['prompts']} prompts ({settings['criterion']}"
             f"{', ' + settings['verify'] if base else ''}{screened}), least harmful first")
    table = Table(title=title)
    for column in ("layer", "original", "delta tau", "95% interval", "tau without", "prompts", "draft ms",
                   "packed ms", "pred. speedup", "score"):
        table.add_column(column, justify="right")
    for s in map(asdict, ScoreReport.from_dict(report).ranking()):
        interval = "-" if s["ci_low"] is None else f"[{s['ci_low']:+.3f}, {s['ci_high']:+.3f}]"
        prompts = "skipped" if s["skipped"] else str(s["prompts"] or settings["prompts"]) if base else "-"
        table.add_row(str(s["layer"]), str(s["original_layer"]),
                      "-" if s["delta_tau"] is None else f"{s['delta_tau']:+.3f}", interval,
                      number(s["tau_without"], 3), prompts, number(s["draft_pass_ms"], 1),
                      number(s["packed_pass_ms"], 1), number(s["predicted_speedup"], 2), f"{s['score']:.4g}")
    stdout_console().print(table)
