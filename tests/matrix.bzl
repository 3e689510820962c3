"""The test matrix: one hermetic py_test per supported combination, and one for the unsupported ones.

The combinations come from tests/combinations.bzl, generated from the same
table the code uses (core/combinations.py). GPU combinations carry the tag
"gpu" (and "rocm" for AMD), which .bazelrc filters out of a CPU-only
`bazel test //tests/...`; on a GPU machine `--config=gpu` runs them.
"""

load(":combinations.bzl", "SUPPORTED_COMBINATIONS")

def combination_tests(name, srcs, deps, data = []):
    tests = []
    for combo in SUPPORTED_COMBINATIONS:
        tags = ["combination", combo.impl, combo.hardware]
        if combo.gpu:
            tags.append("gpu")
        if combo.hardware == "rocm":
            tags.append("rocm")
        native.py_test(
            name = combo.name,
            main = srcs[0],
            srcs = srcs,
            args = [
                "impl=" + combo.impl,
                "kernel_backend=" + combo.kernel_backend,
                "quant=" + combo.quant,
                "hardware=" + combo.hardware,
            ],
            deps = deps,
            data = data,
            tags = tags,
            size = "medium",
        )
        tests.append(combo.name)
    native.test_suite(name = name, tests = tests)

def unsupported_combination_tests(name, srcs, deps, data = []):
    """All the cases in one target: each is a test of its own there, a fork of one preloaded CLI
    (tests/unsupported_combination_test.py), where a target per case paid a fresh interpreter's start-up
    three times over."""
    native.py_test(
        name = name,
        main = srcs[0],
        srcs = srcs,
        deps = deps,
        data = data + [":unsupported_cases.bzl"],
        tags = ["unsupported-combination"],
        size = "medium",
    )
