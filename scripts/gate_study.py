"""The evidence behind decode.gate's defaults: every gate setting's modelled speedup on recorded decodes.

For each prompt the target decodes greedily once (its trajectory T); then the drafter drafts after every
prefix T[:p + 1] (one sync draft per position), so the outcome of a drafting round at any position is known:
its verify width (the adaptive width policy on the draft's confidences) and how many drafts T accepts. A
gate setting is then simulated exactly with decode.gate.Gate itself, position by position: a drafting round
costs `WidthPolicy.round_cost(W)` one-token steps and commits a + 1 tokens, a gated step costs 1 and commits
1. Also reported: no gate, and the oracle that knows every round's outcome in advance (the best any gate
could do with these drafts). Costs come from the pass times measured here (decode.timing), so the table is
of this machine, or from `--pass-times` (a JSON record as `prune bench` reports them in settings.pass_times).

    .venv/bin/python scripts/gate_study.py --suite humaneval:calib --suite mtbench:calib --suite champ:calib \
        --limit 16 [--grid] [--pass-times '{"ar_ms": 46, ...}'] [--json study.json]

Choose settings on calibration parts; an evaluation part read here stops being held out.
"""

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from anywhere

import torch  # noqa: E402

from decode.config import DecodeConfig  # noqa: E402
from decode.decoders import decode_ar  # noqa: E402
from decode.engine import DraftEngine, DraftRequest  # noqa: E402
from decode.gate import GatePolicy  # noqa: E402
from decode.prompts import select_records, tokenize_records  # noqa: E402
from decode.suites import load_suite  # noqa: E402
from decode.timing import measure_pass_times  # noqa: E402
from decode.tree import greedy_path, grow  # noqa: E402
from decode.verifiers import ReplayVerifier  # noqa: E402
from decode.cost import PassTimes, WidthPolicy  # noqa: E402
from models.demo import DEMO_DRAFTER_DIR, resolve_demo_target  # noqa: E402
from models.masks import BlockSpec  # noqa: E402
from models.pair import load_pair  # noqa: E402

GRID = {"smoothing": (0.35, 0.5, 0.65), "first_wait": (4, 8, 12), "max_wait": (16, 32, 64),
        "threshold": (0.8, 0.9, 1.0)}


def record(pair, prompt_ids: list[int], config: DecodeConfig, block: int) -> list[tuple[int, int]]:
    """(a, W) of a drafting round at each position p of the prompt's greedy decode, p from the first output
    token on: W the tokens the round verifies (the width policy's chain, or a draft tree where
    `config.tree_branches` > 0), a the drafts that the trajectory accepts."""
    output = decode_ar(pair.target, prompt_ids, config).output_ids
    trajectory = prompt_ids + output
    engine = DraftEngine(pair.drafter, rows=1)
    rounds = []
    for position in range(len(prompt_ids), len(trajectory) - 1):
        request = DraftRequest(trajectory[engine.cache_lens[0] : position + 1], [BlockSpec(position)])
        prediction = engine.forward([request])[0][0]
        engine.keep([len(request.chain)])
        slots = min(block, len(trajectory) - position) - 1  # nothing to verify past the end
        tree = grow(trajectory[position], prediction.tokens[:slots], prediction.probs[:slots],
                    prediction.alternatives[:slots], config.tree_branches, slots, config.width_policy)
        # the target's answers are the trajectory's (a replay of it, from this position on)
        replay = ReplayVerifier(trajectory)
        replay.length = position
        answers = replay.verify(tree.tokens, None if tree.is_chain else tree.parents).tokens
        path, _ = greedy_path(tree.tokens, tree.parents, answers)
        rounds.append((len(path), len(tree.tokens)))
    return rounds


