"""`prune bench`: acceptance length, speed and exactness of ar / sync / async (and transformers' own
greedy baselines) on a prompt set, for one drafter or several side by side."""

import argparse
import json
import sys

from decode.config import VERIFY_MODES, BaselineConfig, BenchConfig
from decode.registry import BASELINE, SPECULATIVE, TARGET, check_decoder_names, describe
from models.errors import ConfigError

from . import _types
from ._checkpoint_args import drafter_keys
from ._common import (
    DECODE,
    add_command,
    add_debug,
    add_decode_args,
    add_gate_arg,
    add_tree_arg,
    add_model_args,
    add_prompt_args,
    cache_dir,
    decode_configs,
    defaults,
    drafter_path,
    load_pair_and_prompts,
    model_paths,
    output_file,
    pass_times_record,
    show_progress,
    stdout_console,
    write_json,
)
from ._help import COMMON

EXAMPLES = """
examples:
  prune bench --suite humaneval:eval --limit 10          (the demo pair)
  prune bench --drafter DRAFTER --target TARGET --prompts prompts.jsonl --limit 10
  prune bench --drafter D1 --drafter D2 --target TARGET --prompts p.jsonl     (two drafters, one ar run)
  prune bench --drafter DRAFTER --target TARGET --prompts p.jsonl --decoder ar,async,pld
  prune bench --drafter DRAFTER --target TARGET --prompts p.jsonl --assistant SMALL_MODEL   (adds assisted)
  prune bench --drafter DRAFTER --target TARGET --prompts p.jsonl --decoder async --verify replay --json -
  prune bench --suite champ:eval --decoder async --verify replay --replay-batch 16   (a whole part's tau)
  prune bench --suite champ:eval --decoder ar --save-outputs ar.jsonl          (the target once, then per drafter:)
  prune bench --drafter D --suite champ:eval --decoder async --verify replay --replay-batch 16 --ar-outputs ar.jsonl
"""
BENCH, BASELINES = defaults(BenchConfig), defaults(BaselineConfig)


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "bench",
        help="measure acceptance length and speedup of ar, sync and async decoding",
        description="Measure acceptance length (tau), time per token, speedup vs ar and exactness of the "
        "ar, sync and async decoders of one or several drafters, and of transformers' greedy generate() "
        "with and without prompt lookup (and with an assistant model), on the same prompts, after a warm-up. "
        "With several --drafter, every drafter after the first is also compared with the first, measured in "
        "the same run: how much faster, at what share of its tau, and how much faster at equal tau."
        + EXAMPLES,
        common=(*COMMON, "--decoder"),
    )
    add_model_args(parser, several_drafters=True, block_size=False)
    add_prompt_args(parser)
    parser.add_argument("--decoder", default="all", type=decoder_names, metavar="NAME[,NAME...]",
                        help=f"decoders to measure, comma-separated: {describe(TARGET, SPECULATIVE)}, "
                        f"{describe(BASELINE)} or all; ar always runs as the baseline; all leaves out the "
                        "transformers rows at --temperature > 0 and with --verify replay, and assisted without "
                        "--assistant")
    parser.add_argument("--pld-tokens", type=_types.positive_int, default=BASELINES["pld_tokens"], metavar="N",
                        help="pld: tokens proposed per prompt lookup (transformers' prompt_lookup_num_tokens)")
    parser.add_argument("--assistant", default=None, metavar="MODEL", type=_types.model_path,
                        help="assisted: a small causal LM folder or .gguf file with the target's tokenizer, the "
                        "draft model of transformers' assisted generation (default: none, no assisted row)")
    parser.add_argument("--block-size", type=_types.block_size, default=None,
                        help="most tokens verified per round; also the drafter's block_size where its config.json "
                        "has none (default: the drafter's block_size)")
    parser.add_argument("--temperature", type=_types.non_negative_float, default=DECODE["temperature"],
                        help="0 = greedy; > 0 = speculative sampling")
    parser.add_argument("--seed", type=_types.non_negative_int, default=DECODE["seed"], help="sampling seed")
    parser.add_argument("--verify", choices=VERIFY_MODES, default=BENCH["verify"],
                        help="live: run the target; replay: answer sync and async verification from the ar trajectory "
                        "(greedy only)")
    parser.add_argument("--replay-batch", type=_types.positive_int, default=BENCH["replay_batch"], metavar="N",
                        help="with --verify replay: decode N prompts in lockstep (tau and exactness as one at a "
                        "time, in a fraction of the time; per-prompt times are then null)")
    parser.add_argument("--ar-outputs", metavar="FILE.jsonl", default=None, type=_types.text_file,
                        help="with --verify replay: take the target's outputs from a file instead of decoding them: "
                        "the ar lines of a --save-outputs file of the same target and prompts, or another engine's "
                        "records (output_ids, with prompt_ids and/or id), recorded with at least --max-new-tokens")
    add_decode_args(parser)
    add_gate_arg(parser, None)
    add_tree_arg(parser)
    parser.add_argument("--fan-out", type=_types.non_negative_int, default=DECODE["fan_out"],
                        help="async: most bonus guesses per outcome")
    parser.add_argument("--sequential", action="store_true",
                        help="async: run the verify and packed passes one after the other (debugging)")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the JSON report to OUT ('-' = stdout)")
    parser.add_argument("--save-outputs", metavar="OUT.jsonl", default=None, type=_types.output_file,
                        help="write one JSON line per prompt and decoder with the output ids (and text; the "
                        "drafter for sync and async)")
    add_debug(parser)
    parser.set_defaults(run=run)


