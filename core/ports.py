"""A free local TCP port, for the ``MASTER_PORT`` of process groups a job starts on this machine; and a start
that picks another when the port it picked was taken before it was bound.

Why: :func:`free_port` binds port 0, reads the number and closes; whatever binds it next (a worker process's
c10d store, seconds later, after its imports) can find it taken by a process that bound a port of its own in
between (a Ray worker's gRPC server did, in CI). :func:`on_free_port` starts again on a newly picked port when,
and only when, the failure says the address was in use; any other failure is the caller's.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

#: How many picked ports a start tries: three picks in a row taken is not a race any more.
PORT_ATTEMPTS = 3

log = logging.getLogger("dsv4")


class PortsTaken(RuntimeError):
    """Every port :func:`on_free_port` picked was taken before the start bound it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_in_use(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says an address was in use: an ``OSError`` with
    ``EADDRINUSE``, or the text torch's TCPStore and ``torch.multiprocessing`` carry across processes
    (``... name: EADDRINUSE, message: address already in use``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            return True
        text = str(exc)
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def on_free_port(start: Callable[[int], T], what: str, attempts: int = PORT_ATTEMPTS) -> T:
    """``start(port)`` on a :func:`free_port`; when it fails because that port was in use (:func:`address_in_use`),
    once more on a newly picked one, ``attempts`` starts in all, each retry logged; then :class:`PortsTaken`.
    ``what`` names the start in those lines."""
    if attempts < 1:
        raise ValueError(f"on_free_port: attempts must be at least 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        port = free_port()
        try:
            return start(port)
        except Exception as exc:
            if not address_in_use(exc):
                raise
            if attempt == attempts:
                raise PortsTaken(f"{what}: port {port} was taken by another process before it was bound, and so were "
                                 f"the {attempts - 1} free port(s) picked before it. Fix: find what binds ports on "
                                 f"this machine so fast (`ss -ltnp`) and stop it, or run again") from None
            log.warning(f"{what}: port {port} was taken by another process before it was bound; starting again on "
                        f"another free port (attempt {attempt + 1} of {attempts})")
    raise AssertionError("unreachable: the last attempt returns or raises")
