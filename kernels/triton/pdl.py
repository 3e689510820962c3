"""Programmatic dependent launch (PDL) of the decode step's triton kernels: :func:`launch` gives a launch's
arguments, :func:`wait_prior` is a kernel's first statement.

Why: at one sequence the eager Flash-shaped decode step is about a hundred kernels of a few microseconds each,
replayed from a CUDA graph, and most of them wait on the one before (on an H200 the step took 1.297 ms by the
engine's clock, its kernels 1.2431 ms of device time, 122.8 kernels a step:
``bench/results/rollout-h200-flash-shaped-triton-profile-linear-group-head.json``). Without PDL a kernel's
programs are scheduled only once the kernel before it has completed. Launched with PDL (the programmatic stream
serialization attribute; Hopper and later), a kernel may be scheduled while its predecessor still runs: each of
its programs first waits for the kernels before it to complete and their writes to be visible
(``griddepcontrol.wait``), then lets the next kernel launch (``griddepcontrol.launch_dependents``). The launch and
scheduling of a kernel overlap the tail of the one before, and nothing it reads or writes is touched early.

The rule that keeps it correct: a kernel launched with PDL calls :func:`wait_prior` before any load or store
(every kernel that takes :func:`launch`'s arguments does; tests/kernels/test_pdl_sources.py checks their sources). The
wait covers every kernel before it on the stream, since each of those waited for its own predecessors before
completing. Kernels launched without the attribute (torch's) wait as always.

Only the rollout engine's decode step launches so (``kernels.gpu_common.dependent_launches``, around the step it runs
and captures into its CUDA graphs, ``rollout.slot_decoder``), and only with ``DSV4_PDL=1`` in the environment:
training and prefill kernels run long and are launched as always. It is opt-in because on an H100 it gained
nothing measurable (the Flash-shaped step at one sequence 1.63 ms with it, 1.634 without; at 64 sequences 4.099
and 4.129; at 256 5.83 and 5.742: ``docs/rollout.md``, the static-slot decode step), while twice the first
one-sequence row timed on a freshly started machine with it on took 4.84 and 7.14 ms, which no run has explained
yet. The same kernels, the same bits either way (``bench.rollout`` times both); the CPU interpreter and GPUs
before Hopper never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels import gpu_common

__all__ = ["ENV", "PREFETCH_ENV", "enabled", "prefetching", "launch", "wait_prior", "wait_prior_after_prefetch"]

ENV = "DSV4_PDL"
PREFETCH_ENV = "DSV4_PDL_PREFETCH"


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: inside ``kernels.gpu_common.dependent_launches`` (the engine's decode
    step), on a CUDA device of compute capability 9 or later, not the interpreter, with ``DSV4_PDL=1`` (opt-in:
    module docstring)."""
    if (not gpu_common.dependent_launches_on() or os.environ.get(ENV, "0") != "1" or gpu_common.interpreting()
            or device.type != "cuda"):
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetching(device: torch.device) -> bool:
    """Whether a launch on ``device`` of a kernel with ``PREFETCH`` asks L2 for its weights while it waits: with
    PDL (:func:`enabled`), unless ``DSV4_PDL_PREFETCH`` is ``0``."""
    return enabled(device) and os.environ.get(PREFETCH_ENV, "1") != "0"


def launch(device: torch.device, prefetch: bool = False) -> dict:
    """A launch's keyword arguments: the kernel's ``PDL`` constexpr, and with it the launch attribute; ``prefetch``
    (a kernel that takes ``PREFETCH``, :func:`wait_prior_after_prefetch`): also that constexpr
    (:func:`prefetching`)."""
    on = enabled(device)
    if on:
        gpu_common.count_dependent_launch()
    args = dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)
    if prefetch:
        args["PREFETCH"] = prefetching(device)
    return args


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With ``PDL``: wait for the kernels before this one to complete (their writes visible), then let the next
    kernel launch. A kernel's first statement, before any load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior_after_prefetch(PDL: tl.constexpr, PREFETCH: tl.constexpr, lines):
    """:func:`wait_prior`, and before the wait, with ``PREFETCH``, a hint to bring the 128-byte lines at ``lines`` (a
    tensor of pointers into memory no kernel of the step writes: a weight) into L2. Why: a program launched early
    waits while the kernel before it finishes, which at a few tokens is often one program's serial tail (the mHC
    pre's coefficients, a split reduction's sum) on an otherwise idle GPU; a projection's first weight bytes can
    stream in meanwhile. A prefetch neither reads nor writes a value the program sees, so the rule holds: nothing
    the kernels before write is touched early. At the normal eviction priority: the lines are read once, right
    after, and an ``evict_last`` mark would keep them in L2 over the step's activations."""
    if PDL:
        if PREFETCH:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
