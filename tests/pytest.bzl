"""py_test targets for plain pytest files: one target per file."""

def pytest_test(name, src, deps = [], data = [], size = "small", tags = [], args = [], shard_count = None):
    """shard_count: run the file's tests in that many shards, every N-th collected test in each
    (tests/runner.py), for a file whose target would otherwise be the run's longest."""
    native.py_test(
        name = name,
        srcs = [src, "//tests:pytest_main.py"],
        main = "//tests:pytest_main.py",
        args = ["$(location %s)" % src] + args,
        deps = deps + ["//tests:testlib"],
        data = data,
        size = size,
        tags = tags,
        shard_count = shard_count,
    )

def pytest_tests(srcs, deps = [], data = [], size = "small", tags = [], sizes = {}, shard_counts = {}):
    """One py_test per file, named after it (test_io.py -> test_io)."""
    for src in srcs:
        pytest_test(
            name = src[:-3].replace("/", "_"),
            src = src,
            deps = deps,
            data = data,
            size = sizes.get(src, size),
            tags = tags,
            shard_count = shard_counts.get(src),
        )
