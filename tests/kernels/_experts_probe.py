"""A probe of ``kernels.triton.experts._row_block`` for the tests: each program of a grid writes the row block
it would take. Imports triton at the top, so only GPU tests (or ``TRITON_INTERPRET=1``) import it."""

import torch
import triton
import triton.language as tl

from kernels.triton.experts import _row_block


@triton.jit
def _probe_kernel(OFFS, OUT, NE, BM: tl.constexpr, EP: tl.constexpr):
    g = tl.program_id(0)
    e, start, end = _row_block(OFFS, g, NE, BM, EP)
    tl.store(OUT + 3 * g, e)
    tl.store(OUT + 3 * g + 1, start)
    tl.store(OUT + 3 * g + 2, end)


def row_blocks(offs: torch.Tensor, bm: int, programs: int) -> torch.Tensor:
    """``[programs, 3]`` int32: program ``g``'s ``(expert, start, end)`` for the experts' end rows ``offs``."""
    out = torch.full((programs, 3), -1, dtype=torch.int32, device=offs.device)
    E = offs.shape[0]
    _probe_kernel[(programs,)](offs, out, E, BM=bm, EP=max(triton.next_power_of_2(E), 2))
    return out
