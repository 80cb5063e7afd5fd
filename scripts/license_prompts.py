"""Prompts from a domain the suites and the demo distillation data do not cover: software licenses (legal text).

    python scripts/license_prompts.py OUT.jsonl [--count 30] [--seed 0]

Reads the license files that installed Python packages carry (`*.dist-info/**/LICENSE*`, COPYING*), keeps
distinct texts, cuts each into passages of about 700 characters on paragraph breaks, and writes `--count`
records `{"id", "prompt"}` that ask a plain-language question about one passage (what it allows, what it
requires, a summary). Which packages are installed decides the texts, so the file a run used is committed
beside its result rather than regenerated.
"""

import argparse
import hashlib
import json
import random
import re
import sys
from importlib import metadata
from pathlib import Path

QUESTIONS = (
    "Summarize the following license passage in plain words for a developer:\n\n{passage}",
    "Under the license passage below, what must someone who redistributes the software do?\n\n{passage}",
    "Explain what this part of a software license allows and what it forbids:\n\n{passage}",
    "A company wants to ship this software inside a paid product. What does this passage say about "
    "that?\n\n{passage}",
)
PASSAGE_CHARS = 700


def license_texts() -> list[tuple[str, str]]:
    """[(distribution name, license text)] of the installed distributions, one per distinct text, sorted."""
    seen, found = set(), []
    for dist in metadata.distributions():
        for file in dist.files or []:
            name = Path(str(file)).name.upper()
            if ".DIST-INFO" not in str(file).upper() or not name.startswith(("LICENSE", "LICENCE", "COPYING")):
                continue
            try:
                text = Path(dist.locate_file(file)).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            key = hashlib.sha256(re.sub(r"\s+", " ", text).strip().lower().encode()).hexdigest()
            if len(text) > 200 and key not in seen:
                seen.add(key)
                found.append((dist.metadata["Name"], text))
    return sorted(found)


def passages(text: str) -> list[str]:
    """Runs of whole paragraphs of about PASSAGE_CHARS characters."""
    out, current = [], ""
    for paragraph in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not paragraph:
            continue
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= PASSAGE_CHARS:
            out.append(current[: 2 * PASSAGE_CHARS])
            current = ""
    if len(current) >= PASSAGE_CHARS // 3:
        out.append(current)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", type=Path, help="JSONL file to write (must not exist)")
    parser.add_argument("--count", type=int, default=30, help="prompts")
    parser.add_argument("--seed", type=int, default=0, help="seeds which passages and questions are drawn")
    args = parser.parse_args(argv)
    if args.out.exists():
        sys.exit(f"{args.out} exists; choose a new file")
    pool = [(name, i, p) for name, text in license_texts() for i, p in enumerate(passages(text))]
    if len(pool) < args.count:
        sys.exit(f"only {len(pool)} license passages installed; ask for --count {len(pool)} or fewer")
    rng = random.Random(args.seed)
    chosen = rng.sample(pool, args.count)
    with open(args.out, "x") as f:
        for k, (name, i, passage) in enumerate(chosen):
            question = QUESTIONS[k % len(QUESTIONS)].format(passage=passage)
            # a package may carry several license files: the draw's position keeps the ids distinct
            f.write(json.dumps({"id": f"license-{k:02d}-{name}-{i}", "prompt": question}) + "\n")
    print(f"{args.out}: {args.count} prompts from {len({c[0] for c in chosen})} licenses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
