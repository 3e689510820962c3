"""Make megatron-core usable on a CPU-only host (no CUDA, no triton), explicitly.

Nothing here runs on import. Call :func:`apply_megatron_cpu_shims` once per process
*before* ``import megatron.core``; it is idempotent and applies three shims (and defers
two costs of importing it, see 4 and 5):

1. **triton stub.** megatron-core imports ``triton`` unconditionally in a few modules
   (e.g. ``transformer/moe/ops/paged_stash.py``), so ``import megatron.core`` fails
   without it. If (and only if) the real triton is not importable, a minimal stub
   package ``triton`` / ``triton.language`` is registered in ``sys.modules``: ``jit`` /
   ``autotune`` / ``heuristics`` are pass-through decorators and every other attribute
   is an inert placeholder, so module-level kernel *definitions* import; calling a
   kernel raises. torch.compile / inductor must not mistake the stub for a real triton:
   the cached ``torch.utils._triton.has_triton_package()`` is evaluated before the stub
   exists (so ``has_triton()`` stays ``False``), and every ``torch.*`` module first
   imported while the stub is installed executes with the stub out of ``sys.modules``,
   so the inductor / dynamo modules that ``try: import triton`` at import time bind
   torch's own no-triton placeholders whenever they are imported (on first use: a
   process that never compiles never imports them). ``is_triton_stub()`` tells the stub
   apart; ``triton.<anything>`` submodules resolve to further stubs.

2. **``torch.cuda.current_device`` answers ``"cpu"``.** megatron allocates scratch
   tensors with ``device=torch.cuda.current_device()``; on a CPU host the stock function
   raises. When CUDA is not available the function is replaced (process-wide, until
   :func:`remove_megatron_cpu_shims`) by one returning the string ``"cpu"``, a valid
   ``device=`` argument. On a CUDA host it is left alone.

3. **RNG tracker on the CPU generator.** megatron's ``CudaRNGStatesTracker`` stores
   and swaps CUDA generator states. :func:`model_parallel_cpu_manual_seed` is the CPU
   replacement of ``tensor_parallel.model_parallel_cuda_manual_seed``: it installs a
   :class:`CpuRNGStatesTracker` (same names: data-parallel, model-parallel and
   expert-parallel states, same seed offsets) whose ``fork()`` swaps the *CPU* default
   generator state, and seeds the CPU generator with the data-parallel seed.

4. **wandb is imported on first use.** ``megatron.core.timers`` runs ``import wandb``
   (when installed) for a writer the CPU runs never pass; that import costs about a
   second of CPU per process. Until something reads an attribute of it, ``wandb`` in
   ``sys.modules`` is a placeholder module; the first lookup (``wandb.init`` in the
   wandb tracker, an ``import wandb.sdk``, ...) imports the real package, which
   replaces the placeholder in ``sys.modules`` and answers every later lookup through
   it. Nothing else changes: the placeholder carries the real module's spec and file.

5. **megatron's compiled functions compile on their first call.** megatron decorates its
   fused ops with ``torch.compile`` when they are imported (``jit_fuser``, the inference
   router), and that decorator alone imports dynamo and inductor (about 3 s of CPU per
   process; the CPU runs call none of those ops). While a ``megatron.*`` module executes,
   ``torch.compile`` is :func:`compile_on_first_call`: the same compile, done when the
   function first runs.

:func:`init_cpu_process_group` starts a gloo process group and the run's layout on top of it
(``engine.layout.initialize``: megatron's model-parallel state; shims applied first).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

__all__ = [
    "apply_megatron_cpu_shims", "remove_megatron_cpu_shims", "shims_applied", "is_triton_stub",
    "CpuRNGStatesTracker", "model_parallel_cpu_manual_seed", "init_cpu_process_group",
    "destroy_cpu_process_group",
]

_STATE = {"applied": False, "orig_current_device": None, "stubbed_triton": False}


# ------------------------------------------------------------------ 1. triton stub
class _Inert:
    """Placeholder for any triton attribute: callable, indexable, usable as a decorator."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Inert(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return _Inert(f"{self._name}(...)")

    def __getitem__(self, item):
        return _Inert(f"{self._name}[...]")

    def __repr__(self):
        return f"<triton CPU stub {self._name}>"


