// Variant 8 of the forward kernel: persistent, each consumer computes the full S (no exchange), ping-pong = 1,
// PV = 0, lazy rescale (see sparse_attention_fwd.cuh); one per translation unit.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
cudaError_t launch_fwd_v8(const Params& p, cudaStream_t stream) { return launch_sparse_attn_fwd_persistent<0, 0, 1>(p, stream); }
}  // namespace dsv4_cuda
