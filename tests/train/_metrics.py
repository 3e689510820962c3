"""The metrics rows of two runs compared: the keys that measure time differ between equal runs
(``reporting.metrics.TIMING_KEYS``, the one list of them)."""

from reporting.metrics import TIMING_KEYS as TIMING


def without_timing(rows):
    """``rows`` (metrics.jsonl dicts) without their timing keys, for equality with another run's."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
