"""A hook seam: a context-scoped callback that model code consults at one point of its forward.

The routing seam (``moe.routing_hook``) and the indexer seam (``indexer.indexer_hook``) are both this.
The hook lives in a ContextVar (so threads and nested contexts see their own), and a plain count of open
contexts sits in front of it: torch.compile cannot trace ``ContextVar.get`` but can guard on an int, so
compiled code with no hook open never reaches the ContextVar (no graph break)."""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["HookSeam"]


class HookSeam:
    def __init__(self, name: str):
        self._hook: contextvars.ContextVar = contextvars.ContextVar(name, default=None)
        self.open = 0  # contexts open in the process

    @contextlib.contextmanager
    def installed(self, hook):
        """Install ``hook`` for the current context."""
        token = self._hook.set(hook)
        self.open += 1
        try:
            yield hook
        finally:
            self.open -= 1
            self._hook.reset(token)

    def current(self):
        """The hook installed in this context, or None."""
        return self._hook.get() if self.open else None
