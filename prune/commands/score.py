"""`prune score`: per-layer importance, the drop in acceptance length when one layer is removed."""

from . import _types
from ._common import (
    add_command,
    add_debug,
    add_decode_args,
    add_model_args,
    add_prompt_args,
    add_tracking_args,
    decode_config,
    load_pair_and_prompts,
    make_tracker,
    show_progress,
    stdout_console,
    write_json,
)

EXAMPLES = """
examples:
  prune score --limit 16                                  (the demo pair, humaneval calibration prompts)
  prune score --drafter DRAFTER --target TARGET --prompts calib.jsonl --criterion speedup --json scores.json
"""


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "score",
        help="score every drafter layer by the drop in acceptance length without it",
        description="Score each layer of the drafter: tau of the drafter minus tau without that layer, "
        "measured by the async decoder on calibration prompts (replayed target trajectories by default), "
        "with a bootstrap confidence interval over prompts and the drafter's pass times without it. "
        "Layer indices are 0-based. Results are cached by drafter, target, prompts and settings." + EXAMPLES,
    )
    add_model_args(parser)
    add_prompt_args(parser, default_suite="humaneval:calib", max_new_tokens=64, limit=16)
    parser.add_argument("--criterion", choices=("tau", "speedup"), default="tau",
                        help="tau: drop in acceptance length; speedup: drop in predicted speedup")
    parser.add_argument("--verify", choices=("replay", "live"), default="replay",
                        help="replay: target trajectories recorded once; live: the target in every evaluation")
    add_decode_args(parser)
    parser.add_argument("--batch-size", type=_types.positive_int, default=16,
                        help="prompts per batched drafter pass (replay)")
    parser.add_argument("--bootstrap", type=_types.positive_int, default=1000,
                        help="bootstrap resamples for the intervals")
    parser.add_argument("--seed", type=_types.non_negative_int, default=0, help="bootstrap seed")
    parser.add_argument("--no-cache", action="store_true", help="recompute even when cached results exist")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the JSON report to OUT ('-' = stdout)")
    add_tracking_args(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from dataclasses import asdict

    from decode.timing import drafter_layer_costs
    from models._wheels import resolve_cache_dir
    from prune.progress import progress_bar
    from prune.scoring import (
        ScoreConfig,
        cached_json,
        cached_trajectories,
        fingerprint,
        placement,
        score_layers,
        trajectory_key,
    )

    pair, prompts, drafter_dir, target_path, source = load_pair_and_prompts(args)
    decode, times = decode_config(args, pair, max_new_tokens=args.max_new_tokens)
    config = ScoreConfig(criterion=args.criterion, verify=args.verify, decode=decode, batch_size=args.batch_size,
                         bootstrap=args.bootstrap, seed=args.seed)
    config.validate()
    ids = [p.input_ids for p in prompts]
    cache = None if args.no_cache else resolve_cache_dir(args.cache_dir)
    trajectories = cached_trajectories(cache, pair.target, ids, decode) if args.verify == "replay" else None
    drafter_hash = fingerprint(pair.drafter)
    # The drafter's dtype and device as well as its weights (the target's are in the trajectory key).
    key = fingerprint("scores", drafter_hash, *placement(pair.drafter), trajectory_key(pair.target, ids, decode),
                      config.criterion, config.verify, config.bootstrap, config.seed, asdict(decode))
    layers = pair.drafter.config.num_hidden_layers

    def score() -> dict:
        # Every reduced drafter has one layer fewer: its pass times come from the drafter's cost per layer
        # (decode.cost.LayerCost, fitted on two depths) instead of 36 timings that differ only by noise.
        costs = drafter_layer_costs(pair.drafter, decode.packed_budget, full=(times.draft_ms, times.packed_ms))
        return score_layers(pair.drafter, ids, config, target=pair.target, trajectories=trajectories,
                            on_layer=lambda *_: advance(), times=times, layer_costs=costs).to_dict()

    with progress_bar("score", layers, enabled=show_progress(args.json)) as advance:
        report = cached_json(cache / "scores" if cache else None, key, score)
    report["settings"].update({"drafter": drafter_dir, "target": target_path, "prompts_source": source})
    tracker = make_tracker(args, "score", {"settings": report["settings"], "drafter_hash": drafter_hash},
                           drafter_hash)
    tracker.log_scores(report)
    tracker.finish()
    write_json(report, args.json)
    if args.json != "-":
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    from rich.table import Table

    base = report["base"]
    title = (f"prune score: base tau {base['tau']:.3f} on {report['settings']['prompts']} prompts "
             f"({report['settings']['criterion']}, {report['settings']['verify']}), least harmful first")
    table = Table(title=title)
    for column in ("layer", "original", "delta tau", "95% interval", "tau without", "draft ms", "packed ms",
                   "pred. speedup"):
        table.add_column(column, justify="right")
    for s in sorted(report["layers"], key=lambda s: (s["score"], s["layer"])):
        speedup = "-" if s["predicted_speedup"] is None else f"{s['predicted_speedup']:.2f}"
        table.add_row(str(s["layer"]), str(s["original_layer"]), f"{s['delta_tau']:+.3f}",
                      f"[{s['ci_low']:+.3f}, {s['ci_high']:+.3f}]", f"{s['tau_without']:.3f}",
                      f"{s['draft_pass_ms']:.1f}", f"{s['packed_pass_ms']:.1f}", speedup)
    stdout_console().print(table)
