"""`prune generate`: reply to a prompt with a drafter, the text streamed to stdout as tokens are committed.

A thin layer over decode.generator.Generator: it loads the pair, takes the decoder settings of the shared
decoder flags (the adaptive width from the cached pass times, as `prune bench` decodes), and writes the
reply as plain text, or one JSON record per prompt with --json or --prompts. One line on stderr at the
end gives tokens, tokens/s (timed as `prune bench` times them), tau and the async hit rate.
"""

import json
import sys

from decode.config import GATE_MODES
from decode.registry import OURS, SPECULATIVE, TARGET, describe

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
    decode_config,
    model_paths,
    quiet_libraries,
    resolve_device,
    torch_dtype,
)

EXAMPLES = """
examples:
  prune generate --prompt "Write a Python function that reverses a string."      (the demo pair)
  prune generate --drafter pruned/final --target TARGET --prompt "Hello" --decoder sync
  prune generate --prompt "Tell me a story." --temperature 0.8 --seed 7
  prune generate --prompts prompts.jsonl --max-new-tokens 64 > replies.jsonl      (one JSON record per prompt)
"""


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "generate",
        help="reply to a prompt with a drafter, streamed as tokens are committed",
        description="Reply to a prompt with a drafter and its target: the text goes to stdout as the decoder "
        "commits tokens (the chat template applied as in prune bench), and one line on stderr at the end gives "
        "tokens, tokens/s, tau and the async hit rate. Greedy replies equal the target's own greedy reply."
        + EXAMPLES,
        common=("--prompt", "--prompts", "--drafter", "--target", "--device", "--max-new-tokens", "--temperature",
                "--json"),
    )
    parser.add_argument("--prompt", default=None, metavar="TEXT",
                        help="the prompt text (default: none; give --prompt or --prompts)")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl", type=_types.text_file,
                        help="JSONL prompts: records with prompt, messages or input_ids (optional id); writes one "
                        "JSON record per prompt (default: none; give --prompt or --prompts)")
    add_model_args(parser)
    parser.add_argument("--decoder", choices=OURS, default="async", help=describe(TARGET, SPECULATIVE))
    parser.add_argument("--max-new-tokens", type=_types.positive_int, default=DECODE["max_new_tokens"],
                        help="tokens generated per prompt at most")
    parser.add_argument("--temperature", type=_types.non_negative_float, default=DECODE["temperature"],
                        help="0 = greedy; > 0 = speculative sampling")
    parser.add_argument("--seed", type=_types.non_negative_int, default=DECODE["seed"],
                        help="sampling seed (a seed reproduces a reply)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed prompt text as is instead of through the tokenizer's chat template")
    parser.add_argument("--json", action="store_true",
                        help="write one JSON record per prompt (id, text, output_ids and the statistics) instead "
                        "of streaming text; always on with --prompts")
    add_decode_args(parser)
    add_gate_arg(parser, GATE_MODES[0])
    add_tree_arg(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from decode.generator import generation_stats

    records = prompt_records(args)  # before any model loads, so bad input fails at once
    generator = load_generator(args)
    prompts = [generator.prompt_ids(record, args.max_new_tokens) for record in records]
    as_json = args.json or args.prompts is not None
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    replies = []
    for record, ids in zip(records, prompts):
        if as_json:
            reply = generator.generate(ids, **options)
            line = {"id": record["id"], "decoder": args.decoder, "text": reply.text, "output_ids": reply.ids,
                    **reply.stats}
            sys.stdout.write(json.dumps(line) + "\n")
        else:
            reply = generator.generate(ids, on_text=_write, **options)
            _write("\n")
        replies.append(reply)
    stats = generation_stats([reply.result for reply in replies], generator.block_size)
    print(stats_line(args.decoder, stats, len(replies)), file=sys.stderr)
    return 0


def prompt_records(args) -> list[dict]:
    """The prompt records of --prompt or --prompts (ConfigError unless exactly one is given)."""
    from decode.prompts import check_record, read_prompt_file
    from models.errors import ConfigError

    if args.prompt is None and args.prompts is None:
        raise ConfigError("no prompt; pass --prompt TEXT or --prompts FILE.jsonl")
    if args.prompt is not None and args.prompts is not None:
        raise ConfigError("--prompt and --prompts were both given; pass one of them")
    if args.prompts is not None:
        return read_prompt_file(args.prompts)
    record = {"id": "0", "prompt": args.prompt}
    check_record(record, "--prompt")
    return [record]


def load_generator(args):
    """The Generator of the model flags, with the decoder settings of the shared decoder flags."""
    from decode.generator import Generator

    quiet_libraries()
    device = resolve_device(args.device)
    drafter_dir, target_path = model_paths(args)
    generator = Generator(drafter_dir, target_path, decoder=args.decoder, dtype=torch_dtype(args.dtype, device),
                          drafter_dtype=args.drafter_dtype, device=device, width="fixed",
                          chat_template=not args.no_chat_template, drafter_keys=drafter_keys(args, drafter_dir))
    if args.decoder != "ar":  # the width policy comes from the pass times, measured once per pair and cached
        generator.config = decode_config(args, generator.pair)[0]
    return generator


def stats_line(decoder: str, stats: dict, prompts: int) -> str:
    """One line: prompts (when several), tokens, tokens/s, tau, hit rate, the share of rounds the speculation
    gate ran as target steps ('-' where it does not apply)."""
    from prune.text import number

    head = f"{prompts} prompts, " if prompts > 1 else ""
    return (f"{decoder}: {head}{stats['tokens']} tokens, {number(stats['tokens_per_s'], 1)} tokens/s, "
            f"tau {number(stats['tau'], 2)}, hit rate {number(stats['hit_rate'], 2)}, "
            f"gated {number(stats.get('gated_share'), 2)}")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
