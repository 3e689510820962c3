"""Model construction for the `megatron` implementation (Megatron-native design)."""

from core.not_built import NotBuiltError


def build_model(model_config, run_config):
    """Build the Megatron-native DeepSeek-V4 model for ``run_config``."""
    raise NotBuiltError("the megatron implementation's model", "issue #4")
