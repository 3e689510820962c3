"""One shared check that tensors hold only finite values (no NaN, no +-inf).

Why: a NaN or inf in a weight does not fail loudly anywhere downstream. The
model runs, log-probabilities come out NaN (and ``json.dumps`` prints the
invalid token ``NaN``), training steps "succeed" and write NaN checkpoints,
convert and export copy the damage into new files. So every place where
weights enter (checkpoint loading, for every command), leave (exports,
buckets published to a rollout engine) or are produced (loss, gradients and
parameters of each training step) calls :func:`check_finite`, which raises
:class:`NonFiniteError` naming the tensor, where it came from and the fix.
A model that a checkpoint fills is built without random init: its weights start
as NaN (:func:`fill_unwritten_`) and every load path checks the whole model
afterwards (:func:`check_written`), so a weight no load wrote is refused too.

Cost: one ``torch.isfinite(t).all()`` per floating tensor (a single pass,
no copy kept), which is small next to reading the tensor from disk, and one
host sync per device for a whole list (the tensors are named only when one
fails). Float8
tensors are checked through a float32 view (``isfinite`` has no float8
kernel); integer tensors are skipped.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Optional, Tuple

import torch

from core.errors import UserInputError

__all__ = ["NonFiniteError", "check_finite", "check_finite_tensor", "checked", "check_finite_number",
           "first_nonfinite", "fill_unwritten_", "check_written"]


class NonFiniteError(UserInputError):
    """A tensor or number holds NaN or inf; the message names it, where it was found and the fix."""


def _count_bad(t: torch.Tensor) -> int:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return 0
    x = t.detach()
    if x.element_size() == 1:       # float8 variants: no isfinite kernel
        x = x.float()
    ok = torch.isfinite(x)
    if bool(ok.all()):
        return 0
    return int((~ok).sum())


def _all_finite(tensors) -> bool:
    """Whether every floating tensor is finite, with one host sync per device (not one per tensor: the
    trainer checks a few hundred weights every step, and a sync per tensor stalls the GPU's queue)."""
    flags = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            x = t.detach()
            flags.setdefault(x.device, []).append(torch.isfinite(x.float() if x.element_size() == 1 else x).all())
    return all(bool(torch.stack(f).all()) for f in flags.values())


def first_nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[Tuple[str, int, int]]:
    """``(name, bad count, numel)`` of the first tensor with NaN/inf, or None."""
    named = list(named)
    if _all_finite(t for _, t in named):
        return None
    for name, t in named:
        bad = _count_bad(t)
        if bad:
            return name, bad, t.numel()
    return None


def _message(name: str, bad: int, numel: int, where: str, fix: str) -> str:
    msg = f"{where}: tensor {name!r} holds {bad} NaN/inf value(s) of {numel}"
    return f"{msg}; {fix}" if fix else msg


def check_finite_tensor(name: str, t: torch.Tensor, *, where: str, fix: str = "") -> torch.Tensor:
    """Raise :class:`NonFiniteError` if ``t`` holds NaN/inf; return ``t`` unchanged."""
    bad = _count_bad(t)
    if bad:
        raise NonFiniteError(_message(name, bad, t.numel(), where, fix))
    return t


def check_finite(named: Iterable[Tuple[str, torch.Tensor]], *, where: str, fix: str = "") -> None:
    """Check every ``(name, tensor)``; the first bad one raises :class:`NonFiniteError`."""
    found = first_nonfinite(named)
    if found is not None:
        raise NonFiniteError(_message(*found, where=where, fix=fix))


def checked(named: Iterable[Tuple[str, torch.Tensor]], *, where: str,
            fix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """Pass ``(name, tensor)`` pairs through, checking each as it streams by."""
    for name, t in named:
        yield name, check_finite_tensor(name, t, where=where, fix=fix)


def check_finite_number(name: str, value, *, where: str, fix: str = "") -> float:
    """A Python / tensor scalar that must be finite (a loss, a gradient norm)."""
    v = float(value)
    if not math.isfinite(v):
        msg = f"{where}: {name} is {v}"
        raise NonFiniteError(f"{msg}; {fix}" if fix else msg)
    return v


def _state_tensors(module) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weights of ``module``: its parameters and persistent buffers (its state dict's tensors; megatron's
    ``_extra_state`` entries are not tensors). Non-persistent buffers are computed values, not weights."""
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            yield name, t


@torch.no_grad()
def fill_unwritten_(module) -> None:
    """Fill every floating weight of ``module`` with NaN: the state of a model built WITHOUT random init (a
    checkpoint fills it, ``core.assembly.Assembly.build_model(initialize=False)``). Uninitialized memory
    could hold anything, finite included; NaN makes a weight that no load writes fail :func:`check_written`
    instead of training silently on garbage. Integer weights (``tid2eid``) keep what their constructor
    computed."""
    for _name, t in _state_tensors(module):
        if t.is_floating_point():
            t.fill_(float("nan"))


def check_written(module, *, source) -> None:
    """After loading ``source`` into ``module``: every floating weight is finite. The loaders check what they
    read, so a NaN here is a weight the load did not write (a model built without random init starts all NaN,
    :func:`fill_unwritten_`); raises :class:`NonFiniteError` naming it. One host sync per device."""
    check_finite(_state_tensors(module), where=f"the model after loading {source}",
                 fix="the load did not write this tensor (the model is built without random init when a "
                     "checkpoint is loaded, and the checkpoint must fill every tensor). Fix: load a checkpoint "
                     "of this model config that holds every tensor (dsv4 convert writes complete ones)")


def finite_json(obj, *, what: str) -> str:
    """``json.dumps`` that refuses NaN/inf (the standard library would print the invalid token ``NaN``)."""
    import json

    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        raise NonFiniteError(f"the {what} hold NaN/inf values, so no JSON is printed; the model's weights or "
                             f"inputs are out of range (check the checkpoint)") from None
