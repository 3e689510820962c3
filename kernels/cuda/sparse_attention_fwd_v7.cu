// Variant 7 of the forward kernel: persistent, PV = 2, lazy rescale (see sparse_attention_fwd.cuh), one per
// translation unit so that the build compiles them in parallel.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
cudaError_t launch_fwd_v7(const Params& p, cudaStream_t stream) { return launch_sparse_attn_fwd_persistent<2>(p, stream); }
}  // namespace dsv4_cuda
