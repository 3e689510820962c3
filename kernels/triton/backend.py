"""Entry point of the `triton` kernel backend."""

from typing import Optional

from core.not_built import NotBuiltError
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    return python_package_missing("triton")


def ops():
    """Return the triton implementations of the DeepSeek-V4 ops."""
    raise NotBuiltError("the triton kernels", "issue #8")