def simulate(rounds: list[tuple[int, int]], cost_of: WidthPolicy, policy: GatePolicy | None) -> tuple[int, float]:
    """(tokens, cost in one-token steps, a drafting round priced by `cost_of`) of decoding past every recorded
    position under `policy` (None: no gate)."""
    gate = policy.gate() if policy is not None else None
    position, tokens, cost = 0, 0, 0.0
    while position < len(rounds):
        if gate is None or gate.drafting:
            accepted, width = rounds[position]
            committed = min(accepted + 1, len(rounds) - position)
            cost += cost_of.round_cost(width)
            if gate is not None:
                gate.observe(committed, width)
        else:
            committed = 1
            cost += 1.0
            gate.observe(1, None)
        tokens += committed
        position += committed
    return tokens, cost


def oracle(rounds: list[tuple[int, int]], cost_of: WidthPolicy) -> tuple[int, float]:
    """The least cost over every choice of drafting or stepping at each position (dynamic programming)."""
    best = [0.0] * (len(rounds) + 1)
    for position in range(len(rounds) - 1, -1, -1):
        accepted, width = rounds[position]
        after = min(len(rounds), position + accepted + 1)
        best[position] = min(1.0 + best[position + 1], cost_of.round_cost(width) + best[after])
    return len(rounds), best[0]


def speedup(traces: list[list[tuple[int, int]]], run) -> float:
    results = [run(rounds) for rounds in traces]
    return sum(t for t, _ in results) / sum(c for _, c in results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="append", required=True, help="a suite part, e.g. humaneval:calib")
    parser.add_argument("--limit", type=int, default=16, help="prompts per suite part (default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per decode (default: 128)")
    parser.add_argument("--grid", action="store_true", help="also simulate every setting of GRID")
    parser.add_argument("--pass-times", default=None, type=json.loads,
                        help="pass times as JSON (decode.cost.PassTimes fields) instead of measuring them")
    parser.add_argument("--tree-branches", type=int, default=0,
                        help="record draft trees of up to K next-best ids per slot (decode/tree.py; default: 0, chains)")
    parser.add_argument("--json", default=None, help="write the recorded rounds and results here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    pair = load_pair(DEMO_DRAFTER_DIR, resolve_demo_target())
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_ids=pair.stop_ids, tree_branches=args.tree_branches)
    with torch.inference_mode():
        times = PassTimes(**args.pass_times) if args.pass_times else measure_pass_times(pair.target, pair.drafter, base)
        config = base.tuned_to(times, gate=True)
        default = config.gate_policy
        print(f"pass times {times}; a drafting round costs {default.cost.round_cost(4):.2f} steps at width 4")
        block = pair.drafter.config.block_size
        traces = {}
        for spec in args.suite:
            prompts = tokenize_records(select_records(load_suite(spec), args.limit), pair.tokenizer)
            traces[spec] = [record(pair, p.input_ids, config, block) for p in prompts]
    cost_of = default.cost
    results = {}
    for spec, suite_traces in traces.items():
        row = {"no gate": speedup(suite_traces, lambda r: simulate(r, cost_of, None)),
               "default": speedup(suite_traces, lambda r: simulate(r, cost_of, default)),
               "oracle": speedup(suite_traces, lambda r: oracle(r, cost_of))}
        if args.grid:
            for values in itertools.product(*GRID.values()):
                setting = replace(default, **dict(zip(GRID, values)))
                row[json.dumps(dict(zip(GRID, values)))] = speedup(suite_traces,
                                                                   lambda r: simulate(r, cost_of, setting))
        results[spec] = row
        print(f"{spec}: no gate {row['no gate']:.3f}, default {row['default']:.3f}, oracle {row['oracle']:.3f}")
    if args.grid:
        settings = [key for key in next(iter(results.values())) if key.startswith("{")]
        ranked = sorted(settings, key=lambda key: -sum(row[key] for row in results.values()))
        for key in ranked[:5]:
            print("  ".join(f"{results[spec][key]:.3f}" for spec in results), key)
    if args.json:
        Path(args.json).write_text(json.dumps({"pass_times": times.to_dict(), "results": results,
                                               "rounds": traces}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
