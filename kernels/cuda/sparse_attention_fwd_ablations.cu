// Timing ablations of the forward kernel (bench/kernels_cuda.py --ablations); their outputs are wrong by design.
#include "sparse_attention_fwd.cuh"

namespace dsv4_cuda {
// no S exchange / softmax
cudaError_t launch_fwd_abl_pv2_nosoftmax(const Params& p, cudaStream_t s) { return launch_sparse_attn_fwd<2, 0, 1>(p, s); }
cudaError_t launch_fwd_abl_pv0_nosoftmax(const Params& p, cudaStream_t s) { return launch_sparse_attn_fwd<0, 0, 1>(p, s); }
// gather only
cudaError_t launch_fwd_abl_gather(const Params& p, cudaStream_t s) { return launch_sparse_attn_fwd<2, 0, 2>(p, s); }
}  // namespace dsv4_cuda
