"""`prune sweep`: an Optuna study over pruning settings; many workers, one storage, a study-wide budget."""

import argparse
import os
import sys

from decode.config import VERIFY_MODES
from prune.config import ScoreConfig
from sweeps import storages
from sweeps.config import COSTS, MODES, PRUNERS, SweepConfig

from . import _types
from ._checkpoint_args import add_max_shard_size_arg
from ._common import (
    add_command,
    add_debug,
    add_decode_args,
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
    stdout_console,
    write_json,
)
from ._heal import add_heal_data_arg, add_loss_data_arg, heal_examples, loss_data
from ._help import PROMPTS
from ._settings import build
from ._target import add_target_args, trajectory_source
from .run import add_vocab_args, vocab_ranking

EXAMPLES = """
examples:
  prune sweep --study s1 --n-trials 12 --heal-data data/demo-distill      (the demo pair; SQLite under sweep-s1/)
  prune sweep --study s1 --summary                                         (best trial and its checkpoint)
  prune sweep --study s2 --n-trials 40 --directions maximize minimize      (Pareto front: retention vs layers)
  prune sweep --study s3 --n-trials 100 --storage postgresql://user:pass@db-host/optuna --out /scratch/s3
        (run the same command on every machine: the workers share the study and its 100-trial budget)
  prune sweep --study s4 --n-trials 12 --ar-outputs ar.jsonl --pass-times bench.json
        (the target's outputs of the calibration, then the evaluation prompts, recorded once: no target weights)
"""
SWEEP, SCORE = defaults(SweepConfig), defaults(ScoreConfig)


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "sweep",
        help="search pruning settings with Optuna (many workers can share one study)",
        description="Run Optuna trials, each a full pruning campaign (as `prune run`) with settings drawn from a "
        "search space (--space, TOML; the default ships in sweeps/default_space.toml). Each trial exports to "
        "OUT/trial-NNNN and is measured on fixed evaluation prompts. Single-objective (one direction): maximize "
        "predicted speedup subject to eval retention >= --retention-floor; two directions: Pareto front of "
        "retention vs cost. Workers running the same command against one --storage share the study; "
        "--n-trials is the study-wide number of trials that end COMPLETE or PRUNED." + EXAMPLES,
        common=("--study", "--n-trials", "--summary", "--space", "--out", "--storage", "--directions", "--drafter",
                "--target", *PROMPTS, "--heal-data", "--json", "--config"),
    )
    parser.add_argument("--study", default=None, type=_types.name,
                        help="study name, also the W&B group of its trials (default: none; give it here or as "
                        "[sweep] study in --config)")
    parser.add_argument("--storage", default=None,
                        help=f"Optuna storage: {storages.examples()} (default: sqlite under --out)")
    parser.add_argument("--out", default=None, type=_types.output_dir,
                        help="folder for this worker's trials (default: sweep-STUDY)")
    parser.add_argument("--n-trials", type=_types.positive_int, default=None,
                        help="study-wide number of COMPLETE/PRUNED trials to reach (all workers together)")
    parser.add_argument("--timeout", type=_types.positive_float, default=None,
                        help="start no trial after this many seconds")
    parser.add_argument("--space", default=None, type=_types.text_file,
                        help="search space TOML file (default: the shipped one)")
    parser.add_argument("--directions", nargs="+", default=list(SWEEP["directions"]), choices=MODES[-1],
                        help="`maximize`: predicted speedup; `maximize minimize`: retention vs cost (Pareto)")
    parser.add_argument("--retention-floor", type=_types.positive_fraction, default=SWEEP["retention_floor"],
                        help="least eval retention of a feasible trial; also the least --min-retention of a campaign")
    parser.add_argument("--cost", choices=COSTS, default=SWEEP["cost"],
                        help="cost objective of the Pareto mode: layers left or predicted packed-pass ms")
    parser.add_argument("--pruner", choices=PRUNERS, default=PRUNERS[0],
                        help="stop unpromising trials early (single-objective mode only)")
    parser.add_argument("--seed", type=_types.non_negative_int, default=SWEEP["seed"],
                        help="seeds the sampler (per trial), healing and bootstrap")
    parser.add_argument("--heartbeat", type=_types.non_negative_int, default=storages.Options.heartbeat,
                        help="seconds between a running trial's heartbeats (RDB storages; 0: off)")
    parser.add_argument("--grace", type=_types.positive_int, default=None,
                        help="seconds without heartbeat before a trial counts as dead (default: 3 x --heartbeat)")
    parser.add_argument("--summary", action="store_true", help="print the best trial / Pareto front and exit")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the summary as JSON ('-' = stdout)")
    add_model_args(parser)
    add_prompt_args(parser, default_suite="humaneval:calib", max_new_tokens=32, limit=None)
    parser.add_argument("--eval-suite", default="humaneval:eval", metavar="NAME[:train|:calib|:eval]", type=_types.suite,
                        help="built-in suite measuring every trial's final drafter")
    parser.add_argument("--eval-prompts", default=None, metavar="FILE.jsonl", type=_types.text_file,
                        help="JSONL evaluation prompts instead")
    parser.add_argument("--eval-limit", type=_types.positive_int, default=8, help="evaluation prompts used")
    parser.add_argument("--verify", choices=VERIFY_MODES, default=SCORE["verify"], help="verification in scoring")
    add_target_args(parser)
    add_decode_args(parser)
    add_heal_data_arg(parser)  # without healing data the space's LoRA settings are not searched
    add_loss_data_arg(parser)
    add_vocab_args(parser)  # without the ids' ranking the space's vocab_size is not searched
    add_export_dtype_arg(parser)
    add_max_shard_size_arg(parser)
    add_tracking_args(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from sweeps.objective import check_layer_budget
    from sweeps.space import SearchSpace
    from sweeps.study import open_study, run_worker, summarize

    if not args.study:
        from models.errors import ConfigError

        raise ConfigError("name the study: --study NAME (or study in the [sweep] section of --config)")
    config = build(args, "sweep", {"out": args.out or f"sweep-{args.study}"})
    config.validate()
    out = config.out
    space = SearchSpace.from_file(args.space)
    storage = storages.make_storage(args.storage or f"sqlite:///{os.path.abspath(out)}/optuna.db", args.heartbeat,
                                    args.grace)
    if args.summary:
        import optuna

        try:
            study = optuna.load_study(study_name=args.study, storage=storage)
        except KeyError:
            from models.errors import ConfigError

            raise ConfigError(f"no study {args.study!r} in this storage; check --study and --storage") from None
        return _report(summarize(study), args.json)
    if args.n_trials is None and args.timeout is None:
        from models.errors import ConfigError

        raise ConfigError("give --n-trials (the study-wide total) or --timeout, or --summary to see results")
    check_layer_budget(space, drafter_layers(args))  # before any model loads
    objective = _objective(args, config, space)
    study = open_study(args.study, storage, config.directions,
                       {**config.record(), "space": objective.space.record()}, seed=args.seed, pruner=args.pruner)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    reason = run_worker(study, storage, objective, args.n_trials, args.timeout, log=log)
    log(f"worker done: {reason}")
    return _report(summarize(study), args.json)


def _objective(args, config, space):
    """Load the pair, prompts and trajectories once per worker and build the trial objective."""
    from dataclasses import replace

    from decode.prompts import check_context, tokenize_records
    from prune.cache import fingerprint
    from prune.scoring import cached_trajectories
    from sweeps.objective import PruningObjective, SweepData

    if args.limit is None:
        args.limit = int(space.largest("calibration_prompts", 16))
    pair, calibration, drafter_dir, _, _ = load_pair_and_prompts(args)
    evaluation_args = argparse.Namespace(**{**vars(args), "suite": args.eval_suite if not args.eval_prompts else None,
                                            "prompts": args.eval_prompts, "limit": args.eval_limit})
    evaluation = tokenize_records(prompt_records(evaluation_args)[0], pair.tokenizer, not args.no_chat_template)
    check_context(evaluation, args.max_new_tokens, pair.drafter.config.block_size, pair.max_positions)
    source = trajectory_source(args, pair, calibration + evaluation)
    decode, times = decode_config(args, pair, max_new_tokens=args.max_new_tokens)
    if times is None:
        from models.errors import ConfigError

        raise ConfigError("prune sweep ranks trials by predicted speedup (and its space may score layers by it), which "
                          "needs the target's pass times; with --ar-outputs give --pass-times FILE.json")
    criteria = space.params["criterion"].choices if "criterion" in space.params else [space.fixed.get("criterion")]
    config.score = replace(config.score, decode=decode, loss_data=loss_data(args, criteria))
    calibration_ids = [p.input_ids for p in calibration]
    evaluation_ids = [p.input_ids for p in evaluation]
    cache = cache_dir(args)

    def trajectories(ids):
        return cached_trajectories(cache, source, ids, decode) if args.verify == "replay" else None

    examples, heal_data = heal_examples(args)
    if not examples:
        print("note: no --heal-data, so trials do not heal and the space's LoRA settings are not searched",
              file=sys.stderr)
    drafter_hash = fingerprint(pair.drafter)
    ranking = vocab_ranking(args, pair.drafter)
    config.vocab_sizes = args.vocab_sizes if ranking is not None else ()
    data = SweepData(pair.drafter, drafter_dir, source, calibration_ids, trajectories(calibration_ids),
                     evaluation_ids, trajectories(evaluation_ids), examples, drafter_hash, times, cache, heal_data,
                     ranking)

    def tracker_factory(trial, run_config):
        name = f"{config.study}-trial-{trial.number:04d}"
        return make_tracker(args, "trial", run_config, drafter_hash, out=f"{config.out}/trial-{trial.number:04d}",
                            group=config.study, name=name, extra_tags=(f"study-{config.study}",))

    return PruningObjective(config, space, data, tracker_factory,
                            log=lambda message: print(message, file=sys.stderr))


def _report(summary: dict, destination: str | None) -> int:
    write_json(summary, destination)
    if destination != "-":
        print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    import socket

    from rich.table import Table

    from prune.text import number

    counts = ", ".join(f"{n} {state.lower()}" for state, n in summary["counts"].items()) or "no trials"
    multi = "pareto_front" in summary
    rows = summary["pareto_front"] if multi else [summary["best"]] if summary["best"] else []
    what = "Pareto front (eval retention vs cost)" if multi else (
        f"best trial (max predicted speedup, eval retention >= {summary['retention_floor']})")
    table = Table(title=f"study {summary['study']}: {counts}; {what}")
    for column in ("trial", "eval retention", "eval tau", "pred. speedup", "layers", "removed", "checkpoint"):
        table.add_column(column, justify="left" if column == "checkpoint" else "right")
    here = socket.gethostname()
    for row in rows:
        where = row["checkpoint"] or "-"
        if row.get("host") and row["host"] != here:
            where = f"{row['host']}:{where}"
        table.add_row(str(row["number"]), number(row["eval_retention"], 4), number(row["eval_tau"], 3),
                      number(row["predicted_speedup"], 2), str(row["layers"]), str(row["layers_removed"]), where)
    stdout_console().print(table)
    front = summary.get("tradeoff_front")
    if front:
        listed = ", ".join(f"trial {row['number']} (retention {number(row['eval_retention'], 4)}, cost "
                           f"{number(row['cost'], 2)})" for row in front)
        stdout_console().print(f"trade-off front (eval retention vs cost, from trial attributes): {listed}")

