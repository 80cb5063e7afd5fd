"""Layer-selection criteria side by side: the layers each removes and the held-out tau its drafters keep.

    python scripts/criteria_compare.py OUT [--criteria tau,block-influence,angular,loss,last,random]
        [--depths 5,8] [--heal CRITERION ...] [--prescreen CRITERION:K ...] [--drafter D --target T] ...

For every variant (each criterion with heals off; each --heal criterion again with the default heal; the tau
criterion pre-screened by each --prescreen CRITERION:K), in this order:

  1. `prune score --no-cache` on the unpruned drafter with the variant's scoring flags: one scoring round
     whose wall time (the report's settings.wall_s) is the variant's scoring cost;
  2. `prune run --layers-to-remove MAX(depths) --per-step 1 --check-candidates 1 --no-vocab-steps` into
     OUT/runs/VARIANT: one layer per step and no head steps, so step-0D is the drafter with D layers removed
     (a run to 5 is the first five steps of the run to 8), each step the lowest of the criterion's ranking
     (no later candidate tried on the check prompts: the layers are the criterion's own choice);

then, per held-out suite (--suites, their eval parts), the target's float32 outputs recorded once
(`prune bench --decoder ar --save-outputs`) and one `prune bench --decoder async --verify replay
--width fixed --ar-outputs` (every block verified whole: tau is the drafters' acceptance alone, not the
width the cost model would pick) with the unpruned drafter and every variant's step at every depth. The
table (OUT/criteria.md, and the JSON record OUT/criteria.json it is a view of) gives per variant and depth
the original layers removed, the held-out tau retention per suite with its paired standard error over the prompts
(decode.metrics.paired_ratio_error: each drafter's per-prompt tau against the unpruned drafter's on the same
prompts), their mean, and the scoring round's wall time. Every stage is skipped when its output exists
(runs resume), so a killed comparison is continued by running the same command again; a bench is rerun when
its drafters change. Logs: OUT/logs/. Other `prune run` flags: --run-args "...".

At full size (six criteria, depths 5 and 8, 16 calibration prompts, 24 check prompts, the whole eval parts)
this takes hours on a CPU; at toy size (e.g. --depths 1 --limit 2 --max-new-tokens 16 --check-prompts 2
--check-tokens 16 --eval-limit 2 --eval-tokens 16) minutes.
"""

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CRITERIA = "tau,block-influence,angular,loss,last,random"
SUITES = "humaneval,champ,mtbench"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", help="output folder (runs, benches, logs, the table)")
    parser.add_argument("--criteria", default=CRITERIA, help="criteria run with heals off, comma-separated")
    parser.add_argument("--depths", default="5,8", help="layers removed at which drafters are compared")
    parser.add_argument("--heal", nargs="*", default=[], metavar="CRITERION",
                        help="criteria also run with prune run's default heal")
    parser.add_argument("--prescreen", nargs="*", default=[], metavar="CRITERION:K",
                        help="the tau criterion also run pre-screened by CRITERION keeping K layers")
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the demo drafter)")
    parser.add_argument("--target", default=None, help="target (default: the demo target)")
    parser.add_argument("--calib", default="humaneval:calib", help="calibration suite part or prompt FILE.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="calibration prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per calibration prompt")
    parser.add_argument("--check-prompts", type=int, default=None, help="prune run --check-prompts (default: its own)")
    parser.add_argument("--check-tokens", type=int, default=None, help="prune run --check-tokens (default: its own)")
    parser.add_argument("--min-retention", type=float, default=0.05,
                        help="prune run --min-retention: low, so that every variant reaches the deepest depth")
    parser.add_argument("--suites", default=SUITES,
                        help="held-out suites (their eval parts) or prompt FILE.jsonl, comma-separated")
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out prompts per suite (default: all)")
    parser.add_argument("--eval-tokens", type=int, default=128, help="tokens per held-out prompt")
    parser.add_argument("--loss-data", nargs="*", default=[], metavar="DIR",
                        help="held-in data of the loss criterion (prune score/run --loss-data; default: theirs)")
    parser.add_argument("--loss-examples", type=int, default=None,
                        help="held-in sequences of the loss criterion (prune score/run --loss-examples; default: "
                        "theirs)")
    parser.add_argument("--run-args", default="", help="more prune run flags, as one shell-quoted string")
    parser.add_argument("--prune", default=f"{shlex.quote(sys.executable)} -m prune", help="the prune command")
    return parser.parse_args(argv)


def variants(args) -> list[dict]:
    """[{name, criterion, heal, prescreen, flags}]: the scoring and healing flags of each variant."""
    found = [{"name": c, "criterion": c, "heal": False, "prescreen": None, "flags": ["--criterion", c]}
             for c in args.criteria.split(",") if c]
    found += [{"name": f"{c}+heal", "criterion": c, "heal": True, "prescreen": None, "flags": ["--criterion", c]}
              for c in args.heal]
    for spec in args.prescreen:
        criterion, _, keep = spec.partition(":")
        found.append({"name": f"tau-prescreen-{criterion}-{keep or 12}", "criterion": "tau", "heal": False,
                      "prescreen": [criterion, int(keep or 12)],
                      "flags": ["--criterion", "tau", "--prescreen", criterion, "--prescreen-keep", keep or "12"]})
    return found


def source_flags(spec: str) -> list[str]:
    """--suite or --prompts for a suite part or a prompt file."""
    return ["--prompts", spec] if spec.endswith(".jsonl") else ["--suite", spec]


def held_out(spec: str) -> tuple[str, str]:
    """(label, suite part or file) of a --suites entry: a suite's eval part, or a prompt file as given."""
    return (Path(spec).stem, spec) if spec.endswith(".jsonl") else (f"{spec}:eval", f"{spec}:eval")


class Stages:
    """Runs the comparison's commands, each logged to OUT/logs/NAME.log and skipped when its output exists."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.prune = shlex.split(args.prune)
        self.pair = [*(["--drafter", args.drafter] if args.drafter else []),
                     *(["--target", args.target] if args.target else [])]
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def call(self, name: str, argv: list[str]) -> float:
        """Run `prune ARGV` (its output to OUT/logs/NAME.log); returns its wall time in seconds."""
        print(f"== {name}: prune {shlex.join(argv)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        with open(self.out / "logs" / f"{name}.log", "a") as log:
            code = subprocess.call(self.prune + argv, stdout=log, stderr=subprocess.STDOUT)
        if code:
            sys.exit(f"prune {argv[0]} failed (exit {code}); see {self.out / 'logs' / (name + '.log')}")
        return time.monotonic() - started

    def calibration(self) -> list[str]:
        a = self.args
        return [*self.pair, *source_flags(a.calib), "--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens),
                *(["--loss-data", *a.loss_data] if a.loss_data else []),
                *(["--loss-examples", str(a.loss_examples)] if a.loss_examples else [])]

    def score(self, variant: dict) -> None:
        report = self.out / "scores" / f"{variant['name']}.json"
        if not report.exists():  # --no-cache: the round is computed, so its wall time is the criterion's cost
            self.call(f"score-{variant['name']}", ["score", *self.calibration(), *variant["flags"], "--no-cache",
                                                   "--no-wandb", "--json", str(report)])

    def run(self, variant: dict) -> None:
        a, folder = self.args, self.out / "runs" / variant["name"]
        if (folder.with_suffix(".json")).exists():
            return
        checks = [*(["--check-prompts", str(a.check_prompts)] if a.check_prompts is not None else []),
                  *(["--check-tokens", str(a.check_tokens)] if a.check_tokens is not None else [])]
        heal = [] if variant["heal"] else ["--heal-steps", "0"]
        # --run-args first: the variant's own flags (heals off, one layer a step, ...) come last and win
        wall = self.call(f"run-{variant['name']}", [
            "run", *self.calibration(), *shlex.split(a.run_args), *variant["flags"], *heal, *checks,
            "--out", str(folder), "--resume", "--layers-to-remove", str(max(depths(a))), "--per-step", "1",
            "--check-candidates", "1", "--no-vocab-steps", "--no-stop-on-speedup",
            "--min-retention", str(a.min_retention),
            "--speed-prompts", "0", "--no-wandb", "--json", str(folder.with_suffix(".json"))])
        (self.out / "runs" / f"{variant['name']}.wall.json").write_text(json.dumps({"wall_s": wall}) + "\n")

    def bench(self, label: str, spec: str, drafters: list[str]) -> None:
        a = self.args
        prompts = [*source_flags(spec), *(["--limit", str(a.eval_limit)] if a.eval_limit else []),
                   "--max-new-tokens", str(a.eval_tokens)]
        ar = self.out / f"ar-{label}.jsonl"
        if not ar.exists():
            self.call(f"ar-{label}", ["bench", *self.pair, *prompts,
                                      "--decoder", "ar", "--dtype", "float32", "--save-outputs", str(ar)])
        report = self.out / f"bench-{label}.json"
        if report.exists() and bench_drafters(json.loads(report.read_text())) == drafters:
            return
        target = ["--target", a.target] if a.target else []
        self.call(f"bench-{label}", ["bench", *target, *prompts, "--decoder", "async", "--verify", "replay",
                                     "--replay-batch", "16", "--width", "fixed", "--ar-outputs", str(ar),
                                     *[flag for d in drafters for flag in ("--drafter", d)], "--json", str(report)])


def depths(args) -> list[int]:
    return [int(d) for d in args.depths.split(",")]


def bench_drafters(report: dict) -> list[str]:
    """The drafter folders of a bench report, in its order (either layout, decode.bench)."""
    if "drafters" in report:
        return [entry["drafter"] for entry in report["drafters"]]
    return [report["settings"]["drafter"]]


def async_rows(report: dict) -> dict:
    """{drafter folder: its async summary} of a bench report."""
    if "drafters" in report:
        return {entry["drafter"]: entry["decoders"]["async"] for entry in report["drafters"]}
    return {report["settings"]["drafter"]: report["decoders"]["async"]}


def step_folder(out: Path, variant: dict, depth: int) -> Path | None:
    """The exported drafter of `variant` with `depth` layers removed (one per step), or None if the run
    stopped before it."""
    state = json.loads((out / "runs" / f"{variant['name']}.json").read_text())
    if len(state["history"]) < depth:
        return None
    return out / "runs" / variant["name"] / state["history"][depth - 1]["folder"]


def retention(rows: dict, drafter: str, base: str) -> dict | None:
    """Held-out retention of `drafter` against `base` (mean per-prompt tau ratio) and its paired standard error."""
    from decode.metrics import paired_ratio_error

    mine, theirs = rows[drafter]["tau_per_prompt"], rows[base]["tau_per_prompt"]
    if len(mine) != len(theirs) or not theirs:
        return None  # a prompt without a drafting round: the per-prompt lists no longer pair
    value = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs))
    return {"value": value, "se": paired_ratio_error(mine, theirs), "prompts": len(mine)}


def record(args, found: list[dict], base: str, suites: list[tuple[str, str]]) -> dict:
    """The comparison's JSON record: settings, host, and one row per variant and depth."""
    import torch

    from models.precision import cpu_name

    out = Path(args.out)
    benches = {label: async_rows(json.loads((out / f"bench-{label}.json").read_text())) for label, _ in suites}
    rows = []
    for variant in found:
        state = json.loads((out / "runs" / f"{variant['name']}.json").read_text())
        score = json.loads((out / "scores" / f"{variant['name']}.json").read_text())
        wall = out / "runs" / f"{variant['name']}.wall.json"
        for depth in depths(args):
            folder = step_folder(out, variant, depth)
            kept = {label: retention(benches[label], str(folder), base) if folder else None for label, _ in suites}
            rows.append({**{k: variant[k] for k in ("name", "criterion", "heal", "prescreen")}, "removed": depth,
                         "drafter": str(folder) if folder else None,
                         "layers": [i for h in state["history"][:depth] for i in h["removed_original"]],
                         "retention": kept, "scoring_wall_s": score["settings"].get("wall_s"),
                         "skipped_in_first_round": sum(bool(s.get("skipped")) for s in score["layers"]),
                         "run_wall_s": json.loads(wall.read_text())["wall_s"] if wall.exists() else None})
    return {"command": ["python", "scripts/criteria_compare.py", *sys.argv[1:]],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpu": cpu_name(), "machine": platform.machine(), "python": platform.python_version(),
                     "torch": torch.__version__},
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "prune")},
            "base": {"drafter": base, **{label: benches[label][base]["tau_macro"] for label, _ in suites}},
            "rows": rows}