def decoder_names(text: str) -> tuple[str, ...]:
    """--decoder's comma-separated names, checked against the decoder registry (a usage error otherwise)."""
    names = tuple(name.strip() for name in text.split(","))
    try:
        check_decoder_names(names, allow_all=True)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def run(args) -> int:
    from decode.bench import DRAFTED, run_bench, select_decoders

    check_block_size(args)
    pair, prompts, drafters, target_path, source = load_models_and_prompts(args)
    fields = dict(max_new_tokens=args.max_new_tokens, block_size=args.block_size, temperature=args.temperature,
                  seed=args.seed, fan_out=args.fan_out, concurrent=not args.sequential)
    configs = decode_configs(args, pair, [drafter for _, drafter in drafters], **fields)
    per_drafter = {name: entry for (name, _), entry in zip(drafters, configs)}
    decode = configs[0][0]
    decoders = select_decoders(args.decoder, args.temperature, args.verify, assistant=args.assistant is not None)
    assistant = load_assistant(args.assistant, pair) if args.assistant else None
    config = BenchConfig(decode=decode, decoders=decoders, verify=args.verify, replay_batch=args.replay_batch,
                         baselines=BaselineConfig(pld_tokens=args.pld_tokens, assistant=args.assistant,
                                                  assistant_model=assistant))
    config.validate()

    from prune.progress import progress_bar

    ar_outputs = recorded_outputs(args.ar_outputs, prompts, decode) if args.ar_outputs else None
    speculative = sum(d in DRAFTED for d in decoders)  # rows run once per drafter
    rows = len(decoders) - speculative + len(drafters) * speculative + ("ar" not in decoders)  # ar always runs
    with progress_bar("bench", len(prompts) * rows, enabled=show_progress(args.json)) as advance:
        report, outputs = run_bench(drafters, pair.target, prompts, config, on_result=lambda *_: advance(),
                                    ar_outputs=ar_outputs,
                                    decode_by_drafter={name: entry[0] for name, entry in per_drafter.items()},
                                    times_by_drafter={name: entry[1] for name, entry in per_drafter.items()})
    report["settings"].update({"target": target_path, "prompts": source, "ar_outputs": args.ar_outputs,
                               "pass_times": {name: times.to_dict() for name, (_, times) in per_drafter.items()}})
    if args.save_outputs:
        _save_outputs(args.save_outputs, prompts, outputs, pair.tokenizer)
    write_json(report, args.json)
    if args.json != "-":
        print_table(report)
    record = pass_times_record(cache_dir(args), pair.target, [drafter for _, drafter in drafters], decode)
    note = stale_pass_times_note(report, record)
    if note:
        print(note, file=sys.stderr)
    return 0


# A probe's one-token step against ar's time per token in decoding: on a quiet machine 0.8-0.9 (decoding adds the
# rounds' own work); outside this band the probe ran at another speed of the machine than the benchmark.
AR_PROBE_BAND = (0.6, 1.5)


