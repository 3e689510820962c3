"""Main of the pytest-based py_test targets made by tests/pytest.bzl.

The leading ``.py`` arguments are the test files (runfiles-relative); the rest go to pytest. The files leave
``sys.argv`` before tests.runner is imported: it reads the rest (``key=value`` parameters, pytest flags) then.
"""

import sys

if __name__ == "__main__":
    files = []
    while len(sys.argv) > 1 and sys.argv[1].endswith(".py"):
        files.append(sys.argv.pop(1))

    from tests.runner import main

    main(*files)