class _StubModule(types.ModuleType):
    """Unknown attributes are inert placeholder *classes* (so ``isinstance(x, stub.Name)`` works
    and is False)."""

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        cls = type(item, (), {"__module__": self.__name__, "__doc__": "triton CPU stub placeholder"})
        setattr(self, item, cls)
        return cls


def _decorator(*args, **kwargs):
    """``@triton.jit`` / ``@triton.jit(...)`` / ``@triton.autotune(...)``: return the function."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _wrap_kernel(args[0])
    return lambda fn: _wrap_kernel(fn)


class _StubKernel:
    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"triton kernel {self.__name__} called, but triton is a CPU stub here "
                           "(backends.cpu.megatron_shims); this code path needs a GPU")


def _wrap_kernel(fn):
    return fn if isinstance(fn, _StubKernel) else _StubKernel(fn)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves any ``triton.<sub>`` submodule as another stub (only while the stub is installed)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("triton.") and is_triton_stub(sys.modules.get("triton")):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _stub_module(spec.name)

    def exec_module(self, module):
        pass


_FINDER = _StubFinder()


def _stub_module(name):
    m = _StubModule(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, _FINDER, origin="backends.cpu.megatron_shims (stub)",
                                                is_package=True)
    m.__file__ = None
    m.__path__ = []  # a package, so "import triton.language" works
    m.__dsv4_cpu_stub__ = True
    return m


def _make_triton_stub():
    module = _stub_module

    triton = module("triton")
    triton.__version__ = "0.0.0+cpustub"
    triton.jit = _decorator
    triton.autotune = _decorator
    triton.heuristics = _decorator
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
    triton.Config = _Inert("triton.Config")
    language = module("triton.language")
    language.constexpr = _Inert("triton.language.constexpr")
    triton.language = language
    return {"triton": triton, "triton.language": language}


def is_triton_stub(mod=None) -> bool:
    mod = sys.modules.get("triton") if mod is None else mod
    return isinstance(mod, _StubModule)


class _WrappingFinder(importlib.abc.MetaPathFinder):
    """Finds the modules named ``names`` (a package and its submodules) as the path finder does, and has
    ``loader`` execute each (while ``active()``): the shims that change how some modules run their import."""

    def __init__(self, names, loader, active=lambda: True):
        self.names, self.prefixes, self.loader, self.active = names, tuple(n + "." for n in names), loader, active

    def find_spec(self, fullname, path=None, target=None):
        if not (fullname in self.names or fullname.startswith(self.prefixes)) or not self.active():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _WrappedLoader):
            spec.loader = self.loader(spec.loader)
        return spec


class _WrappedLoader(importlib.abc.Loader):
    """A module's own loader (every attribute but ``exec_module``: get_source, get_resource_reader, ...)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)


class _StubHidingLoader(_WrappedLoader):
    """Executes a torch module with the triton stub out of ``sys.modules``: torch's inductor, dynamo and flop
    counter ``try: import triton`` when they are first imported (a ``torch.compile`` call, a
    ``FlopCounterMode``) and must see "no triton" then, or they would bind the stub and fail on its
    placeholders. So they can be imported on first use instead of before the stub (about 3 s of CPU per
    process that never compiles)."""

    def exec_module(self, module):
        hidden = {n: m for n, m in sys.modules.items() if (n == "triton" or n.startswith("triton.")) and
                  is_triton_stub(m)}
        for name in hidden:
            del sys.modules[name]
        try:
            self._loader.exec_module(module)
        finally:
            for name, m in hidden.items():
                sys.modules.setdefault(name, m)


