"""A hook seam: a context-scoped callback that model code consults at one point of its forward.

The routing seam (``moe.routing_hook``) and the indexer seam (``indexer.indexer_hook``) are both this.
The hook lives in a ContextVar (so threads and nested contexts see their own), and a plain count of open
contexts sits in front of it: torch.compile cannot trace ``ContextVar.get`` but can guard on an int, so
compiled code with no hook open never reaches the ContextVar (no graph break). The count is changed under a
lock: a rollout engine generating in a thread of the trainer's process (``async_rollout``) opens and closes
contexts while the trainer does, and a lost update could leave it 0 while a hook is open (a hook skipped)."""

from __future__ import annotations

import contextlib
import contextvars
import threading

__all__ = ["HookSeam"]


class HookSeam:
    def __init__(self, name: str):
        self._hook: contextvars.ContextVar = contextvars.ContextVar(name, default=None)
        self.open = 0  # contexts open in the process
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def installed(self, hook):
        """Install ``hook`` for the current context."""
        token = self._hook.set(hook)
        with self._lock:
            self.open += 1
        try:
            yield hook
        finally:
            with self._lock:
                self.open -= 1
            self._hook.reset(token)

    def current(self):
        """The hook installed in this context, or None."""
        return self._hook.get() if self.open else None
