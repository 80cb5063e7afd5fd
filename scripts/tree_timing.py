"""Chains against draft trees on one machine: the demo pair decodes each prompt with ar, then with every
--branches setting (0 = chains), interleaved per prompt after a warm-up, all from one measurement of the pass
times, so the ratios share the machine's moment (docs/speed.md, Draft trees). Every output is checked
against ar's: in float32 (the default) a difference stops the script; in another dtype, where a wider pass
may round a near-tie differently, the prompts that differ are counted.

    .venv/bin/python scripts/tree_timing.py --suite humaneval:eval --limit 10 [--branches 0,1,2] [--gate off] \
        [--dtype bfloat16]

Prints, per setting: ms per token, speedup over ar (pooled over the prompts), tau over the drafting rounds
and the mean verify width. Run it on a quiet machine: it is a timing.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from anywhere

import torch  # noqa: E402

from decode.config import GATE_MODES, DecodeConfig  # noqa: E402
from decode.decoders import decode_ar, decode_speculative  # noqa: E402
from decode.prompts import select_records, tokenize_records  # noqa: E402
from decode.suites import load_suite  # noqa: E402
from decode.timing import measure_pass_times  # noqa: E402
from decode.verifiers import LiveVerifier  # noqa: E402
from models.demo import DEMO_DRAFTER_DIR, resolve_demo_target  # noqa: E402
from models.pair import load_pair  # noqa: E402
from models.precision import DTYPE_NAMES, resolve_dtype  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, help="a suite part, e.g. humaneval:eval")
    parser.add_argument("--limit", type=int, default=10, help="prompts (default: 10)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per decode (default: 128)")
    parser.add_argument("--branches", default="0,2", help="tree_branches settings, comma-separated (default: 0,2)")
    parser.add_argument("--decoder", choices=("sync", "async"), default="sync", help="(default: sync)")
    parser.add_argument("--gate", choices=GATE_MODES, default=GATE_MODES[0], help="(default: adaptive)")
    parser.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="float32",
                        help="the target's compute dtype, as prune's --dtype (default: float32, the exact mode)")
    args = parser.parse_args(argv)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    pair = load_pair(DEMO_DRAFTER_DIR, resolve_demo_target(), dtype)
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_ids=pair.stop_ids)
    prompts = tokenize_records(select_records(load_suite(args.suite), args.limit), pair.tokenizer)
    with torch.inference_mode():
        times = measure_pass_times(pair.target, pair.drafter, base)
        tuned = base.tuned_to(times, gate=args.gate == "adaptive")
        print(f"pass times {times}; {tuned.width_policy}")
        settings = {"ar": tuned, **{f"branches {k}": replace(tuned, tree_branches=int(k))
                                    for k in args.branches.split(",")}}

        def run(name, ids, config):
            if name == "ar":
                return decode_ar(pair.target, ids, config)
            return decode_speculative(args.decoder, pair.drafter, [LiveVerifier(pair.target)], [ids], config)[0]

        for name, config in settings.items():  # warm-up
            run(name, prompts[0].input_ids, replace(config, max_new_tokens=16))
        totals = {name: {"s": 0.0, "tokens": 0, "rounds": 0, "committed": 0, "width": 0, "differ": 0}
                  for name in settings}
        for prompt in prompts:
            reference = None
            for name, config in settings.items():
                result = run(name, prompt.input_ids, config)
                reference = reference or result.output_ids
                if result.output_ids != reference:
                    if dtype == torch.float32:
                        raise SystemExit(f"{name} differs from ar on {prompt.id}")
                    totals[name]["differ"] += 1
                drafting = [r for r in result.rounds if name == "ar" or r.drafted]
                total = totals[name]
                total["s"] += result.decode_s
                total["tokens"] += result.timed_tokens
                total["rounds"] += len(drafting)
                total["committed"] += sum(r.accepted + 1 for r in drafting)
                total["width"] += sum(r.width for r in drafting)
    ar_ms = 1000 * totals["ar"]["s"] / totals["ar"]["tokens"]
    for name, total in totals.items():
        ms = 1000 * total["s"] / total["tokens"]
        rounds = max(1, total["rounds"])
        print(f"{args.suite} {args.decoder} {name}: {ms:.1f} ms/token, {ar_ms / ms:.3f}x ar, tau "
              f"{total['committed'] / rounds:.2f}, width {total['width'] / rounds:.1f}, output equal to ar on "
              f"{len(prompts) - total['differ']} of {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
