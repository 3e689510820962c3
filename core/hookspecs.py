"""The hook specifications every dsv4 plugin implements.

One hook per configuration axis. Each returns a list of typed records
(core/records.py); a plugin module implements any subset of them with
``@hookimpl``. One more hook, ``dsv4_job_rules``, adds a job's rules to the
combination table (core/combinations.py). Built-in plugins are listed in core/plugins.py; third-party
distributions register a module under the entry-point group ``dsv4.plugins``:

    [project.entry-points."dsv4.plugins"]
    my_kernels = "my_package.dsv4_plugin"
"""

from __future__ import annotations

import pluggy

PROJECT = "dsv4"
ENTRY_POINT_GROUP = "dsv4.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dsv4_attention_impls() -> list:
    """Return AttentionImpl records (whole model paths built on megatron-core)."""


@hookspec
def dsv4_kernel_backends() -> list:
    """Return KernelBackend records (sparse attention, indexer, compressor, mHC kernels)."""


@hookspec
def dsv4_quant_schemes() -> list:
    """Return QuantScheme records (weight formats and quantized training)."""


@hookspec
def dsv4_hardware_targets() -> list:
    """Return HardwareTarget records (devices, process groups, device shims)."""


@hookspec
def dsv4_rollout_engines() -> list:
    """Return RolloutEngine records (engines that generate rollouts and take weight updates)."""


@hookspec
def dsv4_job_rules() -> list:
    """Return Rule records (core.combinations.Rule): a job's own rules (the trainer's, the rollout side's, an
    orchestrator's), checked with the combination table's axis-capability rules."""


# The hook that adds rules to the combination table (core.combinations.table_rules).
RULES_HOOK = "dsv4_job_rules"

# Hook name -> axis (core.records.AXES) it feeds.
HOOK_AXIS = {
    "dsv4_attention_impls": "attention_impl",
    "dsv4_kernel_backends": "kernel_backend",
    "dsv4_quant_schemes": "quant_scheme",
    "dsv4_hardware_targets": "hardware_target",
    "dsv4_rollout_engines": "rollout_engine",
}
