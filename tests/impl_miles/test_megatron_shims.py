"""backends.cpu.megatron_shims: triton stub (only when triton is absent; torch keeps seeing no
triton), torch.cuda.current_device -> "cpu", megatron's RNG tracker on the CPU generator, wandb imported
on first use (not by ``import megatron.core``), and the gloo process-group helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, extra_path: str | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, ROOT, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_imports_megatron_and_torch_sees_no_triton():
    r = _run("""
        import json, importlib.util, sys, torch
        assert importlib.util.find_spec("triton") is None      # this environment has no triton
        from backends.cpu import megatron_shims as s
        assert "triton" not in sys.modules and not s.shims_applied()   # nothing happens on import
        s.apply_megatron_cpu_shims()
        import megatron.core
        from megatron.core import tensor_parallel
        import torch.utils._triton as tt
        from torch._inductor.runtime import triton_compat
        from megatron.core import timers
        # megatron's `import wandb` got the placeholder; nothing of wandb ran yet
        deferred = timers.wandb is sys.modules["wandb"] and "wandb.sdk" not in sys.modules
        import wandb
        version = wandb.__version__                  # the first lookup imports the real package
        real = sys.modules["wandb"]
        print(json.dumps({
            "stub": s.is_triton_stub(), "has_triton": tt.has_triton(), "has_pkg": tt.has_triton_package(),
            # torch's own no-triton placeholder, not our stub
            "compat_no_triton": getattr(triton_compat.triton, "__module__", "") == triton_compat.__name__,
            "device": torch.cuda.current_device(),
            "wandb_deferred": deferred,
            "wandb_loaded": real is not wandb and "wandb.sdk" in sys.modules and version == real.__version__
                            and timers.wandb.init is real.init,
        }))
    """)
    assert r == {"stub": True, "has_triton": False, "has_pkg": False, "compat_no_triton": True, "device": "cpu",
                 "wandb_deferred": True, "wandb_loaded": True}


def test_real_triton_is_never_shadowed(tmp_path):
    pkg = tmp_path / "triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    r = _run("""
        import json, sys
        from backends.cpu import megatron_shims as s
        s.apply_megatron_cpu_shims()
        import triton
        print(json.dumps({"real": getattr(triton, "REAL", False), "stub": s.is_triton_stub()}))
    """, extra_path=str(tmp_path))
    assert r == {"real": True, "stub": False}


def test_cpu_rng_tracker_and_process_group():
    from backends.cpu.megatron_shims import CpuRNGStatesTracker, init_cpu_process_group, model_parallel_cpu_manual_seed

    init_cpu_process_group(0, 1, tp=1)  # idempotent
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    assert torch.distributed.get_backend() == "gloo"
    assert ps.get_tensor_model_parallel_world_size() == 1
    tracker = model_parallel_cpu_manual_seed(123)
    assert isinstance(mrandom.get_cuda_rng_tracker(), CpuRNGStatesTracker)
    before = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():
        a = torch.randn(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork():
        b = torch.randn(4)
    assert not torch.equal(a, b)  # the forked stream advanced
    model_parallel_cpu_manual_seed(123)
    with mrandom.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.randn(4), a)  # reproducible from the seed (tp rank 0)
    torch.manual_seed(0)


def test_a_target_refuses_a_process_group_of_another_backend():
    """A GPU run started in a process that a CPU job already set up (a gloo group) must not reuse that group:
    NCCL collectives on it crashed a pytest process with a segfault in megatron's parameter all-gather. The
    run refuses with the fix instead; the target's own backend is accepted."""
    import pytest

    from core.assembly import assemble

    from ._helpers import run_config, single_process_group

    single_process_group()
    parts = assemble(run_config())
    assert parts.setup_process() is parts.target                  # gloo for the cpu target: the group is reused

    class NcclTarget:
        distributed_backend = "nccl"

        def setup(self):
            pass

    parts.__dict__["target"] = NcclTarget()                       # the cached handle, as a GPU run would hold it
    with pytest.raises(RuntimeError, match=r"already has a gloo process group.*needs nccl.*Fix: run it in its own"):
        parts.setup_process()