_TORCH_FINDER = _WrappingFinder(("torch", "functorch"), _StubHidingLoader, active=is_triton_stub)


def _install_triton_stub() -> None:
    if "triton" in sys.modules:
        return  # real triton already imported, or our stub already there
    if importlib.util.find_spec("triton") is not None:
        return  # the real package is installed: never shadow it
    # torch's cached has_triton_package() (behind has_triton()) answers "no triton" from now on; its modules
    # that probe ``import triton`` when imported run with the stub hidden (_StubHidingLoader)
    from torch.utils import _triton as torch_triton

    torch_triton.has_triton_package()
    if _TORCH_FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _TORCH_FINDER)
    sys.modules.update(_make_triton_stub())
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    _STATE["stubbed_triton"] = True


# ------------------------------------ 5. megatron's compiled functions compiled on first call
class _CompileOnFirstCallLoader(_WrappedLoader):
    """Executes a ``megatron.*`` module with ``torch.compile`` as :func:`compile_on_first_call`: megatron
    decorates its fused ops with ``torch.compile`` when they are imported (``jit_fuser`` in
    ``megatron.core.jit``, the inference router's ``@torch.compile``), and the decorator alone imports dynamo
    and inductor (about 3 s of CPU) in every process, though the CPU runs call none of those functions."""

    def exec_module(self, module):
        if torch.compile is compile_on_first_call:     # a megatron module imported by another one
            return self._loader.exec_module(module)
        real, torch.compile = torch.compile, compile_on_first_call
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real


_REAL_COMPILE = torch.compile


def compile_on_first_call(fn=None, **options):
    """``torch.compile(fn, **options)``, done when the returned function is first called outside a compiled
    region (inside one it runs ``fn`` itself for the outer compile to trace, as torch.compile does with a nested
    compiled function)."""
    if fn is None:                                  # @torch.compile(...) with options
        return lambda f: compile_on_first_call(f, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = _REAL_COMPILE(fn, **options)
        return compiled(*args, **kwargs)

    return call


_COMPILE_FINDER = _WrappingFinder(("megatron",), _CompileOnFirstCallLoader)


def _compile_megatron_functions_on_first_call() -> None:
    if _COMPILE_FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _COMPILE_FINDER)


