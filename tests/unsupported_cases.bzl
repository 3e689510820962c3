"""Unsupported combinations and the exact error each must produce.

One test per case in one py_test (tests/matrix.bzl, tests/unsupported_combination_test.py),
which reads this file itself (it is plain data), runs `dsv4 validate ARGS` and the main job
with ARGS, and expects exit status 2 with exactly `error: MESSAGE` on stderr.
"""

UNSUPPORTED_CASES = [
    struct(
        name = "megatron_tp2",
        args = ["--impl", "megatron", "--tp", "2"],
        message = "tensor-parallel size must be 1 for the megatron implementation (got --tp 2): its attention and hyper-connection modules are not tensor-parallel. Fix: use --tp 1, or --impl miles, which supports tensor parallelism.",
    ),
    struct(
        name = "megatron_tilelang",
        args = ["--impl", "megatron", "--kernel-backend", "tilelang", "--hardware", "nvidia"],
        message = "--kernel-backend tilelang does not serve --impl megatron (it serves: miles). Fix: use --impl miles, or with --impl megatron on nvidia choose --kernel-backend cuda, none or triton.",
    ),
    struct(
        name = "megatron_bshd",
        args = ["--impl", "megatron", "--qkv-format", "bshd"],
        message = "--impl megatron supports only --qkv-format thd (got bshd). Fix: use --qkv-format thd, or --impl miles, which supports bshd.",
    ),
    struct(
        name = "miles_cudnn",
        args = ["--impl", "miles", "--kernel-backend", "cudnn", "--hardware", "nvidia"],
        message = "--kernel-backend cudnn is declared but cannot run: not built: the cuDNN-frontend sparse-attention kernels are not written. Fix: choose --kernel-backend none, tilelang or triton.\n--kernel-backend cudnn does not serve --impl miles (it serves: megatron). Fix: use --impl megatron, or with --impl miles on nvidia choose --kernel-backend cuda, none, tilelang or triton.",
    ),
    struct(
        name = "rocm_cudnn",
        args = ["--impl", "megatron", "--kernel-backend", "cudnn", "--hardware", "rocm"],
        message = "--kernel-backend cudnn is declared but cannot run: not built: the cuDNN-frontend sparse-attention kernels are not written. Fix: choose --kernel-backend cuda, none, tilelang or triton. --hardware rocm is declared but cannot run: rules only: the rocm target has no device setup or process groups yet, and no AMD GPU is available to test one. Fix: choose --hardware cpu or nvidia.\n--kernel-backend cudnn does not run on --hardware rocm (it runs on: nvidia). Fix: on rocm choose --kernel-backend none or triton.",
    ),
    struct(
        name = "cuda_tiny_heads",
        args = ["--kernel-backend", "cuda", "--hardware", "nvidia"],
        message = "--kernel-backend cuda: its sparse-attention kernel does not take this model's head_dim=128 (built for 512) and n_heads=4 (a multiple of 64 is needed). Fix: use --kernel-backend triton (any power-of-two head dim), or a model with those attention dims.",
    ),
    struct(
        name = "cpu_triton",
        args = ["--kernel-backend", "triton", "--hardware", "cpu"],
        message = "--kernel-backend triton does not run on --hardware cpu (it runs on: nvidia, rocm). Fix: on cpu choose --kernel-backend none.",
    ),
    struct(
        name = "cpu_tilelang",
        args = ["--kernel-backend", "tilelang", "--hardware", "cpu"],
        message = "--kernel-backend tilelang does not run on --hardware cpu (it runs on: nvidia, rocm). Fix: on cpu choose --kernel-backend none.",
    ),
    struct(
        name = "cpu_cudnn",
        args = ["--impl", "megatron", "--kernel-backend", "cudnn", "--hardware", "cpu"],
        message = "--kernel-backend cudnn is declared but cannot run: not built: the cuDNN-frontend sparse-attention kernels are not written. Fix: choose --kernel-backend none.\n--kernel-backend cudnn does not run on --hardware cpu (it runs on: nvidia). Fix: on cpu choose --kernel-backend none.",
    ),
    struct(
        name = "rocm_nvfp4",
        args = ["--hardware", "rocm", "--quant", "nvfp4"],
        message = "--hardware rocm is declared but cannot run: rules only: the rocm target has no device setup or process groups yet, and no AMD GPU is available to test one. Fix: choose --hardware cpu or nvidia.\n--quant nvfp4 cannot run on --hardware rocm (it runs on: cpu, nvidia). Fix: on rocm choose --quant bf16, fp8, mxfp4-fp8 or qat.",
    ),
    struct(
        name = "unknown_kernel_backend",
        args = ["--kernel-backend", "trton"],
        message = "unknown --kernel-backend 'trton'; valid choices: cuda, cudnn, none, tilelang, triton. Did you mean 'triton'?",
    ),
    struct(
        name = "miles_tp_not_dividing_o_groups",
        args = ["--impl", "miles", "--tp", "3"],
        message = "--tp 3 does not divide the model's o_groups=2 (the grouped output projection is split by groups across tensor-parallel ranks). Fix: use --tp 1 or 2.",
    ),
    struct(
        name = "ep_not_dividing_experts",
        args = ["--ep", "3"],
        message = "--ep 3 does not divide the model's 8 routed experts (each expert-parallel rank holds an equal share). Fix: use --ep 1, 2, 4 or 8.",
    ),
    struct(
        name = "ep_with_tensor_parallel",
        args = ["--impl", "miles", "--tp", "2", "--ep", "2"],
        message = "--ep 2 runs with --tp 1 --cp 1 (got --tp 2 --cp 1): expert parallelism is not combined with tensor or context parallelism. Fix: use --ep 2 alone, or --ep 1.",
    ),
    struct(
        name = "unknown_model",
        args = ["--model", "gigantic"],
        message = "--model 'gigantic' is neither a checkpoint directory nor a preset; presets: flash, flash-4layer, flash-shaped, pro, tiny, tiny-wide-heads",
    ),
    struct(
        name = "context_parallel_too_few_tokens_per_rank",
        args = ["--cp", "2", "--qkv-format", "thd", "--max-tokens-per-rank", "64"],
        message = "--cp 2 with --max-tokens-per-rank 64 gives each context-parallel rank fewer tokens than the compressor boundary width 128 of compress ratio 128 (each rank takes that many rows from the previous rank). Fix: use --max-tokens-per-rank 128 or more, or --cp 1.",
    ),
    struct(
        name = "cudnn_not_built",
        args = ["--impl", "megatron", "--kernel-backend", "cudnn", "--hardware", "nvidia"],
        message = "--kernel-backend cudnn is declared but cannot run: not built: the cuDNN-frontend sparse-attention kernels are not written. Fix: choose --kernel-backend none or triton.",
    ),
    struct(
        name = "rocm_rules_only",
        args = ["--hardware", "rocm"],
        message = "--hardware rocm is declared but cannot run: rules only: the rocm target has no device setup or process groups yet, and no AMD GPU is available to test one. Fix: choose --hardware cpu or nvidia.",
    ),
    struct(
        name = "triton_fp32",
        args = ["--impl", "megatron", "--kernel-backend", "triton", "--hardware", "nvidia", "--dtype", "fp32"],
        message = "--kernel-backend triton computes in bf16 only (got --dtype fp32). Fix: use --dtype bf16, or --kernel-backend none.",
    ),
    struct(
        name = "sglang_on_cpu",
        args = ["--rollout-engine", "sglang"],
        message = "--rollout-engine sglang needs a GPU (got --hardware cpu). Fix: use a GPU --hardware, connect to a running sglang server with --rollout-url URL, or --rollout-engine reference.",
    ),
]
