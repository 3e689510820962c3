// Variant 3 of the forward kernel (PV = 0, PIPE = 1; see sparse_attention_fwd.cuh), one per translation
// unit so that the build compiles them in parallel.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
cudaError_t launch_fwd_v3(const Params& p, cudaStream_t stream) { return launch_sparse_attn_fwd<0, 1>(p, stream); }
}  // namespace dsv4_cuda
