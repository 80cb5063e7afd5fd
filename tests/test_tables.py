"""The extension tables: decoders, scoring criteria, storage schemes, and the verifier protocol."""

import pytest

from _pairs import prompt_ids, tiny_target, trained_drafter
from decode import registry
from decode.decoders import DECODERS, DecodeConfig
from decode.verifiers import LiveVerifier, ReplayVerifier, Verifier
from models.errors import ConfigError
from prune.config import ScoreConfig
from prune.criteria import CRITERIA, Criterion
from prune.scoring import record_trajectories, score_layers
from sweeps.storages import OTHER, SCHEMES, examples, scheme_of


def test_every_decoder_of_the_table_has_its_function():
    assert tuple(registry.DECODERS) == ("ar", "sync", "async", "pld", "generate", "assisted")  # report order
    assert DECODERS == registry.OURS == ("ar", "sync", "async")
    for decoder in registry.DECODERS.values():
        assert decoder.kind in (registry.TARGET, registry.SPECULATIVE, registry.BASELINE) and decoder.help
        assert callable(decoder.function)
    assert [name for name, d in registry.DECODERS.items() if d.needs_assistant] == [registry.ASSISTED]


def test_live_and_replayed_verifiers_follow_the_protocol():
    target = tiny_target()
    prompt = prompt_ids(6)
    trajectory = record_trajectories(target, [prompt], DecodeConfig(max_new_tokens=8))[0]
    for verifier in (LiveVerifier(target), ReplayVerifier(trajectory)):
        assert isinstance(verifier, Verifier)
        assert verifier.prefill(prompt).tokens == [trajectory[len(prompt)]]


def test_a_criterion_is_one_entry_and_its_function(monkeypatch):
    """What docs/design.md shows: a table entry and a function make a criterion that scoring uses."""
    target, drafter = trained_drafter(num_layers=2)
    prompts = [prompt_ids(n, seed=n) for n in (3, 7)]
    decode = DecodeConfig(max_new_tokens=16, packed_budget=27)

    def fallback_rise(effect) -> float:
        return effect.base.fallback_rate - effect.without.fallback_rate

    with pytest.raises(ConfigError, match="choose tau, speedup, expected-tau, block-influence, angular, loss, last or "
                       "random"):
        ScoreConfig(criterion="fallback").validate()
    monkeypatch.setitem(CRITERIA, "fallback", Criterion("fallback", "rise in fallback drafts", fallback_rise))
    report = score_layers(drafter, prompts, ScoreConfig(criterion="fallback", decode=decode, timing_repeats=1),
                          trajectories=record_trajectories(target, prompts, decode))
    for score in report.layers:
        assert score.score == pytest.approx(report.base.fallback_rate - score.fallback_rate)


@pytest.mark.parametrize("given, scheme", [
    ("sqlite:///tmp/study.db", "sqlite"), ("study.db", "sqlite"), ("runs/study.sqlite3", "sqlite"),
    ("journal:/shared/s.log", "journal"), ("/shared/s.log", "journal"), ("s.journal", "journal"),
    ("postgresql://u:p@host/db", "postgresql"), ("postgres://u:p@host/db", "postgresql"),
    ("mysql+pymysql://u:p@host/db", "mysql"), ("oracle://u:p@host/db", OTHER.name),
])
def test_storage_urls_find_their_scheme(given, scheme):
    assert scheme_of(given).name == scheme


def test_storage_schemes_name_their_forms():
    assert examples() == "sqlite:///FILE, postgresql://..., mysql+pymysql://..., journal:FILE"
    assert scheme_of("postgres://h/db").url("postgres://h/db") == "postgresql://h/db"
    assert {s.name for s in SCHEMES} == {"sqlite", "postgresql", "mysql", "journal"}
    with pytest.raises(ConfigError, match="neither a URL"):
        scheme_of("study.txt")
