"""py_test targets for plain pytest files: one target per file, or short files together in one target."""

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

def pytest_tests(srcs, deps = [], data = [], size = "small", tags = [], sizes = {}, shard_counts = {}, grouped = []):
    """One py_test per file, named after it (test_io.py -> test_io); the files in ``grouped`` run together
    instead, as one target named ``short_files`` (pytest_group)."""
    if grouped:
        pytest_group(name = "short_files", srcs = grouped, deps = deps, data = data, size = size, tags = tags)
    for src in srcs:
        if src in grouped:
            continue
        pytest_test(
            name = src[:-3].replace("/", "_"),
            src = src,
            deps = deps,
            data = data,
            size = sizes.get(src, size),
            tags = tags,
            shard_count = shard_counts.get(src),
        )

def pytest_group(name, srcs, deps = [], data = [], size = "medium", tags = []):
    """One py_test that runs several short files in one pytest process: each file alone spent more on its
    interpreter's start-up (torch and the repository imported, about 2.5 s of CPU) than on some of its tests
    (tests/converters: 40.5 s of CPU as ten targets, 15.5 s as one). For files whose tests leave no state
    behind them in the process; a file that does stays a target of its own (pytest_tests)."""
    native.py_test(
        name = name,
        srcs = srcs + ["//tests:pytest_main.py"],
        main = "//tests:pytest_main.py",
        args = ["$(location %s)" % src for src in srcs],
        deps = deps + ["//tests:testlib"],
        data = data,
        size = size,
        tags = tags,
    )
