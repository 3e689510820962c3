"""Model construction for the `miles` implementation (megatron-core modules).

``build_model(model_config, run_config, *, ops, params_dtype=torch.float32, freeze_indexer=True)``
returns a :class:`backends.miles.model.DeepSeekV4MilesModel` for this process's TP rank.

* ``ops``: the run's kernel op table, handed in by the assembly step (``core.assembly``); every
  DeepSeek-V4 op of the model (sparse attention, indexer scores, mHC, Hadamard) goes through it.
  ``run_config`` is a normalized RunConfig.
* The hardware target must have set the process up first (``target.init_process_group(rank,
  world, tp=...)``; on the CPU that also applies megatron-core's shims): megatron's
  model-parallel state must exist for ``run_config.tp``.
* Layouts: BSHD (``model(ids [B, S])``) and THD (``model(ids [1, T], cu_seqlens=cu)``); context
  parallelism (``--cp``, megatron's CP group) for both (see ``backends.miles.model``); expert parallelism
  (``--ep``, tensor and context parallel 1: ``engine.expert_parallel``).
* Weights are randomly initialized (normal(0, 0.02); norms / alphas 1; sinks, ape, biases 0);
  load a checkpoint with ``engine.loading.load_hf_checkpoint(model, path)``. ``initialize=False`` skips the
  random draws (megatron-core's ``perform_initialization`` and ``std=None`` for the modules here), for a
  model a checkpoint fills: the assembly step (``core.assembly``) then fills every weight with NaN.
"""

from __future__ import annotations

import torch


def _check_cp(cp: int) -> None:
    """megatron's context-parallel group must match the run's ``--cp``."""
    from engine.thd_attention import cp_group_info

    have = cp_group_info()[0]
    if have != cp:
        raise ValueError(f"the run asks for context-parallel size {cp} but megatron is initialized with {have}; "
                         f"call the hardware target's init_process_group(rank, world, tp=..., cp={cp})")


def build_model(model_config, run_config, *, ops, params_dtype=torch.float32, freeze_indexer: bool = True,
                init_std: float = 0.02, initialize: bool = True):
    """Build the miles DeepSeek-V4 model on megatron-core for ``run_config``."""
    from engine.config import make_transformer_config, parallel_sizes
    from engine.runtime import ensure_parallel_state

    from .model import DeepSeekV4MilesModel

    if model_config is None:
        model_config = getattr(run_config, "model", None)
    if model_config is None:
        raise ValueError("build_model needs a ModelConfig")
    p = parallel_sizes(run_config)
    ensure_parallel_state(p["tp"], p["ep"])
    _check_cp(p["cp"])
    tconfig = make_transformer_config(model_config, run_config, params_dtype=params_dtype,
                                      init_method_std=init_std, perform_initialization=initialize)
    return DeepSeekV4MilesModel(model_config, tconfig, ops, params_dtype, init_std if initialize else None,
                                freeze_indexer)