def stale_pass_times_note(report: dict, record) -> str | None:
    """A note when the pass times behind the predictions read the target's step far from ar's measured time per
    token in this run, or a drafter's round (in target steps) far from its measured drafting rounds
    (`AR_PROBE_BAND` both): they are a few seconds of the machine, cached (at `record`, a Path, or None without a
    cache) and reused, so one probe taken while it ran slower or faster skews every prediction, and the
    adaptive width and the speculation gate decide on them."""
    from decode.bench import report_rows

    rows = report_rows(report)
    ar = next((d for drafter, name, d in rows if name == "ar"), None)
    measured = ar and ar.get("time_per_token_ms")
    pass_times = report["settings"].get("pass_times", {})
    probes = {times["ar_ms"] for times in pass_times.values()}
    if not measured or not probes:
        return None
    fix = f"delete {record} to measure them again" if record else "run again to measure them again"
    probe = max(probes, key=lambda ms: abs(ms / measured - 1))
    if not AR_PROBE_BAND[0] <= probe / measured <= AR_PROBE_BAND[1]:
        return (f"note: the pass times behind the predictions read the target's step at {probe:.1f} ms where ar "
                f"decoded at {measured:.1f} ms a token in this run: they were measured while the machine ran at "
                f"another speed, and every prediction is off by as much; {fix}")
    for drafter, name, d in rows:
        times = pass_times.get(drafter)
        if not (times and d.get("drafting_round_ms") and d.get("predicted_round_ms")):
            continue
        modelled, timed = d["predicted_round_ms"] / times["ar_ms"], d["drafting_round_ms"] / measured
        if not AR_PROBE_BAND[0] <= modelled / timed <= AR_PROBE_BAND[1]:
            return (f"note: the pass times behind the predictions price a {name} round of {drafter} at "
                    f"{modelled:.2f} target steps where its rounds took {timed:.2f} in this run: the drafter's "
                    f"passes were measured at another speed of the machine than the target's, and the width and "
                    f"gate decisions and predictions rest on them; {fix}")
    return None


def check_block_size(args) -> None:
    """--block-size against every drafter's block_size, from their config.json, before any model loads."""
    from decode.config import DecodeConfig
    from models.checkpoint import read_config_json
    from models.drafter_config import with_drafter_keys

    if args.block_size is not None:
        for folder in args.drafter or [drafter_path(args)]:
            config = with_drafter_keys(read_config_json(folder), drafter_keys(args, folder), f"{folder}/config.json")
            DecodeConfig(block_size=args.block_size).verify_block(config["block_size"])


def load_models_and_prompts(args):
    """(pair of the first drafter, prompts, [(drafter folder, model)], target path, prompt source).

    Every further --drafter is checked against the target (as load_pair checks the first) before any
    weights load; the target loads once.
    """
    from decode.prompts import check_context
    from models.drafter import load_drafter, validate_checkpoint
    from models.target import check_pair, load_tokenizer, target_config_of

    first, *others = args.drafter or [None]  # None: the demo drafter
    twice = [folder for folder in others if (args.drafter or []).count(folder) > 1]
    if twice:  # before anything loads or is measured
        raise ConfigError(f"drafter {twice[0]} is given twice; pass each drafter once")
    first_args = argparse.Namespace(**{**vars(args), "drafter": first})  # what the shared loaders read
    if others:
        target_path = model_paths(first_args)[1]
        target_config, target_tokenizer = target_config_of(target_path), load_tokenizer(target_path)
        for folder in others:
            check_pair(validate_checkpoint(folder, drafter_keys(args, folder)), target_config, load_tokenizer(folder),
                       target_tokenizer)
    pair, prompts, first_dir, target_path, source = load_pair_and_prompts(first_args, target_weights=True)
    drafters = [(first_dir, pair.drafter)]
    for folder in others:
        weight = next(pair.drafter.parameters())  # every drafter computes as the first does
        drafter = load_drafter(folder, weight.dtype, weight.device, drafter_keys(args, folder))
        positions = min(pair.max_positions, getattr(drafter.config, "max_position_embeddings", pair.max_positions))
        check_context(prompts, args.max_new_tokens, drafter.config.block_size, positions)
        drafters.append((folder, drafter))
    return pair, prompts, drafters, target_path, source


def load_assistant(path: str, pair):
    """The --assistant model on the target's device and dtype, checked against the target before it loads."""
    from models.target import check_assistant, load_target, load_tokenizer, target_config_of

    check_assistant(target_config_of(path), pair.target.config, load_tokenizer(path), pair.tokenizer)
    weight = next(pair.target.parameters())
    return load_target(path, weight.dtype, weight.device)


def recorded_outputs(path: str, prompts, decode) -> list[list[int]]:
    """The target's output ids per prompt under `decode`'s stop rule from a file of recorded outputs (one
    --save-outputs wrote, or another engine; prune.trajectories, the reader score, run and sweep share)."""
    from prune.trajectories import RecordedFile

    return RecordedFile.open(path, prompts).outputs_for([p.input_ids for p in prompts], decode)


