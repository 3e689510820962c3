// Variant 2 of the forward kernel (PV = 2, PIPE = 0; see sparse_attention_fwd.cuh), one per translation
// unit so that the build compiles them in parallel.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
cudaError_t launch_fwd_v2(const Params& p, cudaStream_t stream) { return launch_sparse_attn_fwd<2, 0>(p, stream); }
}  // namespace dsv4_cuda
