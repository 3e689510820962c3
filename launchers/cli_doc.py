"""`python -m launchers.cli_doc docs/cli.md`: rewrite docs/cli.md's option reference from the click commands.

A module of its own because it imports the command line (launchers.cli), which imports launchers.generated.
//tests:generated_files_test fails when the file differs from what this writes.
"""

import sys

from core.atomic import write_text_atomically
from launchers.cli import main
from launchers.generated import replace_cli_reference

if __name__ == "__main__":
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        write_text_atomically(path, replace_cli_reference(f.read(), main))
