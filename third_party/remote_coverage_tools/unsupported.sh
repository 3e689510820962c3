#!/bin/sh
echo "bazel coverage is not supported in this workspace (offline stub of @remote_coverage_tools)" >&2
exit 1
