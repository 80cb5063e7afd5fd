"""`prune bench`: acceptance length, speed and exactness of ar / sync / async on a prompt set."""

import json

from ._common import (
    add_command,
    add_debug,
    add_model_args,
    add_prompt_args,
    load_pair_and_prompts,
    show_progress,
    stdout_console,
    write_json,
)

EXAMPLES = """
examples:
  prune bench --suite humaneval:eval --limit 10          (the demo pair)
  prune bench --drafter DRAFTER --target TARGET --prompts prompts.jsonl --limit 10
  prune bench --drafter DRAFTER --target TARGET --prompts p.jsonl --decoder async --verify replay --json -
  prune bench --suite champ:eval --decoder async --verify replay --replay-batch 16   (a whole part's tau)
  prune bench --suite champ:eval --decoder ar --save-outputs ar.jsonl          (the target once, then per drafter:)
  prune bench --drafter D --suite champ:eval --decoder async --verify replay --replay-batch 16 --ar-outputs ar.jsonl
"""


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "bench",
        help="measure acceptance length and speedup of ar, sync and async decoding",
        description="Measure acceptance length (tau), time per token, speedup vs ar and exactness of the "
        "ar, sync and async decoders on the same prompts, after a warm-up." + EXAMPLES,
    )
    add_model_args(parser)
    add_prompt_args(parser)
    parser.add_argument("--decoder", default="all", choices=("ar", "sync", "async", "all"),
                        help="decoder to measure (ar always runs as the baseline)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens verified per round (default: the drafter's block_size)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = speculative sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--verify", choices=("live", "replay"), default="live",
                        help="live: run the target; replay: answer from the ar trajectory (greedy only)")
    parser.add_argument("--replay-batch", type=int, default=1, metavar="N",
                        help="with --verify replay: decode N prompts in lockstep (tau and exactness as one at a "
                        "time, in a fraction of the time; per-prompt times are then null)")
    parser.add_argument("--ar-outputs", metavar="FILE.jsonl", default=None,
                        help="with --verify replay: take the target's outputs from the ar lines of a --save-outputs "
                        "file of the same target, prompts and --max-new-tokens instead of decoding them")
    parser.add_argument("--packed-budget", type=int, default=64,
                        help="async: query tokens the packed pass spends on candidate blocks")
    parser.add_argument("--fan-out", type=int, default=3, help="async: most bonus guesses per outcome")
    parser.add_argument("--sequential", action="store_true",
                        help="async: run the verify and packed passes one after the other (debugging)")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the JSON report to OUT ('-' = stdout)")
    parser.add_argument("--save-outputs", metavar="OUT.jsonl", default=None,
                        help="write one JSON line per prompt and decoder with the output ids (and text)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from decode.bench import BenchConfig, run_bench
    from decode.decoders import DECODERS, DecodeConfig

    pair, prompts, drafter_dir, target_path, source = load_pair_and_prompts(args)
    decode = DecodeConfig(
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        temperature=args.temperature,
        seed=args.seed,
        stop_ids=pair.stop_ids,
        packed_budget=args.packed_budget,
        fan_out=args.fan_out,
        concurrent=not args.sequential,
    )
    decoders = DECODERS if args.decoder == "all" else ("ar", args.decoder)
    config = BenchConfig(decode=decode, decoders=decoders, verify=args.verify, replay_batch=args.replay_batch)
    config.validate()

    from prune.progress import progress_bar

    ar_outputs = read_ar_outputs(args.ar_outputs, prompts) if args.ar_outputs else None
    total = len(prompts) * len(set(decoders))
    with progress_bar("bench", total, enabled=show_progress(args.json)) as advance:
        report, outputs = run_bench(pair.drafter, pair.target, prompts, config, on_result=lambda *_: advance(),
                                    ar_outputs=ar_outputs)
    report["settings"].update({"drafter": drafter_dir, "target": target_path, "prompts": source,
                               "ar_outputs": args.ar_outputs})
    if args.save_outputs:
        _save_outputs(args.save_outputs, prompts, outputs, pair.tokenizer)
    write_json(report, args.json)
    if args.json != "-":
        print_table(report)
    return 0


def read_ar_outputs(path: str, prompts) -> list[list[int]]:
    """The ar output ids per prompt (by id) from a file written by --save-outputs."""
    from models.errors import DataError

    recorded = {}
    try:
        with open(path) as handle:
            for line in handle:
                if line.strip():
                    record = json.loads(line)
                    if record.get("decoder") == "ar":
                        recorded[str(record["id"])] = [int(t) for t in record["output_ids"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"cannot read ar outputs from {path} ({exc}); pass a file written by --save-outputs") from None
    missing = [p.id for p in prompts if p.id not in recorded]
    if missing:
        raise DataError(f"{path} has no ar output for prompt {missing[0]!r} ({len(missing)} missing); "
                        "record it with --save-outputs on the same prompts")
    return [recorded[p.id] for p in prompts]


def _save_outputs(path: str, prompts, outputs: dict, tokenizer) -> None:
    with open(path, "w") as handle:
        for decoder, results in outputs.items():
            for prompt, result in zip(prompts, results):
                line = {"id": prompt.id, "decoder": decoder, "output_ids": result.output_ids}
                if tokenizer is not None:
                    line["text"] = tokenizer.decode(result.output_ids, skip_special_tokens=False)
                handle.write(json.dumps(line) + "\n")


def print_table(report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"prune bench: {report['prompts']} prompts, verify={report['settings']['verify']}")
    for column in ("decoder", "tau macro", "tau micro", "ms/token", "tokens/s", "speedup", "exact", "hit rate"):
        table.add_column(column, justify="right")
    for name, d in report["decoders"].items():
        table.add_row(
            name,
            _fmt(d.get("tau_macro")), _fmt(d.get("tau_micro")), _fmt(d.get("time_per_token_ms")),
            _fmt(d.get("tokens_per_s"), 1), _fmt(d.get("speedup_vs_ar")), _fmt(d.get("exact_match_vs_ar")),
            _fmt(d.get("hit_rate")),
        )
    stdout_console().print(table)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}"
