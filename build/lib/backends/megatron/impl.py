"""Model construction for the `megatron` implementation (Megatron-native design).

Public API:

* ``build_model(model_config, run_config, *, ops, params_dtype=torch.float32, dsa_indexer_loss_coeff=None,
  initialize=True, **config_overrides) -> DSv4NativeModel``; ``ops`` is the run's kernel op table, handed in
  by the assembly step (``core.assembly``). ``initialize=False`` (megatron-core's
  ``perform_initialization``, honoured by the modules here too) skips the random draws, for a model a
  checkpoint fills: the assembly step then fills every weight with NaN.
* ``load_hf_checkpoint(model, path)``: an official (HF) checkpoint into the native names, through
  ``core.weight_contract.hf_to_native``.
* ``native_state(model)``: ``{native name: tensor}`` (parameters + persistent buffers).

The process must already be set up for megatron-core (the hardware target initializes the
process groups with tensor-parallel size 1 before a model is built).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["build_model", "load_hf_checkpoint", "native_state"]


def _check_cp_group(run_config) -> None:
    """megatron's context-parallel group (set up by the hardware target) must match the run's ``--cp``."""
    from engine.thd_attention import cp_group_info

    cp = int(getattr(run_config, "cp", 1) or 1)
    if cp_group_info()[0] != cp:
        raise ValueError(f"the run asks for context-parallel size {cp} but megatron is initialized with "
                         f"{cp_group_info()[0]}; call the hardware target's init_process_group(..., cp={cp})")


def build_model(model_config, run_config, *, ops, params_dtype: torch.dtype = torch.float32,
                dsa_indexer_loss_coeff: Optional[float] = None, initialize: bool = True, **config_overrides):
    """Build the Megatron-native DeepSeek-V4 model for ``run_config`` (tensor parallel 1, THD).

    ``dsa_indexer_loss_coeff``: weight of the indexer KL loss (``None`` = off: no loss is computed)."""
    _check_cp_group(run_config)
    from .config import native_config
    from .model import DSv4NativeModel

    config_overrides.setdefault("dsa_kernel_backend", run_config.kernel_backend)
    cfg = native_config(model_config, run_config, params_dtype=params_dtype,
                        dsa_indexer_loss_coeff=dsa_indexer_loss_coeff, perform_initialization=initialize,
                        **config_overrides)
    return DSv4NativeModel(cfg, ops=ops)


def native_state(model) -> Dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their native names (megatron linears' ``_extra_state``
    placeholders are not tensors of the model and are left out)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("._extra_state")}


def load_hf_checkpoint(model, path) -> None:
    """Load an official-format checkpoint (any weight format; dequantized) into ``model``, strictly
    (every native tensor exactly once), through the shared loader ``engine.loading`` and the weight
    contract (``core.weight_contract.hf_to_native``)."""
    from engine.loading import load_hf_checkpoint as _load

    _load(model, path, model.config.dsv4_model_config, strict=True)
