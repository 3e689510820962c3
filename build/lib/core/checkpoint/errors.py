"""Errors raised by the checkpoint package.

Every problem with a checkpoint on disk (or with tensors handed to the writer)
raises :class:`CheckpointError`. Messages always name the file involved and,
when one is involved, the tensor, so a user can find the fault without a
debugger.
"""

from __future__ import annotations

from typing import Optional

from core.errors import UserInputError


class CheckpointError(UserInputError):
    """A checkpoint (or a set of tensors meant to become one) is invalid.

    ``tensor`` and ``file`` are also kept as attributes for programmatic use.
    """

    def __init__(self, message: str, *, tensor: Optional[str] = None, file: Optional[str] = None):
        parts = []
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if file is not None:
            parts.append(f"file {str(file)!r}")
        prefix = (", ".join(parts) + ": ") if parts else ""
        super().__init__(prefix + message)
        self.tensor = tensor
        self.file = None if file is None else str(file)
