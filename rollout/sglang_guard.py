"""Keeps a started SGLang server from outliving the process that started it (rollout.sglang_engine, launch mode).

Why: the engine starts the server in a session of its own, so that ``shutdown`` can signal the whole process
group (SGLang's scheduler and detokenizer processes too). The same thing means that nothing stops the server
when its owner dies without calling ``shutdown`` - a SIGKILLed Ray engine actor, an OOM-killed trainer: the
server would keep its GPU and port until someone kills it by hand.

So the engine does not start the server itself but this script, as the new session's leader::

    python -I sglang_guard.py OWNER_PID PDEATHSIG -- SERVER COMMAND...

It starts ``SERVER COMMAND`` (the exact :func:`rollout.sglang_engine.server_command`, same process group, same
output) and stops the whole group - SIGTERM, then SIGKILL after :data:`GRACE_S` - as soon as:

* its parent is no longer ``OWNER_PID`` (the owner died and the guard was re-parented), checked every
  :data:`POLL_S`, whatever thread started the guard;
* it receives SIGTERM, SIGINT or SIGHUP. With ``PDEATHSIG`` = 1 (Linux) the guard asks the kernel to send it
  SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a dead owner is noticed at once. The kernel
  sends that signal when the parent *thread* that forked the guard exits, not the parent process; the engine
  asks for it only when it starts the guard from its main thread, which lives as long as its process.

The guard blocks those signals and waits for them (``sigtimedwait``; Linux has it, macOS not) instead of
handling them: a handler raising an exception ran once the poll had seen the owner gone (the parent-death signal
comes with the owner's death) and before the stop, and ended the guard before it stopped anything - the server
of a SIGKILLed Ray engine actor outlived it, in CI.

Whatever ends the guard without that stop (SIGKILL, the OOM killer, a bug) ends the server too: on Linux the
server is started with the parent-death signal SIGKILL, the guard's only thread being its parent (SGLang's
scheduler and detokenizer processes die with the server the same way). The guard itself exits only once the
server has exited, or at the SIGKILL of its stop, so this never cuts the server's SIGTERM grace short.

When the server exits on its own, the guard exits with the server's code (128 + N after signal N), so the
engine's start-up check reports the server's exit; whatever the server left in the group is stopped by the
engine's ``shutdown``, as before.

It imports only the standard library and is run by its path with ``-I``: it needs neither the project on the
path nor anything the server's environment (``PYTHONPATH``) brings, which it passes on unchanged.
"""

import os
import signal
import subprocess
import sys
import time
from typing import Callable

POLL_S = 0.2         # how often the guard checks that its owner is alive
GRACE_S = 20.0       # SIGTERM to SIGKILL, when the guard stops the group
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _ask_for_parent_death_signal(sig: int) -> None:
    """``sig`` to this process when the thread that started it exits (Linux; elsewhere the polling and the
    guard's stop are all)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        print(f"sglang_guard: prctl(PR_SET_PDEATHSIG, {signal.Signals(sig).name}) failed (errno "
              f"{ctypes.get_errno()}) in process {os.getpid()}", file=sys.stderr, flush=True)


def _server_setup(guard: int, mask) -> Callable[[], None]:
    """What the server's process runs between fork and exec: the signal mask the guard was started with (the
    guard blocks its stop signals), and SIGKILL when the guard exits. A guard already gone by then (its SIGKILL
    came before the ``prctl``) starts nothing."""
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _ask_for_parent_death_signal(signal.SIGKILL)
        if os.getppid() != guard:
            os._exit(1)
    return setup


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the group (the server and its workers; this process has the signal blocked), SIGKILL after
    ``GRACE_S`` or once the server has exited - which ends this process too."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(0, signal.SIGKILL)


def main(argv) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: sglang_guard.py OWNER_PID PDEATHSIG -- COMMAND...", file=sys.stderr)
        return 2
    if not hasattr(signal, "sigtimedwait"):
        print(f"sglang_guard: needs signal.sigtimedwait, which Python lacks on {sys.platform} (Linux has it)",
              file=sys.stderr)
        return 2
    owner, pdeathsig, cmd = int(argv[0]), argv[1] == "1", argv[3:]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)   # waited for below: a stop ends the wait
    if pdeathsig:
        _ask_for_parent_death_signal(signal.SIGTERM)
    if os.getppid() != owner:       # the owner died before the guard could watch it: start nothing
        return 1
    server = subprocess.Popen(cmd, preexec_fn=_server_setup(os.getpid(), mask))
    while os.getppid() == owner:
        code = server.poll()
        if code is not None:
            return code if code >= 0 else 128 - code
        if signal.sigtimedwait(STOP_SIGNALS, POLL_S) is not None:
            break
    _stop_group(server)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
