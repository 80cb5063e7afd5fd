"""Write docs/results.md, and the result tables of README.md and docs/speed.md, from the records in docs/results/.

    python scripts/results_page.py           # regenerate the page and the two tables
    python scripts/results_page.py --check   # exit 1 if any of them differs from its records

A record is one JSON file, `docs/results/NAME.json`: one measurement, made on one day on one host by
the commands it names, with its numbers as a table:

    {"title": "...", "section": "speed", "date": "2026-12-04", "host": "2 AMD EPYC cores, ...",
     "command": ["prune bench ..."], "setup": "...", "columns": ["decoder", "speedup"],
     "rows": [["sync", [1.32, 0.11]]], "notes": "...",
     "headline": {"what": "...", "result": "sync {speedup}", "row": 0}, "views": ["speed"]}

`section` is a key of SECTIONS; `setup`, `notes`, `headline` and `views` are optional. A cell is a number,
a string, null ("-") or a [value, standard error] pair; numbers print as written in the file. A headline
makes one row of the README's table; its `{column}` fields are cells of its `row` (`{2:column}`: of row 2). `views: ["speed"]` also puts the table in docs/speed.md.
Every other page shows measurements only through these records, so a number is written once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file, the script still finds the project's packages
from models.checkpoint import atomic_write_text  # noqa: E402 - after the path it needs

RECORDS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
SPEED = ROOT / "docs" / "speed.md"

# section key -> heading, in page order
SECTIONS = {
    "speed": "Speed on hosts",
    "decoders": "Decoders: the gate, trees, the fast path",
    "drafter": "The demo drafter",
    "pruning": "Pruning",
    "healing": "Healing",
    "memory": "Real-size drafters",
}
REQUIRED = ("title", "section", "date", "host", "command", "columns", "rows")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}$")
FIELD = re.compile(r"\{(?:(\d+):)?([^{}:]+)\}")  # {column} of the headline's row, or {row:column}


class RecordError(ValueError):
    """A record that the page cannot be made from; the message names the file and the key."""


def load_records(folder: Path = RECORDS) -> list[dict]:
    """Every `*.json` record under `folder`, checked, in page order (section, then newest first, then file name)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(), parse_float=Decimal)  # keeps '0.70' as written
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path.name}: not valid JSON ({exc})") from exc
        check_record(record, path.name)
        records.append({**record, "name": path.stem})
    titles = [r["title"] for r in records]
    for title in titles:
        if titles.count(title) > 1:
            raise RecordError(f"two records share the title {title!r}; titles are the page's anchors")
    order = list(SECTIONS)
    records.sort(key=lambda r: r["date"], reverse=True)  # newest first within a section (sorts are stable)
    return sorted(records, key=lambda r: order.index(r["section"]))


def check_record(record: dict, name: str) -> None:
    """Raise RecordError naming `name` and the key when `record` lacks a field or holds a malformed one."""
    if not isinstance(record, dict):
        raise RecordError(f"{name}: a record is a JSON object")
    for key in REQUIRED:
        if record.get(key) in (None, "", []):
            raise RecordError(f"{name}: '{key}' is missing or empty; every record has {', '.join(REQUIRED)}")
    if record["section"] not in SECTIONS:
        raise RecordError(f"{name}: 'section' is {record['section']!r}; use one of {', '.join(SECTIONS)}")
    if not DATE.match(str(record["date"])):
        raise RecordError(f"{name}: 'date' is {record['date']!r}; write it as YYYY-MM-DD")
    commands = record["command"]
    if not isinstance(commands, list) or not all(isinstance(c, str) and c.strip() for c in commands):
        raise RecordError(f"{name}: 'command' is a list of the exact commands that produced the numbers")
    width = len(record["columns"])
    for i, row in enumerate(record["rows"]):
        if not isinstance(row, list) or len(row) != width:
            raise RecordError(f"{name}: row {i} has {len(row) if isinstance(row, list) else '?'} cells, "
                              f"'columns' has {width}")
    headline = record.get("headline")
    if headline is not None:
        if not {"what", "result"} <= set(headline):
            raise RecordError(f"{name}: 'headline' needs 'what' and 'result'")
        for row, column in FIELD.findall(headline["result"]):
            if column not in record["columns"]:
                raise RecordError(f"{name}: headline field {{{column}}} is not a column")
            if not 0 <= int(row or headline.get("row", 0)) < len(record["rows"]):
                raise RecordError(f"{name}: headline row {row or headline.get('row', 0)} is outside the table")


