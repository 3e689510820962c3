"""tests/runner.py's sharding: every collected test runs in exactly one shard; a ``shard`` marker places a test,
the rest go round-robin."""

import pytest

from tests.runner import _Shard, shard_of


class _Item:
    def __init__(self, name, shard=None):
        self.name = name
        self.marker = None if shard is None else pytest.mark.shard(shard).mark

    def get_closest_marker(self, name):
        return self.marker if name == "shard" else None


class _Config:
    class hook:
        deselected = []

        @classmethod
        def pytest_deselected(cls, items):
            cls.deselected.extend(items)


def test_each_test_runs_in_exactly_one_shard_and_a_marker_places_it():
    items = [_Item("a"), _Item("b", shard=2), _Item("c"), _Item("d", shard=5), _Item("e"), _Item("f", shard=0)]
    assert [shard_of(i, item, 3) for i, item in enumerate(items)] == [0, 2, 2, 2, 1, 0]
    kept = []
    for index in range(3):
        shard = list(items)
        _Config.hook.deselected = []
        _Shard(index, 3).pytest_collection_modifyitems(_Config, shard)
        assert sorted(x.name for x in shard + _Config.hook.deselected) == sorted(x.name for x in items)
        kept += [x.name for x in shard]
    assert sorted(kept) == sorted(x.name for x in items)          # each in one shard only, none lost


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
