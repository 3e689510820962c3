"""Model construction for the `miles` implementation (megatron-core modules)."""

from core.not_built import NotBuiltError


def build_model(model_config, run_config):
    """Build the miles DeepSeek-V4 model on megatron-core for ``run_config``."""
    raise NotBuiltError("the miles implementation's megatron-core model", "issue #4")
