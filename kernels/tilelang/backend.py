"""Entry point of the `tilelang` kernel backend."""

from typing import Optional

from core.not_built import NotBuiltError
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    return python_package_missing("tilelang")


def ops():
    """Return the tilelang implementations of the DeepSeek-V4 ops."""
    raise NotBuiltError("the tilelang kernels", "issue #8")
