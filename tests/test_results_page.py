"""docs/results.md and the result tables of README.md and docs/speed.md are generated from docs/results/*.json."""

import json

import pytest

from scripts import results_page
from scripts.results_page import RecordError

GOOD = {
    "title": "A bench", "section": "speed", "date": "2026-12-04", "host": "2 cores",
    "command": ["prune bench --suite humaneval:eval"], "columns": ["decoder", "speedup"],
    "rows": [["sync", [1.30, 0.10]], ["async", 0.70]],
    "headline": {"what": "Bench", "result": "sync {speedup}, async {1:speedup}"}, "views": ["speed"],
}


def write(folder, name, record, rows_json=None):
    """Write `record` as a JSON file; `rows_json` spells its rows as a person would (trailing zeros kept)."""
    text = json.dumps(record)
    if rows_json is not None:
        text = text.replace(json.dumps(record["rows"]), rows_json)
    (folder / f"{name}.json").write_text(text)


def test_committed_pages_equal_what_the_script_generates():
    records = results_page.load_records()
    wanted = results_page.generated(records, results_page.README.read_text(), results_page.SPEED.read_text())
    for path, text in wanted.items():
        assert path.read_text() == text, f"{path.name} is stale: run python scripts/results_page.py"
    assert results_page.main(["--check"]) == 0


def test_every_committed_record_says_when_where_and_how():
    records = results_page.load_records()
    assert len(records) >= 10
    for record in records:
        assert results_page.DATE.match(record["date"]), record["name"]
        assert record["host"].strip(), record["name"]
        assert record["command"] and all(c.strip() for c in record["command"]), record["name"]
    assert sum("headline" in r for r in records) >= 1  # the README's table is not empty
    assert any("speed" in r.get("views", []) for r in records)


def test_a_record_renders_into_the_page_the_headline_and_the_view(tmp_path):
    write(tmp_path, "bench", GOOD, rows_json='[["sync", [1.30, 0.10]], ["async", 0.70]]')
    records = results_page.load_records(tmp_path)
    page = results_page.render_page(records)
    assert "### A bench" in page and "2026-12-04, 2 cores." in page
    assert "prune bench --suite humaneval:eval" in page
    assert "| sync | 1.30 +- 0.10 |" in page  # numbers print as written, trailing zeros kept
    assert "| async | 0.70 |" in page
    headline = results_page.render_headline(records)
    assert "sync 1.30 +- 0.10, async 0.70" in headline
    assert "(docs/results.md#a-bench)" in headline
    assert "| sync | 1.30 +- 0.10 |" in results_page.render_view(records, "speed", "results.md")
    assert results_page.render_view(records, "other", "results.md") == ""


@pytest.mark.parametrize("change, message", [
    ({"date": None}, "'date' is missing"),
    ({"host": ""}, "'host' is missing"),
    ({"command": []}, "'command' is missing"),
    ({"command": "prune bench"}, "'command' is a list"),
    ({"date": "4 Dec 2026"}, "YYYY-MM-DD"),
    ({"section": "misc"}, "'section' is 'misc'"),
    ({"rows": [["sync"]]}, "row 0 has 1 cells"),
    ({"headline": {"what": "x", "result": "{tau}"}}, "{tau} is not a column"),
    ({"headline": {"what": "x", "result": "{5:speedup}"}}, "row 5 is outside"),
])
def test_a_malformed_record_is_refused_naming_the_file_and_the_key(tmp_path, change, message):
    write(tmp_path, "bad", {**GOOD, **change})
    with pytest.raises(RecordError, match="bad.json") as error:
        results_page.load_records(tmp_path)
    assert message in str(error.value)


def test_titles_are_unique_anchors(tmp_path):
    write(tmp_path, "one", GOOD)
    write(tmp_path, "two", GOOD)
    with pytest.raises(RecordError, match="share the title"):
        results_page.load_records(tmp_path)


def test_splice_replaces_only_the_marked_block_and_needs_its_markers():
    text = "a\n<!-- results:x -->\nold\n<!-- /results:x -->\nb\n"
    assert results_page.splice(text, "x", "new", "f") == "a\n<!-- results:x -->\nnew\n<!-- /results:x -->\nb\n"
    with pytest.raises(RecordError, match="f: needs exactly one"):
        results_page.splice("no markers", "x", "new", "f")


def test_check_reports_a_stale_page_without_writing_it(tmp_path, monkeypatch, capsys):
    page = tmp_path / "results.md"
    page.write_text("stale\n")
    monkeypatch.setattr(results_page, "PAGE", page)
    assert results_page.main(["--check"]) == 1
    assert page.read_text() == "stale\n"
    assert "differs from its records" in capsys.readouterr().err
