"""Small availability probes shared by backend records."""

import importlib.util
from typing import Optional


def python_package_missing(package: str, note: str = "") -> Optional[str]:
    """None when ``package`` is importable here, else a sentence saying it is not."""
    if importlib.util.find_spec(package) is None:
        return f"the Python package {package!r} is not installed{note}"
    return None
