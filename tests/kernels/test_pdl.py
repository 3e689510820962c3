"""Programmatic dependent launch of the triton kernels (``kernels/triton/pdl.py``): a launch asks for PDL only in
the decode step on a Hopper-class CUDA device outside the interpreter and with ``DSV4_PDL=1``, the wait compiles
for sm_90 ahead of every global load, and on a GPU a chain of dependent kernels replayed from a CUDA graph gives the
same bits with PDL and without (that every flagged kernel waits first is read from the sources by
``test_pdl_sources.py``, on the CPU suite)."""

import pytest
import torch

from ._backends import triton_device

def test_a_launch_asks_for_pdl_only_in_the_decode_step_on_hopper_cuda_outside_the_interpreter(monkeypatch):
    """``pdl.launch``: inside ``dependent_launches`` (the engine's decode step), on a CUDA device of compute
    capability 9 or later, not in the interpreter, with ``DSV4_PDL=1`` (opt-in); else the plain launch."""
    from kernels.gpu_common import dependent_launches
    from kernels.triton import pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    monkeypatch.setattr(pdl, "_hopper_or_later", lambda index: index == 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with dependent_launches():
        assert pdl.launch(cuda0) == dict(PDL=False)              # without DSV4_PDL=1: off
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.launch(cuda0) == dict(PDL=False)                  # training, prefill
    assert pdl.launch(cuda0, prefetch=True) == dict(PDL=False, PREFETCH=False)
    with dependent_launches():
        with dependent_launches():
            pass
        assert pdl.launch(cuda0) == dict(PDL=True, launch_pdl=True)
        assert pdl.launch(cuda0, prefetch=True) == dict(PDL=True, launch_pdl=True, PREFETCH=True)
        monkeypatch.setenv(pdl.PREFETCH_ENV, "0")                # dependent launches without the weights' prefetch
        assert pdl.launch(cuda0, prefetch=True) == dict(PDL=True, launch_pdl=True, PREFETCH=False)
        monkeypatch.delenv(pdl.PREFETCH_ENV)
        _pdl_only_where_it_can(monkeypatch, pdl, cuda0, cuda1)
    assert pdl.launch(cuda0) == dict(PDL=False)


def _pdl_only_where_it_can(monkeypatch, pdl, cuda0, cuda1):
    assert pdl.launch(cuda1) == dict(PDL=False)                  # before Hopper
    assert pdl.launch(torch.device("cpu")) == dict(PDL=False)
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.launch(cuda0) == dict(PDL=False)
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch(cuda0) == dict(PDL=False)


def _ptx(kernel, types: dict, consts: dict, pdl_on: bool) -> str:
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiles PTX: not in interpreter mode")
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts, PDL=pdl_on, **({"PREFETCH": pdl_on} if "PREFETCH" in kernel.arg_names else {}))
    sig = {a: ("constexpr" if a in consts else types[a]) for a in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, launch_pdl=pdl_on)).asm["ptx"]


def test_the_wait_compiles_for_sm90_ahead_of_every_global_access():
    """PTX for sm_90 (triton alone, no GPU) of a weight-streaming kernel and of the mHC pre with its ticketed tail:
    with ``PDL`` the wait and the release come before the first global load or atomic, and the weight-streaming
    kernel's L2 prefetch of its weight rows before the wait; without it none of them is there."""
    from kernels.triton import linear_group as L
    from kernels.triton import mhc_decode as MD

    c = L.LINEAR_GROUP_CONFIG
    grouped = {a: ("*bf16" if a in ("X", "W", "Y") else "*fp32" if a == "PART" else "*i32" if a == "TICKETS"
                   else "i32") for a in L._grouped_kernel.arg_names}
    pointers = {"X": "*bf16", "Y": "*bf16", "TICKET": "*i32", **{a: "*fp32" for a in ("FN", "PART", "SSP", "MIXS",
                                                                                      "SCALE", "BASE", "W", "POST",
                                                                                      "COMB")}}
    pre = {a: pointers.get(a, "fp32" if "eps" in a else "i32") for a in MD._pre_norm_kernel.arg_names}
    cases = [(L._grouped_kernel, grouped, dict(SPLIT=1, BM=16, BN=c["BN"], BK=c["BK"], STAGES=c["stages"],
                                               LINES=c["prefetch_lines"])),
             (MD._pre_norm_kernel, pre, dict(HAS_RES=True, BT=16, BK=64, MP=32, PREC="tf32x3", STAGES=2, TB=1, NP=4,
                                              BD=4096, SB=128, ONE_PASS=True))]
    for kernel, types, consts in cases:
        lines = _ptx(kernel, types, consts, True).splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
        first = next(i for i, line in enumerate(lines)
                     if any(op in line for op in ("ld.global", "cp.async", "atom.", "red.", "st.global")))
        assert wait < release < first, (kernel.fn.__name__, wait, release, first)
        prefetch = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
        assert (prefetch and max(prefetch) < wait) if "PREFETCH" in kernel.arg_names else not prefetch
        off = _ptx(kernel, types, consts, False)
        assert "griddepcontrol" not in off and "prefetch" not in off


@pytest.mark.gpu
def test_a_graph_of_dependent_kernels_gives_the_same_bits_with_pdl_and_without(monkeypatch):
    """On a Hopper GPU: projections, the mHC pre with its norm and a projection of its output, each reading the one
    before, captured in a CUDA graph and replayed, with PDL and with ``DSV4_PDL=0``: the same bits, replay after
    replay (a kernel that read before the one before it had written would differ)."""
    from kernels.gpu_common import dependent_launches
    from kernels.triton import linear_group as L
    from kernels.triton import mhc_decode as MD
    from kernels.triton import pdl

    dev = triton_device()
    monkeypatch.setenv(pdl.ENV, "1")
    with dependent_launches():
        usable = dev != "cpu" and pdl.enabled(torch.device(dev))
    if not usable:
        pytest.skip("needs a Hopper-class GPU")
    g = torch.Generator().manual_seed(0)
    n, d = 4, 1024
    x = torch.randn(1, n * d, generator=g).bfloat16().to(dev)
    w1 = (torch.randn(n * d, n * d, generator=g) * (n * d) ** -0.5).bfloat16().to(dev)
    fn = (torch.randn((2 + n) * n, n * d, generator=g) * (n * d) ** -0.5).to(dev)
    scale, base = (0.5 + torch.rand(3, generator=g)).to(dev), torch.randn((2 + n) * n, generator=g).to(dev)
    norm_w = (0.5 + torch.rand(d, generator=g)).to(dev)
    w2 = (torch.randn(8192, d, generator=g) * d ** -0.5).bfloat16().to(dev)

    def chain():
        h = L.linear_group_launch(x, [w1], [False])[0]
        y, post, comb = MD.hc_pre_norm(h.view(1, n, d), fn, scale, base, 1e-6, 1e-6, 20, norm_w, 1e-6)
        return L.linear_group_launch(y, [w2], [True])[0], post, comb

    def replayed():
        chain()                                                    # compiles, makes the ticket counters
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        runs = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            runs.append([t.clone() for t in out])
        return runs

    with dependent_launches():
        with_pdl = replayed()
        monkeypatch.setenv(pdl.ENV, "0")
        without = replayed()
    for a in with_pdl + without[1:]:
        assert all(torch.equal(p, q) for p, q in zip(a, without[0], strict=True))
