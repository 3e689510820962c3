// Launch parameters of the CUDA sparse attention forward: plain C++, shared by the kernel header
// (sparse_attention_fwd.cuh, nvcc) and the torch binding (binding.cpp, the host compiler).
#pragma once

#include <cuda_runtime_api.h>

namespace dsv4_cuda {

constexpr int kD = 512;   // head dim (= value dim)
constexpr int kBH = 64;   // heads per CTA (wgmma M)

struct Params {
  const void* q;      // [T,H,D] bf16
  const void* kv;     // [Tkv,D] bf16
  const int* idx;     // [T,K] int32, -1 = empty
  const float* sink;  // [H] fp32
  void* o;            // [T,H,D] bf16
  float* lse2;        // [T,H] fp32, log2 units
  int T, H, K;
  float scale_log2;   // scale * log2(e)
};

}  // namespace dsv4_cuda
