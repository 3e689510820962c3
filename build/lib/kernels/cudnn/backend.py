"""Entry point of the `cudnn` kernel backend."""

from typing import Optional

from core.not_built import NotBuiltError
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    return python_package_missing("cudnn", " (cuDNN-frontend's sparse attention cannot be installed on this project's machines)")


def ops():
    """Return the cudnn implementations of the DeepSeek-V4 ops."""
    raise NotBuiltError("the cudnn kernels", "issue #8")
