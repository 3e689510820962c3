"""Main of the pytest-based py_test targets made by tests/pytest.bzl.

The first argument is the test file (runfiles-relative); the rest go to pytest.
"""

import sys

from tests.runner import main

if __name__ == "__main__":
    test_file = sys.argv.pop(1)
    main(test_file)
