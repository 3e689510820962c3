"""Every training setting acts or is refused: no key of ``TrainConfig`` may be accepted and then ignored.

A key is "read" when product code (any top-level package but tests, docs, bench, examples and third_party)
names it as an attribute or a string, outside the dataclass line that declares it and outside the range
checks (``train/config_checks.py`` reads every key only to validate it). A key that is validated but never
used, as ``indexer_replay`` was until 2026-12-02 (accepted, recorded in the run's config, and ignored),
fails here."""

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_PRODUCT = {"tests", "docs", "bench", "examples", "third_party"}


def _product_sources():
    for d in sorted(ROOT.iterdir()):
        if d.is_dir() and d.name not in NOT_PRODUCT and not d.name.startswith((".", "bazel-")):
            for f in sorted(d.rglob("*.py")):
                if f.name != "config_checks.py":
                    yield f, f.read_text(encoding="utf-8")


def _reads(name: str, sources) -> list:
    use = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
    decl = re.compile(rf"^\s*{name}\s*:")
    return [str(f.relative_to(ROOT)) for f, text in sources
            if any(use.search(line) and not decl.match(line) for line in text.splitlines())]


def _refused_when_on(name: str) -> bool:
    """A switch that is not built: turning it on is refused as such."""
    from core.config import ConfigError
    from train.trainer import TrainConfig

    try:
        TrainConfig(**{name: True})
    except ConfigError as e:
        return "not built" in str(e)
    return False


def test_every_training_setting_is_read_by_product_code_or_refused():
    from train.trainer import TrainConfig

    sources = list(_product_sources())
    unread = [f.name for f in dataclasses.fields(TrainConfig) if not _reads(f.name, sources)]
    ignored = [n for n in unread if not _refused_when_on(n)]
    assert not ignored, f"training settings that no product code reads (accepted and ignored): {ignored}"
    assert unread == []                          # indexer_replay is read since it was built (2026-12-02)


def test_the_search_finds_a_read_and_misses_an_unread_name():
    sources = list(_product_sources())
    assert _reads("routing_replay", sources)
    assert not _reads("no_such_setting_anywhere", sources)


def test_indexer_replay_is_refused_where_it_is_not_built_with_the_reason():
    """Built for the built-in engine and the reference / miles BSHD models; the rest is refused
    (tests/train/test_indexer_replay.py checks every refusal)."""
    from core.config import ConfigError
    from train.trainer import TrainConfig

    assert TrainConfig(indexer_replay=True).indexer_replay
    with pytest.raises(ConfigError, match="'indexer_replay' is not built with true_on_policy .*Fix: drop true_on"):
        TrainConfig(indexer_replay=True, true_on_policy=True)
