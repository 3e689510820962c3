// Variant 6 of the forward kernel: persistent, PV = 0, lazy rescale (see sparse_attention_fwd.cuh), one per
// translation unit so that the build compiles them in parallel.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
cudaError_t launch_fwd_v6(const Params& p, cudaStream_t stream) { return launch_sparse_attn_fwd_persistent<0>(p, stream); }
}  // namespace dsv4_cuda
