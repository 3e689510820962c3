"""Runs a pytest file as a Bazel py_test.

Bazel passes per-target parameters as `key=value` arguments (e.g. the
combination a matrix target checks); they become DSV4_TEST_<KEY> environment
variables that the test module reads through ``param``. pytest writes its JUnit
XML where Bazel expects it, keeps no cache inside the runfiles tree and loads no
third-party pytest plugin (PYTEST_DISABLE_PLUGIN_AUTOLOAD). A
target with ``shard_count = N`` runs every N-th collected test in each of its N
shards (Bazel's TEST_TOTAL_SHARDS / TEST_SHARD_INDEX), in collection order, so
that a long file's work is spread over several cores; a test marked
``@pytest.mark.shard(K)`` runs in shard K (mod N) instead, so that the tests that
share an expensive module fixture (a reference run) run in one shard and run it once.
"""

from __future__ import annotations

import os
import sys


def _export_params(argv: list[str]) -> list[str]:
    """Move `key=value` arguments into the environment; return the rest."""
    rest = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not key.startswith("-"):
            os.environ[f"DSV4_TEST_{key.upper()}"] = value
        else:
            rest.append(arg)
    return rest


# Test modules read their parameters at import time, which happens before
# main() runs when the file is executed as a script.
_PASSTHROUGH = _export_params(sys.argv[1:])


def param(key: str) -> str:
    value = os.environ.get(f"DSV4_TEST_{key.upper()}")
    if value is None:
        raise KeyError(f"test parameter {key!r} was not given (pass {key}=VALUE as a py_test arg)")
    return value


def _hermetic_cache() -> None:
    """Point ``DSV4_CACHE`` (where the CLI materializes the embedded checkpoint and keeps its prepare locks) at
    the test's own temporary folder unless the target sets it: Bazel's sandbox mounts the user's home read-only,
    so on a machine where ``~/.cache/dsv4`` does not exist yet every test that runs the CLI's default model
    failed with a read-only file system, and where it does exist a test would share state with the user's runs."""
    tmp = os.environ.get("TEST_TMPDIR")
    if tmp and not os.environ.get("DSV4_CACHE"):
        os.environ["DSV4_CACHE"] = os.path.join(tmp, "dsv4-cache")


def _ray_token_in_the_environment() -> None:
    """Ray 2.60 turns on token authentication for every new local cluster and, without a token, writes one to
    ``~/.ray/auth_token``, which Bazel's sandbox mounts read-only: on a machine where no Ray ran outside a test
    yet, every Ray test failed there. A token in ``RAY_AUTH_TOKEN`` (read by Ray before that file; the test's
    processes and the cluster's inherit it) keeps authentication on and the home untouched."""
    if os.environ.get("TEST_TMPDIR") and not any(
            os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")):
        import secrets

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)


SHARD_MARKER = "shard(k): run this test in shard k (mod the target's shard_count; tests/runner.py)"


def shard_of(position: int, item, total: int) -> int:
    """The shard of the collected test at ``position``: its ``shard`` marker's, else every ``total``-th."""
    marker = item.get_closest_marker("shard")
    return (int(marker.args[0]) if marker is not None else position) % total


class _Shard:
    """pytest plugin: keep this shard's collected tests (Bazel test sharding, :func:`shard_of`)."""

    def __init__(self, index: int, total: int):
        self.index, self.total = index, total

    def pytest_configure(self, config):
        config.addinivalue_line("markers", SHARD_MARKER)

    def pytest_collection_modifyitems(self, config, items):
        kept = [item for i, item in enumerate(items) if shard_of(i, item, self.total) == self.index]
        dropped = [item for i, item in enumerate(items) if shard_of(i, item, self.total) != self.index]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _shard_plugins() -> list:
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        return []
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:                       # tells Bazel this runner shards (else it fails the target)
        open(status, "a").close()
    return [_Shard(int(os.environ.get("TEST_SHARD_INDEX", "0")), total)]


def main(*test_files: str) -> None:
    # No test uses a third-party pytest plugin; loading the venv's (anyio, platformdirs) would cost
    # every target about 0.4 s of CPU.
    os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    import pytest

    _hermetic_cache()
    _ray_token_in_the_environment()
    args = [*test_files, "-q", "-p", "no:cacheprovider", *_PASSTHROUGH]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    sys.exit(pytest.main(args, plugins=_shard_plugins()))
