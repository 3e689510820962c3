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


#: The first port above Ray's worker ports (10002-19999 by default): where :func:`server_port` starts looking.
SERVER_PORTS_FROM = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                                    # Linux's default


def server_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a server a job starts and then polls (the
    SGLang server of launch mode), picked at random below the kernel's ephemeral range and above Ray's worker
    ports; :func:`free_port` where that range is empty.

    Why not :func:`free_port`: the server binds its port seconds after the pick, after its imports, and in the
    ephemeral range the kernel hands that port out meanwhile as the source port of any outgoing connection
    (another process's, or the poller's own ``GET /health`` to the not yet listening port, which can even connect
    to itself), and to other servers binding port 0. A port the server then cannot bind makes it exit, and by
    the time the engine looks the connection may be gone (a CI run saw exactly that)."""
    import random

    low, high = SERVER_PORTS_FROM, _ephemeral_start()
    rng = random.Random()
    for _ in range(100 if high > low else 0):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


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
