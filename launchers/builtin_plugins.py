"""The explicit list of built-in plugin modules (one per backend package, one per job's rules).

core/ never imports a backend; the launcher hands this list to the plugin host.
A new built-in backend adds its plugin module here and a dependency in
launchers/BUILD.bazel.
"""

BUILTIN_PLUGINS = (
    # attention implementations
    "backends.miles.plugin",
    "backends.megatron.plugin",
    # hardware targets
    "backends.cpu.plugin",
    "backends.nvidia.plugin",
    "backends.rocm.plugin",
    # kernel backends
    "kernels.reference.plugin",
    "kernels.triton.plugin",
    "kernels.tilelang.plugin",
    "kernels.cuda.plugin",
    "kernels.cudnn.plugin",
    # quantization schemes
    "converters.plugin",
    # rollout engines
    "rollout.plugin",
    # the jobs' own rules of the combination table (dsv4_job_rules): the trainer's, the rollout side's, Ray's
    "train.rules",
    "rollout.rules",
    "orchestration.rules",
)


def make_host(**kwargs):
    """A plugin host with the built-ins plus (by default) third-party plugins."""
    from core.plugins import PluginHost

    return PluginHost(BUILTIN_PLUGINS, **kwargs)
