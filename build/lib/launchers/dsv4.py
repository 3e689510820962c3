"""Entry point of `bazel run //launchers:dsv4` (the same program as the `dsv4` script)."""

from launchers.cli import main

if __name__ == "__main__":
    main(prog_name="dsv4")