def markdown(document: dict) -> str:
    """The table of a comparison record."""
    base = document["base"]
    suites = [key for key in base if key != "drafter"]
    taus = ", ".join(f"{s} tau {base[s]:.3f}" for s in suites)
    lines = [f"Held-out tau retention (paired standard error over prompts) against the unpruned drafter ({taus}); "
             "scoring: one round on the unpruned drafter, wall time.", "",
             "| criterion | removed | original layers removed | " + " | ".join(suites) + " | mean | scoring (s) |",
             "|---|---|---|" + "---|" * (len(suites) + 2)]

    def cell(kept) -> str:
        return "-" if kept is None else f"{kept['value']:.1%} ± {kept['se']:.1%}"

    for row in sorted(document["rows"], key=lambda r: (r["removed"], r["name"])):
        kept = [row["retention"][s] for s in suites]
        known = [k for k in kept if k is not None]
        mean = None if not known or len(known) < len(kept) else {
            "value": sum(k["value"] for k in known) / len(known),
            "se": sum(k["se"] ** 2 for k in known) ** 0.5 / len(known)}  # the suites' prompts are independent
        wall = row["scoring_wall_s"]
        lines.append(f"| {row['name']} | {row['removed']} | {', '.join(map(str, row['layers']))} | "
                     + " | ".join(cell(k) for k in kept) + f" | {cell(mean)} | "
                     + ("-" if wall is None else f"{wall:.1f}") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    found = variants(args)
    stages = Stages(args)
    for variant in found:
        stages.score(variant)
        stages.run(variant)
    from models.demo import demo_drafter_dir

    base = args.drafter or str(demo_drafter_dir())
    drafters = [base] + [str(folder) for variant in found for depth in depths(args)
                         if (folder := step_folder(out, variant, depth)) is not None]
    suites = [held_out(spec) for spec in args.suites.split(",") if spec]
    for label, spec in suites:
        stages.bench(label, spec, drafters)
    document = record(args, found, base, suites)
    (out / "criteria.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    (out / "criteria.md").write_text(markdown(document))
    print(markdown(document))


if __name__ == "__main__":
    main()
