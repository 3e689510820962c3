"""The GPU kernel backends these tests run once each (a ``backend`` parameter), and their modules."""

import importlib
import importlib.util
import re

import pytest
import torch

BACKENDS = ["triton", "tilelang"]

# pytestmark of a per-backend test file: GPU-marked, one case per backend, skipped (with the reason) where
# CUDA or the backend's package is missing.
PER_BACKEND = [pytest.mark.gpu, pytest.mark.parametrize("backend", BACKENDS), pytest.mark.usefixtures("needs_backend")]


def backend_module(backend: str, name: str):
    """``kernels.<backend>.<name>``."""
    return importlib.import_module(f"kernels.{backend}.{name}")


def missing(backend: str):
    """Why ``backend``'s cases cannot run here, or None."""
    if not torch.cuda.is_available() or importlib.util.find_spec(backend) is None:
        return f"needs a CUDA GPU and {backend}"
    return None


def triton_device() -> str:
    """Where a Triton kernel test runs: ``"cuda"`` on a GPU, ``"cpu"`` under ``TRITON_INTERPRET=1`` (Triton's CPU
    interpreter, small shapes); otherwise the test skips with the reason."""
    import os

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1: Triton's CPU interpreter, small shapes)")



STEP = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -22}   # half a step: one rounding of the output


def within(got, exact, dtype, what, interpreted, scale=None):
    """Assert ``got`` is within one rounding of the output ``dtype`` of ``exact`` (fp64): bf16, one rounding (two
    under the interpreter, which truncates) at ``scale`` (default the element's magnitude); fp32, a few steps of
    the row's largest magnitude. Shared by the norm kernels' tests (one Bazel target per test file)."""
    steps = 4 if (interpreted and dtype == torch.bfloat16) else 2
    if scale is None:
        scale = exact.abs() if dtype != torch.float32 else exact.abs().amax(-1, keepdim=True).expand_as(exact)
    bound = steps * STEP[dtype] * scale
    err = (got.double() - exact).abs()
    worst = err.argmax()
    print(f"{what}: max error {err.max().item():.3e} (bound there {bound.flatten()[worst].item():.3e})")
    assert (err <= bound + 1e-30).all(), what


class CountedLaunches:
    """A Triton kernel whose ``kernel[grid](...)`` launches are counted (``calls``): which of a launcher's kernels
    ran. Install it with ``monkeypatch.setattr(module, name, CountedLaunches(kernel))``, or :meth:`installed`."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]

    @classmethod
    def installed(cls, monkeypatch, module, name: str) -> "CountedLaunches":
        """``module.name`` replaced, for the test, by its counted launches (returned)."""
        spy = cls(getattr(module, name))
        monkeypatch.setattr(module, name, spy)
        return spy


def triton_ptxas() -> str:
    """The ptxas triton compiles with in this process, whose CUDA release set the PTX version of what it just
    emitted: ``TRITON_PTXAS_PATH`` where set, else the one triton ships. Why: torch's Inductor sets that variable
    to torch's own (CUDA 13 with torch 2.11+cu130) the first time it compiles, and the PTX triton emits after that
    was too new for triton's bundled ptxas: on one H100 the sm_90 compile tests failed after a test that compiled
    the training step. Skips where there is none."""
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except RuntimeError:
        pytest.skip("no ptxas for triton here")


def compiles_for_sm90_without_spills(kernel, types: dict, consts: dict, num_warps: int, aligned=()) -> None:
    """Compile ``kernel`` (argument ``types`` such as ``"*bf16"``, ``"i32"``; ``consts`` its constexprs) to PTX
    for sm_90 with triton alone, no GPU, and assert that ptxas (the one triton compiles with) reports no spilled
    registers; skips in interpreter mode, without triton or without its ptxas. ``aligned``: the arguments the
    runtime specializes as multiples of 16 (a pointer at a 16-byte address, an int divisible by 16: Triton's
    ``tt.divisibility``), so that ptxas sees the code a launch on such inputs compiles to. A kernel with a ``PDL``
    flag (``kernels/triton/pdl.py``) compiles both ways a Hopper launches it, unless ``consts`` sets it: the flag
    off (the default) and on (``DSV4_PDL=1``, with ``PREFETCH`` where the kernel has it)."""
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    modes = [consts]
    if "PDL" in kernel.arg_names and "PDL" not in consts:     # a decode kernel: both launches
        modes = [dict(consts, PDL=on) for on in (False, True)]
    for c in modes:
        if "PREFETCH" in kernel.arg_names and "PREFETCH" not in c:    # with its weights' prefetch where it has one
            c = dict(c, PREFETCH=c["PDL"])
        _, stderr = ptxas_report(kernel, types, c, num_warps, aligned)
        spills = spilled_bytes(stderr)
        assert spills and not any(spills), f"PDL={c.get('PDL')}: {stderr}"


def spilled_bytes(report: str) -> list:
    """The spill stores' and loads' byte counts in a ptxas ``-v`` report (empty if it reports none)."""
    return [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]


def ptxas_report(kernel, types: dict, consts: dict, num_warps: int, aligned=(), **options) -> tuple:
    """``(ptx, ptxas's -v report)`` of ``kernel`` compiled to PTX for sm_90 at ``consts`` (``options``: more of
    triton's compile options, such as ``num_stages``), assembled by :func:`triton_ptxas`."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: ("constexpr" if a in consts else types[a]) for a in kernel.arg_names}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, launch_pdl=bool(consts.get("PDL", False)), **options))
    ptx = compiled.asm["ptx"]
    assert ".entry" in ptx
    ptxas = triton_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    return ptx, out.stderr