def cell(value) -> str:
    """One table cell: a number as written, null as '-', [value, se] as 'value +- se'."""
    if value is None:
        return "-"
    if isinstance(value, list) and len(value) == 2:
        return f"{cell(value[0])} +- {cell(value[1])}"
    return str(value)


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def table(record: dict) -> list[str]:
    lines = ["| " + " | ".join(record["columns"]) + " |", "|" + "---|" * len(record["columns"])]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in record["rows"]]


def render_page(records: list[dict]) -> str:
    """The whole of docs/results.md."""
    lines = [
        "# Results",
        "",
        "Every measurement the docs rely on, one record each: when, on what host, by which exact commands.",
        "This page is generated from the JSON records in [docs/results/](results/) by",
        "`python scripts/results_page.py` (which also writes the tables in README.md and docs/speed.md);",
        "edit a record or add one, run the script, and commit both. `tests/test_results_page.py` checks that",
        "the page matches its records. Retention is pruned tau / unpruned tau on the same prompts, +- its",
        "paired standard error over the prompts; a speedup is against the target alone (`ar`) in the same run.",
        "",
    ]
    for key, heading in SECTIONS.items():
        chosen = [r for r in records if r["section"] == key]
        if chosen:
            lines.append(f"- [{heading}](#{anchor(heading)}): "
                         + ", ".join(f"[{r['title']}](#{anchor(r['title'])})" for r in chosen))
    for key, heading in SECTIONS.items():
        chosen = [r for r in records if r["section"] == key]
        if not chosen:
            continue
        lines += ["", f"## {heading}"]
        for record in chosen:
            lines += ["", f"### {record['title']}", "", f"{record['date']}, {record['host']}."]
            if record.get("setup"):
                lines += ["", record["setup"]]
            lines += ["", "```", *record["command"], "```", "", *table(record)]
            if record.get("notes"):
                lines += ["", record["notes"]]
            lines += ["", f"Record: [`docs/results/{record['name']}.json`](results/{record['name']}.json)"]
    return "\n".join(lines) + "\n"


def headline_cell(record: dict, match: re.Match, default_row: int) -> str:
    """The cell that a headline field `{column}` or `{row:column}` names."""
    row = record["rows"][int(match.group(1) or default_row)]
    return cell(row[record["columns"].index(match.group(2))])


def render_headline(records: list[dict]) -> str:
    """The README's one table of current results: a row per record with a headline."""
    lines = ["| what | result | host |", "|---|---|---|"]
    for record in records:
        headline = record.get("headline")
        if headline is None:
            continue
        result = FIELD.sub(lambda m: headline_cell(record, m, headline.get("row", 0)), headline["result"])
        link = f"[{headline['what']}](docs/results.md#{anchor(record['title'])})"
        lines.append(f"| {link} | {result} | {record['host']} |")
    return "\n".join(lines)


def render_view(records: list[dict], view: str, link_prefix: str) -> str:
    """The tables of the records that name `view`, each under its title and a link to its record."""
    blocks = []
    for record in records:
        if view in record.get("views", []):
            title = f"[{record['title']}]({link_prefix}#{anchor(record['title'])}) ({record['host']})"
            blocks.append("\n".join([title, "", *table(record)]))
    return "\n\n".join(blocks)


def splice(text: str, name: str, block: str, where: str) -> str:
    """`text` with the lines between `<!-- results:NAME -->` and `<!-- /results:NAME -->` replaced by `block`."""
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise RecordError(f"{where}: needs exactly one '{start}' ... '{end}' pair around its generated table")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{block}\n{end}{tail}"


def generated(records: list[dict], readme: str, speed: str) -> dict[Path, str]:
    """What each generated file should hold, given the current README and speed.md texts."""
    return {
        PAGE: render_page(records),
        README: splice(readme, "headline", render_headline(records), "README.md"),
        SPEED: splice(speed, "speed", render_view(records, "speed", "results.md"), "docs/speed.md"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    try:
        records = load_records()
        wanted = generated(records, README.read_text(), SPEED.read_text())
    except RecordError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    for path in stale:
        if args.check:
            print(f"{os.path.relpath(path, ROOT)} differs from its records; run python scripts/results_page.py",
                  file=sys.stderr)
        else:
            atomic_write_text(path, wanted[path])
            print(f"wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
