"""`prune vocab`: cut a drafter's head to a draft vocabulary of the K ids its target says most."""

from . import _types
from ._common import add_command, add_debug

EXAMPLES = """examples:
  prune vocab models/demo_drafter demo-8k --size 8192                 (counted on the demo's distillation data)
  prune vocab pruned/final final-4k --size 4096 --data data/distill
  prune vocab D OUT --size 8192 --data train-outputs.jsonl            (prune bench --save-outputs on a train part)"""
# The sizes `--json` and the summary report coverage at, beside --size.
REPORTED_SIZES = (32768, 16384, 8192, 4096, 2048)


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "vocab",
        help="cut a drafter's head to the K token ids its target says most (a draft vocabulary)",
        description="Export DRAFTER to OUT proposing only from the --size token ids its target says most often in "
        "its answers to training prompts (distillation data, or the ar lines of a prune bench --save-outputs "
        "file; a source holding a calib or eval prompt of the built-in suites is refused). The head is then "
        "computed on those rows alone in every drafter pass; the target still verifies over its whole "
        "vocabulary, so output stays exact. The weights are unchanged (the head on disk stays whole): "
        "OUT holds them, the ids (draft_vocab.safetensors) and the pruning history with a 'vocab' row. A drafter "
        f"that already has a draft vocabulary keeps the best-ranked of its own ids.\n\n{EXAMPLES}",
    )
    parser.add_argument("drafter", type=_types.drafter_dir, help="drafter folder to cut (any drafter or a pruned step)")
    parser.add_argument("destination", type=_types.output_dir,
                        help="new folder (must not exist or be empty unless --overwrite)")
    parser.add_argument("--size", type=_types.positive_int, required=True, metavar="K",
                        help="token ids the drafter may propose (e.g. 8192)")
    parser.add_argument("--data", type=_types.vocab_source, nargs="+", default=None, metavar="DIR|FILE.jsonl",
                        help="what the ids are counted on: distillation data folders (prune distill) or prune "
                        "bench --save-outputs files (their ar lines) (default: the demo drafter's shipped "
                        "distillation folders, models/demo.py DEMO_HEAL_DATA, for the demo drafter and its "
                        "pruned steps; required otherwise)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the cut's record (tokens, coverage, the ranking's source) as JSON ('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def vocab_data(data: list[str] | None, drafter: str | None, flag: str = "--data") -> list[str] | None:
    """The sources a draft vocabulary of `drafter` (None: the demo drafter) is counted on: `data`, else the demo
    drafter's shipped distillation folders for the demo drafter or an export of it (its report's source), else
    None."""
    from pathlib import Path

    from prune.export import read_report

    from ._heal import heal_data

    if data:
        return list(data)
    source = read_report(drafter)[0].get("source") if drafter is not None else None
    demo = heal_data(None, None, drafter, flags=flag) or (source and heal_data(None, None, source, flags=flag))
    return [str(Path(folder)) for folder in demo[0]] if demo else None


def run(args) -> int:
    import sys

    from models.checkpoint import ensure_writable_output, read_config_json
    from models.errors import ConfigError
    from prune.vocab import cut_folder, rank_tokens, ranking_text

    from ._common import quiet_libraries, write_json

    quiet_libraries()
    ensure_writable_output(args.destination, args.overwrite)  # before anything is counted
    sources = vocab_data(args.data, args.drafter)
    if sources is None:
        raise ConfigError(f"no data to count the draft vocabulary of {args.drafter} on; pass --data with distillation "
                          "folders of its target (prune distill) or a prune bench --save-outputs file")
    from transformers import Qwen3Config

    config = Qwen3Config.from_dict(read_config_json(args.drafter))
    ranking = rank_tokens(sources, config)
    record = cut_folder(args.drafter, args.destination, args.size, ranking, overwrite=args.overwrite)
    write_json(record, args.json)
    if args.json != "-":
        sizes = sorted({args.size, *(s for s in REPORTED_SIZES if s < ranking.ids.numel())}, reverse=True)
        print(ranking_text(ranking, sizes), file=sys.stderr)
        print(f"{args.destination}: {args.size} ids holding {record['coverage']:.2%} of those tokens", file=sys.stderr)
        print(args.destination)
    return 0