def _save_outputs(path: str, prompts, outputs: dict, tokenizer) -> None:
    """One line per prompt and row: id, decoder, drafter (speculative rows only), prompt ids, output ids, text:
    its ar lines are a recorded file of the target's outputs (prune.trajectories; --ar-outputs)."""
    with output_file(path) as handle:
        for (drafter, decoder), results in outputs.items():
            for prompt, result in zip(prompts, results):
                line = {"id": prompt.id, "decoder": decoder, "prompt_ids": prompt.input_ids,
                        "output_ids": result.output_ids}
                if drafter is not None:
                    line["drafter"] = drafter
                if tokenizer is not None:
                    line["text"] = tokenizer.decode(result.output_ids, skip_special_tokens=False)
                handle.write(json.dumps(line) + "\n")


def print_table(report: dict) -> None:
    from rich.table import Table

    from decode.bench import report_rows
    from prune.text import number, plus_minus

    rows = report_rows(report)
    folder, names = _short_names([drafter for drafter, _, _ in rows if drafter is not None])
    table = Table(title=f"prune bench: {report['prompts']} prompts, verify={report['settings']['verify']}",
                  caption=f"drafters in {folder}" if folder else None)
    table.add_column("drafter", justify="left", overflow="fold")
    for column in ("decoder", "tau macro", "tau micro", "width", "ms/token", "speedup", "predicted", "limit",
                   "exact", "hit rate", "gated"):
        table.add_column(column, justify="right", no_wrap=column == "speedup")  # "1.09 +- 0.03" on one line
    for drafter, name, d in rows:
        table.add_row(
            names.get(drafter, "-"), name,
            number(d.get("tau_macro")), number(d.get("tau_micro")), number(d.get("verify_width_mean"), 1),
            number(d.get("time_per_token_ms")),
            number(d.get("speedup_vs_ar")) + plus_minus(d.get("speedup_error")),
            number(d.get("predicted_speedup")),
            number(d.get("speedup_limit")), _exactness(d, report["prompts"]), number(d.get("hit_rate")),
            number(d.get("gated_share")),
        )
    stdout_console().print(table)
    for line in against_lines(report, names):
        print(line)
    if any(d.get("gated_share") for _, _, d in rows):
        print("note: gated = the share of rounds the speculation gate ran as plain target steps; tau counts the "
              "drafting rounds only (--gate off drafts, and measures tau, on every round)", file=sys.stderr)
    dtype = report["settings"].get("dtype")
    if dtype not in (None, "float32") and any(d.get("exact_match_vs_ar") is False for _, _, d in rows):
        print(f"note: in {dtype} a wider pass can round a near-tie between two tokens differently from ar's "
              "one-token steps, so outputs may part; float32 (--dtype float32) is exact", file=sys.stderr)


def against_lines(report: dict, names: dict[str, str]) -> list[str]:
    """One line per decoder of every drafter after the first: its speed and tau as ratios to the first's,
    measured in this run (decode.bench.against)."""
    from prune.text import number

    if "drafters" not in report:
        return []
    first = report["drafters"][0]["drafter"]
    lines = []
    for entry in report["drafters"][1:]:
        for decoder, ratios in entry["against_first"].items():
            if ratios["speedup_ratio"] is None and ratios["tau_ratio"] is None:
                continue
            tau = f"{ratios['tau_ratio']:.1%}" if ratios["tau_ratio"] is not None else "-"
            lines.append(f"{names.get(entry['drafter'], entry['drafter'])} against {names.get(first, first)}, "
                         f"{decoder}: {number(ratios['speedup_ratio'], 2, 'x')} as fast at {tau} of its tau "
                         f"({number(ratios['equal_tau_speedup'], 2, 'x')} at equal tau)")
    return lines


def _exactness(row: dict, prompts: int) -> str:
    """A row's exactness against ar: yes, or NO with the prompts whose output equals ar's."""
    from prune.text import number

    same = row.get("exact_match_prompts")
    if row.get("exact_match_vs_ar") is False and same is not None:
        return f"NO ({same}/{prompts})"
    return number(row.get("exact_match_vs_ar"))


def _short_names(drafters: list[str]) -> tuple[str | None, dict[str, str]]:
    """The folder holding every drafter and each drafter's path relative to it: what tells them apart
    in a narrow column (the JSON keeps the paths as given)."""
    import os

    if not drafters:
        return None, {}
    folder = os.path.commonpath([os.path.dirname(os.path.abspath(d)) for d in drafters])
    if folder == os.path.dirname(folder):  # nothing shared but the root: the paths as given read better
        return None, {d: d for d in drafters}
    return folder, {d: os.path.relpath(os.path.abspath(d), folder) for d in drafters}

