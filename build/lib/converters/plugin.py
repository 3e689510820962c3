"""Registers the built-in quantization schemes.

Each scheme declares where it can run; the combination table rejects the rest.
NVFP4 is an NVIDIA format (e4m3 block scales): it runs on NVIDIA GPUs, and its
quantize-dequantize reference runs on the CPU; ROCm uses MXFP4 instead.
"""

from core.hookspecs import hookimpl
from core.records import QuantScheme


@hookimpl
def dsv4_quant_schemes():
    return [
        QuantScheme(
            name="bf16",
            description="bf16 weights and training (fp32-kept tensors stay fp32)",
            factory="converters.schemes:bf16",
        ),
        QuantScheme(
            name="fp8",
            description="FP8 e4m3 weights in 128x128 blocks (ue8m0 or fp32 scales); dequantized to train, re-quantized to publish",
            factory="converters.schemes:fp8",
            publish_format="fp8",
        ),
        QuantScheme(
            name="mxfp4-fp8",
            description="MXFP4 routed experts converted losslessly to FP8 128x128 blocks at prepare time",
            factory="converters.schemes:mxfp4_fp8",
            prepare_stage="prepare-fp8",
            publish_format="fp8",
        ),
        QuantScheme(
            name="nvfp4",
            description="NVFP4 routed experts only (1x16 e4m3 scales + fp32 global); shared experts stay high precision",
            factory="converters.schemes:nvfp4",
            hardware={"nvidia", "cpu"},
            publish_format="nvfp4",
        ),
        QuantScheme(
            name="qat",
            description="fake-quant training: quantize-dequantize with straight-through gradients (experts, KV nope dims)",
            factory="converters.schemes:qat",
        ),
    ]