# ------------------------------------------------- 4. wandb imported on first use
class _DeferredModule(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet; the first attribute lookup imports
    the real module (which takes its place in ``sys.modules``) and every lookup reads from it."""

    def __getattr__(self, attr):
        real = sys.modules.get(self.__name__)
        if real is self or real is None:
            sys.modules.pop(self.__name__, None)
            try:
                real = importlib.import_module(self.__name__)
            except BaseException:
                sys.modules[self.__name__] = self
                raise
        return getattr(real, attr)


_DEFERRED_IMPORTS = ("wandb",)


def _defer_imports() -> None:
    for name in _DEFERRED_IMPORTS:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue                 # not installed: ``import NAME`` keeps raising ImportError
        placeholder = _DeferredModule(name)
        placeholder.__spec__ = spec  # `import NAME` returns it (not being initialized)
        placeholder.__file__ = spec.origin   # inspect.getmodule() scans sys.modules for __file__
        sys.modules[name] = placeholder


# ------------------------------------------------------ 2. current_device -> "cpu"
def _cpu_current_device():
    return "cpu"


def _patch_current_device() -> None:
    if torch.cuda.is_available() or _STATE["orig_current_device"] is not None:
        return
    _STATE["orig_current_device"] = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device


# ------------------------------------------------------------ 3. CPU RNG tracker
def _tracker_base():
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom


class CpuRNGStatesTracker:
    """megatron's RNG-states tracker with states of the CPU default generator.

    Same interface as ``CudaRNGStatesTracker`` (``add``, ``fork``, ``get_states``,
    ``set_states``, ``reset``, ``is_initialized``); installed by
    :func:`model_parallel_cpu_manual_seed`."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator(device="cpu").manual_seed(int(seed)).get_state()

    @contextlib.contextmanager
    def fork(self, name=None):
        if name is None:
            name = _tracker_base()._MODEL_PARALLEL_RNG_TRACKER_NAME
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def model_parallel_cpu_manual_seed(seed: int, tp_rank: int | None = None, ep_rank: int | None = None,
                                   etp_rank: int | None = None) -> CpuRNGStatesTracker:
    """CPU replacement of megatron's ``model_parallel_cuda_manual_seed``.

    Seeds the CPU generator with ``seed`` (data parallel) and installs a
    :class:`CpuRNGStatesTracker` as megatron's global tracker with the model-parallel
    state ``seed + 2718 + tp_rank`` and the expert state ``seed + 1024 + 100 ep + etp``
    (megatron's offsets); the ranks not given are this rank's (``engine.layout``)."""
    from engine.layout import current

    mrandom = _tracker_base()
    layout = current()
    if tp_rank is None:
        tp_rank = layout.tp_rank
    if ep_rank is None:
        ep_rank = layout.ep_rank
    if etp_rank is None:
        etp_rank = layout.etp_rank
    tracker = CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


# ----------------------------------------------------------------------- public
def apply_megatron_cpu_shims() -> None:
    """Apply shims 1, 2, 4 and 5 (idempotent); shim 3 is :func:`model_parallel_cpu_manual_seed`.

    Call before the first ``import megatron.core``. Also sets
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (silences megatron's async-allreduce warning)."""
    if _STATE["applied"]:
        return
    _install_triton_stub()
    _defer_imports()
    _compile_megatron_functions_on_first_call()
    _patch_current_device()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _STATE["applied"] = True


def remove_megatron_cpu_shims() -> None:
    """Undo shim 2 and drop the triton stub from ``sys.modules`` (modules that already
    imported it keep their reference)."""
    if _STATE["orig_current_device"] is not None:
        torch.cuda.current_device = _STATE["orig_current_device"]
        _STATE["orig_current_device"] = None
    if _STATE["stubbed_triton"]:
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            if is_triton_stub(sys.modules[name]):
                del sys.modules[name]
        _STATE["stubbed_triton"] = False
    _STATE["applied"] = False


def shims_applied() -> bool:
    return _STATE["applied"]





def init_cpu_process_group(rank: int = 0, world_size: int = 1, tp: int = 1, *, pp: int = 1, cp: int = 1,
                           ep: int = 1, port: int | None = None, seed: int = 1234,
                           master_addr: str = "127.0.0.1", store=None):
    """Apply the shims, start a gloo process group (``MASTER_ADDR``/``MASTER_PORT`` from the
    arguments or the environment; a one-process world uses an in-memory store, so
    concurrent single-process jobs never race for a TCP port) and initialize
    megatron's model-parallel groups (``tp``, ``pp``, ``cp``, ``ep``; data parallel takes
    the rest) through the run's layout (``engine.layout.initialize``), then seed the CPU RNG
    tracker. Idempotent for the same world. Returns this rank's layout."""
    apply_megatron_cpu_shims()
    import torch.distributed as dist

    from engine.layout import initialize

    if not dist.is_initialized():
        if store is not None:          # the ranks met on it already (orchestration.dist_env.rendezvous)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        elif world_size == 1 and port is None:      # MASTER_PORT too (a Ray actor's): nothing else joins
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ["MASTER_ADDR"] = master_addr
            if port is not None:
                os.environ["MASTER_PORT"] = str(port)
            elif "MASTER_PORT" not in os.environ:
                raise ValueError("init_cpu_process_group: pass port= (or set MASTER_PORT) for world_size > 1")
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
    layout = initialize(tp, pp=pp, cp=cp, ep=ep)
    model_parallel_cpu_manual_seed(seed)
    return layout


def destroy_cpu_process_group() -> None:
    import torch.distributed as dist

    from engine.layout import destroy

    destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
