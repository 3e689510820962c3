"""What `dsv4` prints on stderr: ``-q`` / ``-v``, the known library warnings, the detected hardware
(issue #21, item 7).

* :func:`configure`: ``-q`` prints only errors and the final result, ``-v`` adds debug lines (every
  metric of every step) and the library warnings hidden by default (:mod:`core.known_warnings`). The
  run's lines go through :data:`reporting.run_log.log`.
* :func:`detect_hardware`: `train` and `full-train` without ``--hardware`` run on ``nvidia`` when torch
  sees a CUDA device, else on ``cpu``, and print which one they chose and why.
"""

from __future__ import annotations

import logging

__all__ = ["configure", "detect_hardware"]


def configure(*, quiet: bool = False, verbose: bool = False) -> None:
    from core.known_warnings import filter_known_warnings
    from reporting.run_log import configure_console

    configure_console(logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO)
    filter_known_warnings(show=verbose)


def detect_hardware() -> str:
    """``nvidia`` when torch sees a CUDA device, else ``cpu``; the choice is printed (not with ``-q``)."""
    import torch

    from reporting.run_log import log

    if torch.cuda.is_available():
        log.info(f"hardware: nvidia (detected: {torch.cuda.get_device_name(0)}; --hardware chooses)")
        return "nvidia"
    log.info("hardware: cpu (detected: no CUDA device; --hardware chooses)")
    return "cpu"
