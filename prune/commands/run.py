"""`prune run`: progressive pruning - score, remove, heal with LoRA, export - repeated until a stop rule."""

import functools
import json
import sys

from ._common import (
    add_command,
    add_debug,
    add_heal_data_arg,
    add_model_args,
    add_prompt_args,
    add_tracking_args,
    heal_examples,
    load_pair_and_prompts,
    make_tracker,
    show_progress,
    write_json,
)

EXAMPLES = """
examples:
  prune run --out pruned --layers-to-remove 5 --heal-data data/distill        (the demo pair)
  prune run --drafter D --target T --prompts calib.jsonl --out pruned --min-retention 0.98 --heal-steps 0
  prune run --out pruned --resume                                             (continue an interrupted run)
"""


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "run",
        help="prune layers progressively: score, remove, heal with LoRA, export each step",
        description="Progressive pruning: score the remaining layers (async decoder, replayed target "
        "trajectories), remove the least harmful (--per-step at a time), heal with a short LoRA fine-tune on "
        "distillation data (kept only if it does not lower tau), export the step to OUT/step-XX, repeat. "
        "Stops at --layers-to-remove, at --min-retention of the unpruned calibration tau, or when predicted "
        "speedup stops improving. OUT/final points at the last step taken." + EXAMPLES,
    )
    add_model_args(parser)
    add_prompt_args(parser, default_suite="humaneval:calib", max_new_tokens=64, limit=16)
    parser.add_argument("--out", required=True, help="output folder (must be empty unless --resume)")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT after its last completed step")
    parser.add_argument("--layers-to-remove", type=int, default=None, help="stop after removing this many layers")
    parser.add_argument("--min-retention", type=float, default=0.99,
                        help="never take a step below this fraction of the unpruned calibration tau")
    parser.add_argument("--per-step", type=int, default=1, help="layers removed per step")
    parser.add_argument("--no-speedup-stop", action="store_true",
                        help="do not stop when predicted speedup stops improving")
    parser.add_argument("--criterion", choices=("tau", "speedup"), default="tau", help="layer scoring criterion")
    parser.add_argument("--verify", choices=("replay", "live"), default="replay", help="verification in scoring")
    parser.add_argument("--packed-budget", type=int, default=64, help="async: candidate tokens per packed pass")
    add_heal_data_arg(parser)
    parser.add_argument("--heal-steps", type=int, default=40, help="LoRA updates per heal (0: no healing)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (scale = alpha / rank)")
    parser.add_argument("--heal-lr", type=float, default=5e-4, help="LoRA learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds healing and the bootstrap")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the final state as JSON ('-' = stdout)")
    add_tracking_args(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from decode.decoders import DecodeConfig
    from prune.heal import HealConfig
    from prune.progress import progress_bar
    from prune.progressive import RunConfig, check_resumable, config_record, run_pruning
    from prune.scoring import ScoreConfig, fingerprint, record_trajectories

    if args.resume:
        check_resumable(args.out)
    pair, tokenized, drafter_dir, target_path, source = load_pair_and_prompts(args)
    prompts = [p.input_ids for p in tokenized]
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_ids=pair.stop_ids, packed_budget=args.packed_budget)
    examples, heal_data = heal_examples(args)
    config = RunConfig(
        layers_to_remove=args.layers_to_remove, min_retention=args.min_retention, per_step=args.per_step,
        stop_on_speedup=not args.no_speedup_stop,
        score=ScoreConfig(criterion=args.criterion, verify=args.verify, decode=decode, seed=args.seed),
        heal=HealConfig(steps=args.heal_steps if examples else 0, rank=args.lora_rank, alpha=args.lora_alpha,
                        lr=args.heal_lr, seed=args.seed),
    )
    config.validate(pair.drafter.config.num_hidden_layers)
    trajectories = record_trajectories(pair.target, prompts, decode) if args.verify == "replay" else None
    drafter_hash = fingerprint(pair.drafter)
    tracker = make_tracker(args, "run", {
        "settings": config_record(config), "drafter": drafter_dir, "drafter_hash": drafter_hash,
        "target": target_path, "prompts": source, "prompt_count": len(prompts), "heal_data": heal_data,
        "out": args.out, "resume": args.resume}, drafter_hash, out=args.out)
    try:
        state = run_pruning(pair.drafter, drafter_dir, prompts, args.out, config, target=pair.target,
                            trajectories=trajectories, heal_examples=examples, resume=args.resume,
                            log=lambda message: print(message, file=sys.stderr), on_step=tracker.on_step,
                            progress=functools.partial(progress_bar, enabled=show_progress(args.json)))
    except BaseException:
        tracker.finish(exit_code=1)
        raise
    tracker.finish(state, args.out)
    write_json(state, args.json)
    if args.json != "-":
        print(json.dumps({"stopped_by": state["stopped_by"], "steps": len(state["history"]),
                          "final": f"{args.out}/final" if state["history"] else None,
                          "base_tau": state["base"]["tau"],
                          "final_tau": state["history"][-1]["tau"] if state["history"] else None}))
    return 0
