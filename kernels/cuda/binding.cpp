// torch glue of the CUDA sparse attention forward (kernels/cuda/sparse_attention_fwd.cuh).
// The Python side (kernels/cuda/attention.py) checks the inputs and allocates the outputs; this file only
// re-checks what would make the kernel read or write out of bounds, and launches on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "sparse_attention_params.h"

namespace dsv4_cuda {
cudaError_t launch_fwd_v0(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v1(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v2(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v3(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v4(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v5(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v6(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v7(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v8(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_v9(const Params& p, cudaStream_t stream);
cudaError_t launch_fwd_abl_pv2_nosoftmax(const Params& p, cudaStream_t s);
cudaError_t launch_fwd_abl_pv0_nosoftmax(const Params& p, cudaStream_t s);
cudaError_t launch_fwd_abl_gather(const Params& p, cudaStream_t s);
}  // namespace dsv4_cuda

static void fwd(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& idx, const torch::Tensor& sink,
                torch::Tensor& o, torch::Tensor& lse2, double scale, int64_t variant) {
  TORCH_CHECK(q.is_cuda() && kv.is_cuda() && idx.is_cuda() && sink.is_cuda() && o.is_cuda() && lse2.is_cuda(),
              "CUDA tensors expected");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16 &&
                  o.scalar_type() == at::kBFloat16, "bf16 q, kv, o expected");
  TORCH_CHECK(idx.scalar_type() == at::kInt && sink.scalar_type() == at::kFloat && lse2.scalar_type() == at::kFloat,
              "int32 idx, fp32 sink and lse2 expected");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 2 && idx.dim() == 2 && sink.dim() == 1, "q [T,H,D], kv [Tkv,D], idx [T,K], sink [H]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), K = idx.size(1);
  TORCH_CHECK(D == dsv4_cuda::kD && kv.size(1) == D, "head dim 512 expected");
  TORCH_CHECK(H % dsv4_cuda::kBH == 0 && sink.size(0) == H && idx.size(0) == T, "H a multiple of 64, shapes agree");
  TORCH_CHECK(o.sizes() == q.sizes() && lse2.dim() == 2 && lse2.size(0) == T && lse2.size(1) == H, "output shapes");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && idx.is_contiguous() && sink.is_contiguous() &&
                  o.is_contiguous() && lse2.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(T * (H / dsv4_cuda::kBH) < (int64_t(1) << 31) && K < (int64_t(1) << 30), "too many tokens or slots");
  const c10::cuda::CUDAGuard guard(q.device());
  dsv4_cuda::Params p;
  p.q = q.data_ptr();
  p.kv = kv.data_ptr();
  p.idx = idx.data_ptr<int>();
  p.sink = sink.data_ptr<float>();
  p.o = o.data_ptr();
  p.lse2 = lse2.data_ptr<float>();
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.K = static_cast<int>(K);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t e;
  switch (variant) {
    case 0: e = dsv4_cuda::launch_fwd_v0(p, stream); break;
    case 1: e = dsv4_cuda::launch_fwd_v1(p, stream); break;
    case 2: e = dsv4_cuda::launch_fwd_v2(p, stream); break;
    case 3: e = dsv4_cuda::launch_fwd_v3(p, stream); break;
    case 4: e = dsv4_cuda::launch_fwd_v4(p, stream); break;
    case 5: e = dsv4_cuda::launch_fwd_v5(p, stream); break;
    case 6: e = dsv4_cuda::launch_fwd_v6(p, stream); break;
    case 7: e = dsv4_cuda::launch_fwd_v7(p, stream); break;
    case 8: e = dsv4_cuda::launch_fwd_v8(p, stream); break;
    case 9: e = dsv4_cuda::launch_fwd_v9(p, stream); break;
    // timing ablations (wrong outputs by design): bench/kernels_cuda.py --ablations
    case 102: e = dsv4_cuda::launch_fwd_abl_pv2_nosoftmax(p, stream); break;
    case 100: e = dsv4_cuda::launch_fwd_abl_pv0_nosoftmax(p, stream); break;
    case 200: e = dsv4_cuda::launch_fwd_abl_gather(p, stream); break;
    default: TORCH_CHECK(false, "variant must be 0..9 (or an ablation: 100, 102, 200)");
  }
  TORCH_CHECK(e == cudaSuccess, "sparse_attn_fwd launch failed: ", cudaGetErrorString(e));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &fwd, "sparse MQA attention forward with sink (sm_90a)");
}
