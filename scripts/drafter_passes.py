"""Sync draft and packed pass times of several drafters, measured in turn in interleaved rounds.

    python scripts/drafter_passes.py D1 D2 ... [--rounds 5] [--packed-budget 64] [--json OUT]

Each round times every drafter's two passes (decode.timing.drafter_pass_ms: 7 repeats after a warm-up, the
median) in turn, so that a change in load hits every drafter alike; the table gives each drafter's median
over the rounds and its ratio to the first drafter's. For the head's share of a pass, compare a drafter with
its cut copy (prune vocab D OUT --size K): same layers, fewer head rows.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="drafter folders; ratios are against the first")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--packed-budget", type=int, default=None, help="packed pass tokens (default: the decoders')")
    parser.add_argument("--json", type=Path, default=None, help="write the times as JSON")
    args = parser.parse_args(argv)

    from decode.config import DecodeConfig
    from decode.timing import drafter_pass_ms
    from models.draft_vocab import head_rows
    from models.drafter import load_drafter

    budget = args.packed_budget or DecodeConfig().packed_budget
    models = {d: load_drafter(d) for d in args.drafters}
    times = {d: {"draft": [], "packed": []} for d in args.drafters}
    for _ in range(args.rounds):
        for name, model in models.items():
            draft, packed = drafter_pass_ms(model, budget)
            times[name]["draft"].append(draft)
            times[name]["packed"].append(packed)
    first = args.drafters[0]
    rows = []
    for name, model in models.items():
        row = {"drafter": name, "layers": model.config.num_hidden_layers, "head_rows": head_rows(model)}
        for kind in ("draft", "packed"):
            row[f"{kind}_ms"] = statistics.median(times[name][kind])
            row[f"{kind}_vs_first"] = row[f"{kind}_ms"] / statistics.median(times[first][kind])
        rows.append(row)
        print(f"{name}: {row['layers']} layers, {row['head_rows']} head rows; draft {row['draft_ms']:.2f} ms "
              f"({row['draft_vs_first']:.3f}x the first), packed {row['packed_ms']:.2f} ms "
              f"({row['packed_vs_first']:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps({"packed_budget": budget, "rounds": args.rounds, "rows": rows,
                                         "samples": times}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
