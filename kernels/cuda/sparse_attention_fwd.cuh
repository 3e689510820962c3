// Sparse MQA attention forward with an attention sink, for NVIDIA Hopper (sm_90a).
//
// Contract (kernels/reference/attention.py::sparse_attention_with_sink, THD layout, the same as
// kernels/triton/attention.py::sparse_attention_fwd):
//   q [T,H,D] bf16, kv [Tkv,D] bf16 (one shared K=V head), idx [T,K] int32 (-1 = empty slot),
//   sink [H] fp32 (a logit, not scaled), D = 512, H a multiple of 64.
//   z_j = scale*<q[t,h], kv[idx[t,j]]>, m = max(max_j z_j, sink_h),
//   Z = sum_j exp(z_j-m) + exp(sink_h-m), o = sum_j exp(z_j-m)/Z kv[idx[t,j]],
//   lse2 = (m + log Z) * log2(e)   (log2 units, fp32).
//
// Structure: one CTA = one query token x 64 heads (one wgmma M tile), 384 threads = 3 warpgroups.
//   warpgroup 0 (producer): loads Q once, then gathers the selected KV rows of each 64-slot tile into a
//     2-stage shared-memory ring with 16-byte cp.async (zero-fill for empty slots), 128-byte swizzle;
//     after its copies land it fences the async proxy and arrives on the stage's "full" mbarrier.
//   warpgroups 1, 2 (consumers c = 0, 1): consumer c owns D columns [256c, 256c+256).
//     S_c = Q[:, cols_c] . KV[:, cols_c]^T  (wgmma m64n64k16, A and B from shared memory, K-major),
//     partial S exchanged through shared memory and summed (fp32 addition is commutative, so both
//     consumers hold bitwise the same S), online softmax in log2 units (running max starts at the sink,
//     running sum at 1 = the sink's own term), P -> bf16 register fragments,
//     O_c += P . KV[:, cols_c]  (wgmma RS form, B = the same KV tile read MN-major).
//   O [64, 256] fp32 per consumer lives in registers (128 per thread); setmaxnreg gives the consumers
//   232 registers and the producer 40.
// Shared memory: Q 64 KB + 2 KV stages x 64 KB + 2 x 16 KB S-exchange buffers + barriers = ~225 KB.
//
// This header needs only the CUDA toolkit (no torch): kernels/cuda/*.cu instantiate it, and
// kernels/cuda/binding.cpp is the torch glue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sparse_attention_params.h"

namespace dsv4_cuda {

constexpr int kBK = 64;            // KV slots per tile
constexpr int kStages = 2;
constexpr int kThreads = 384;
constexpr int kBlockBytes = kBK * 128;          // one 64-column block of a 64-row tile: 8 KB
constexpr int kTileBytes = kBK * kD * 2;        // 64 KB
constexpr int kQBytes = kBH * kD * 2;           // 64 KB
constexpr int kXBytes = kBH * kBK * 4;          // one consumer's partial S, fp32: 16 KB
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kQBytes;
constexpr int kOffX = kOffKV + kStages * kTileBytes;
constexpr int kOffBar = kOffX + 2 * kXBytes;     // full[2], empty[2] (8 B each), masks[2] (8 B each)
constexpr int kSmemUsed = kOffBar + 64;
constexpr int kSmemBytes = kSmemUsed + 1024;     // + slack to align the base to 1024 B

// PV variants (how O += P.V is issued); every variant computes the same function.
//   0: one m64n256k16 per 16 rows, MN-major B, LBO = 8192 (64-column block stride), SBO = 1024
//   1: the same with the two offsets swapped (LBO = 1024, SBO = 8192)
//   2: four m64n64k16 per 16 rows (N = 64 = one swizzle row, so the block stride is never used;
//      LBO = SBO = 1024)

// ------------------------------------------------------------------------------------------------
// PTX helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile(
      "{\n .reg .b64 st;\n mbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}" ::"r"(bar)
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      " .reg .pred p;\n"
      " WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n"
      "}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits), .y = hi
  return *reinterpret_cast<uint32_t*>(&v);
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // SWIZZLE_128B
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// D[64x64] (+)= A[64x16] (smem, K-major) . B[64x16]^T (smem, K-major)
__device__ __forceinline__ void wgmma_ss_m64n64k16(float* d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}

// D[64x64] += A[64x16] (registers) . B[16x64] (smem, MN-major)
__device__ __forceinline__ void wgmma_rs_m64n64k16(float* d, const uint32_t* a, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64x256] += A[64x16] (registers) . B[16x256] (smem, MN-major)
__device__ __forceinline__ void wgmma_rs_m64n256k16(float* d, const uint32_t* a, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
        "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),
        "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
        "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),
        "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),
        "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
        "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),
        "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),
        "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Byte offset of element (row, col) of a [rows x 512] bf16 tile stored as 8 blocks of 64 columns,
// each block [rows][128 B] with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)).
__device__ __forceinline__ uint32_t tile_off(int row, int chunk /* 16-byte chunk, 0..63 */) {
  return static_cast<uint32_t>((chunk >> 3) * kBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// ------------------------------------------------------------------------------------------------
// consumer pieces (one consumer warpgroup; fragment of thread (warp, lane): rows r0 = 16*warp + lane/4 and
// r0 + 8, columns 8j + 2*(lane%4) + {0,1}; register 4j + 2i + c of an accumulator is (row r0 + 8i, column
// 8j + 2*(lane%4) + c))
// ------------------------------------------------------------------------------------------------

// S_partial[64x64] = Q[:, 256cw:256cw+256] . KV_tile[:, 256cw:256cw+256]^T   (16 wgmma k-steps)
__device__ __forceinline__ void issue_s(float (&sacc)[32], uint32_t sQ, uint32_t stage, int cw) {
  const uint64_t dq = make_desc(sQ + cw * 4 * kBlockBytes, 16, 1024);
  const uint64_t dk = make_desc(stage + cw * 4 * kBlockBytes, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < 16; ++kk) {
    const uint64_t off = static_cast<uint64_t>(((kk >> 2) * kBlockBytes + (kk & 3) * 32) >> 4);
    wgmma_ss_m64n64k16(sacc, dq + off, dk + off, kk > 0);
  }
}

// S[64x64] = Q . KV_tile^T over all of D (32 wgmma k-steps): each consumer its own full S, no exchange
__device__ __forceinline__ void issue_s_full(float (&sacc)[32], uint32_t sQ, uint32_t stage) {
  const uint64_t dq = make_desc(sQ, 16, 1024);
  const uint64_t dk = make_desc(stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < 32; ++kk) {
    const uint64_t off = static_cast<uint64_t>(((kk >> 2) * kBlockBytes + (kk & 3) * 32) >> 4);
    wgmma_ss_m64n64k16(sacc, dq + off, dk + off, kk > 0);
  }
}

// O[64x256] += P[64x64] . KV_tile[:, 256cw:256cw+256]   (4 k-steps of 16 rows)
template <int PV>
__device__ __forceinline__ void issue_pv(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t stage, int cw) {
  const uint32_t vbase = stage + cw * 4 * kBlockBytes;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t vaddr = vbase + kk * 16 * 128;
    if constexpr (PV == 0) {
      wgmma_rs_m64n256k16(o, pa[kk], make_desc(vaddr, kBlockBytes, 1024));
    } else if constexpr (PV == 1) {
      wgmma_rs_m64n256k16(o, pa[kk], make_desc(vaddr, 1024, kBlockBytes));
    } else {
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
        wgmma_rs_m64n64k16(o + 32 * nb, pa[kk], make_desc(vaddr + nb * kBlockBytes, 1024, 1024));
    }
  }
}

// Sum the two consumers' partial S through shared memory (both end with bitwise the same S: fp32 addition
// is commutative). Named barriers: BAR_X (256) = both partials written; FREE_c (256) = consumer c's buffer
// has been read by the other one (the other arrives, c syncs).
__device__ __forceinline__ void exchange_s(float (&sacc)[32], float4* xmine, const float4* xother, int ctid,
                                           int bar_free_mine, int bar_free_other) {
  named_sync(bar_free_mine, 256);
#pragma unroll
  for (int v = 0; v < 8; ++v)
    xmine[v * 128 + ctid] = make_float4(sacc[4 * v], sacc[4 * v + 1], sacc[4 * v + 2], sacc[4 * v + 3]);
  named_sync(1, 256);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const float4 x = xother[v * 128 + ctid];
    sacc[4 * v] += x.x;
    sacc[4 * v + 1] += x.y;
    sacc[4 * v + 2] += x.z;
    sacc[4 * v + 3] += x.w;
  }
  named_arrive(bar_free_other, 256);
}

// Empty slots get -inf: column 8j + 2*q4 + c is slot 2*(4j + q4) + c; mk.x / mk.y = even / odd slot bits.
__device__ __forceinline__ void mask_s(float (&sacc)[32], uint2 mk, int q4) {
  if ((mk.x & mk.y) != 0xffffffffu) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool ve = (mk.x >> (4 * j + q4)) & 1u;
      const bool vo = (mk.y >> (4 * j + q4)) & 1u;
      if (!ve) { sacc[4 * j + 0] = -INFINITY; sacc[4 * j + 2] = -INFINITY; }
      if (!vo) { sacc[4 * j + 1] = -INFINITY; sacc[4 * j + 3] = -INFINITY; }
    }
  }
}

// Online softmax in log2 units: sacc (raw S) -> exp2(S*sl2 - m_new) in place; m2, l updated; alpha =
// exp2(m_old - m_new) for rescaling O. l is this thread's partial row sum (summed over the quad at the end).
__device__ __forceinline__ void softmax_s(float (&sacc)[32], float (&m2)[2], float (&l)[2], float (&alpha)[2],
                                          float sl2) {
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * i2], sacc[4 * j + 2 * i2 + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m2[i2], mx * sl2);
    const float mu = (mnew == -INFINITY) ? 0.f : mnew;
    alpha[i2] = ex2(m2[i2] - mu);
    m2[i2] = mnew;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = ex2(fmaf(sacc[4 * j + 2 * i2], sl2, -mu));
      const float b = ex2(fmaf(sacc[4 * j + 2 * i2 + 1], sl2, -mu));
      sacc[4 * j + 2 * i2] = a;
      sacc[4 * j + 2 * i2 + 1] = b;
      sum += a + b;
    }
    l[i2] = l[i2] * alpha[i2] + sum;
  }
}

__device__ __forceinline__ void rescale_o(float (&o)[128], const float (&alpha)[2]) {
#pragma unroll
  for (int k = 0; k < 128; ++k) o[k] *= alpha[(k >> 1) & 1];
}

// Lazy variant: the running max moves only when a row's max exceeds it by more than kLazyTh (log2 units), so
// P <= 2^kLazyTh; the result is exact (o and lse use the same stale max in numerator and denominator).
// Returns whether any row of this warp moved (then O must be rescaled; each warp decides for its own rows).
constexpr float kLazyTh = 8.f;
__device__ __forceinline__ bool softmax_s_lazy(float (&sacc)[32], float (&m2)[2], float (&l)[2], float (&alpha)[2],
                                               float sl2) {
  bool moved = false;
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * i2], sacc[4 * j + 2 * i2 + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float cand = mx * sl2;
    const bool up = cand > m2[i2] + kLazyTh;  // false for cand = -inf; true for a finite cand over m2 = -inf
    const float mnew = up ? cand : m2[i2];
    moved |= up;
    const float mu = (mnew == -INFINITY) ? 0.f : mnew;
    alpha[i2] = up ? ex2(m2[i2] - mu) : 1.f;
    m2[i2] = mnew;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = ex2(fmaf(sacc[4 * j + 2 * i2], sl2, -mu));
      const float b = ex2(fmaf(sacc[4 * j + 2 * i2 + 1], sl2, -mu));
      sacc[4 * j + 2 * i2] = a;
      sacc[4 * j + 2 * i2 + 1] = b;
      sum += a + b;
    }
    l[i2] = l[i2] * alpha[i2] + sum;
  }
  return __any_sync(0xffffffffu, moved);
}

// P (fp32 accumulator layout) -> bf16 A fragments of the four 16-row k-steps of P.V
__device__ __forceinline__ void pack_p(uint32_t (&pa)[4][4], const float (&sacc)[32]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = pack_bf16(sacc[8 * kk + 0], sacc[8 * kk + 1]);
    pa[kk][1] = pack_bf16(sacc[8 * kk + 2], sacc[8 * kk + 3]);
    pa[kk][2] = pack_bf16(sacc[8 * kk + 4], sacc[8 * kk + 5]);
    pa[kk][3] = pack_bf16(sacc[8 * kk + 6], sacc[8 * kk + 7]);
  }
}

// ------------------------------------------------------------------------------------------------
// the kernel
// ------------------------------------------------------------------------------------------------

// PV: how O += P.V is issued (above). PIPE: 0 = each tile in order (S, exchange, softmax, P.V, wait);
// 1 = S of tile i+1 is issued before P.V of tile i, so the exchange and softmax of tile i+1 run while the
// tensor cores do P.V of tile i (O is rescaled once that P.V has completed).
// MODE (timing ablations only, PIPE = 0; the numbers they produce are wrong): 0 = the kernel; 1 = consumers
// skip the S exchange and the softmax (P = raw S); 2 = consumers only wait for each tile and release it.
template <int PV, int PIPE, int MODE>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  // align the working area to 1024 B (the 128-byte swizzle atom)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);

  const uint32_t sQ = base + kOffQ;
  const uint32_t sKV = base + kOffKV;
  const uint32_t bar_full = base + kOffBar;        // + 8*s
  const uint32_t bar_empty = base + kOffBar + 16;  // + 8*s
  uint2* masks = reinterpret_cast<uint2*>(smem + kOffBar + 32);  // [2]
  float* xbuf = reinterpret_cast<float*>(smem + kOffX);            // [2][kBH*kBK]

  const int HB = p.H / kBH;
  const int hb = blockIdx.x % HB;
  const int t = blockIdx.x / HB;
  const int h0 = hb * kBH;
  const int K = p.K;
  const int ntiles = (K + kBK - 1) / kBK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_full + 0, 128);
    mbar_init(bar_full + 8, 128);
    mbar_init(bar_empty + 0, 256);
    mbar_init(bar_empty + 8, 256);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<40>();
    const int ptid = threadIdx.x;  // 0..127
    const int lane = ptid & 31;
    const int half = ptid >> 6;    // row parity this thread copies
    const int chunk = ptid & 63;   // 16-byte chunk of the 1 KB row
    const int* idx_row = p.idx + static_cast<int64_t>(t) * K;
    const __nv_bfloat16* kvp = static_cast<const __nv_bfloat16*>(p.kv);

    // Q: 64 rows (heads h0..h0+63) x 1 KB, contiguous in global memory; it lands with tile 0 (no tile:
    // no Q, so that no copy is still in flight when the consumers reuse its space for O)
    if (ntiles > 0) {
      const __nv_bfloat16* qsrc =
          static_cast<const __nv_bfloat16*>(p.q) + (static_cast<int64_t>(t) * p.H + h0) * kD + chunk * 8;
#pragma unroll 8
      for (int it = 0; it < 32; ++it) {
        const int row = 2 * it + half;
        cp_async16(sQ + tile_off(row, chunk), qsrc + row * kD, 16);
      }
    }

    for (int i = 0; i < ntiles; ++i) {
      const int s = i & 1;
      if (i >= kStages) mbar_wait(bar_empty + 8 * s, ((i >> 1) + 1) & 1);
      const int k0 = i * kBK;
      const int e = k0 + 2 * lane, o1 = e + 1;
      const int v0 = (e < K) ? __ldg(idx_row + e) : -1;
      const int v1 = (o1 < K) ? __ldg(idx_row + o1) : -1;
      const unsigned em = __ballot_sync(0xffffffffu, v0 >= 0);
      const unsigned om = __ballot_sync(0xffffffffu, v1 >= 0);
      const int my = half ? v1 : v0;
      const uint32_t stage = sKV + s * kTileBytes;
#pragma unroll 8
      for (int it = 0; it < 32; ++it) {
        const int r = __shfl_sync(0xffffffffu, my, it);
        const int row = 2 * it + half;
        const bool ok = r >= 0;
        const __nv_bfloat16* src = kvp + (ok ? static_cast<int64_t>(r) * kD + chunk * 8 : 0);
        cp_async16(stage + tile_off(row, chunk), src, ok ? 16u : 0u);  // 0 source bytes = zero fill
      }
      if (ptid == 0) masks[s] = make_uint2(em, om);
      cp_async_commit();
      cp_async_wait_all();
      fence_proxy_async();  // the copies (generic proxy) are read next by wgmma (async proxy)
      mbar_arrive(bar_full + 8 * s);
    }
  } else {
    // ------------------------------------------------------------------ consumers
    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // 0 or 1: D columns [256cw, 256cw+256)
    const int ctid = threadIdx.x - 128 * wg;
    const int warp = ctid >> 5, lane = ctid & 31;
    const int q4 = lane & 3;
    const int r0 = warp * 16 + (lane >> 2);  // rows r0 and r0 + 8 of the 64-head tile
    const float sl2 = p.scale_log2;

    float m2[2], l[2], alpha[2];
    m2[0] = p.sink[h0 + r0] * 1.4426950408889634f;
    m2[1] = p.sink[h0 + r0 + 8] * 1.4426950408889634f;
    l[0] = (q4 == 0) ? 1.f : 0.f;  // the sink's own term exp2(sink2 - m2) = 1, counted once per row
    l[1] = l[0];

    float o[128];
#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.f;
    float sacc[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) sacc[k] = 0.f;
    uint32_t pa[4][4];

    float4* xmine = reinterpret_cast<float4*>(xbuf + cw * (kBH * kBK));
    const float4* xother = reinterpret_cast<const float4*>(xbuf + (1 - cw) * (kBH * kBK));
    const int BAR_FREE_MINE = 2 + cw, BAR_FREE_OTHER = 3 - cw;
    named_arrive(BAR_FREE_OTHER, 256);  // the other consumer's buffer starts free

    if constexpr (PIPE == 0) {
      for (int i = 0; i < ntiles; ++i) {
        const int s = i & 1;
        const uint32_t stage = sKV + s * kTileBytes;
        mbar_wait(bar_full + 8 * s, (i >> 1) & 1);
        if constexpr (MODE == 2) {
          mbar_arrive(bar_empty + 8 * s);
          continue;
        }
        wgmma_fence();
        issue_s(sacc, sQ, stage, cw);
        wgmma_commit();
        wgmma_wait<0>();
        if constexpr (MODE == 0) {
          exchange_s(sacc, xmine, xother, ctid, BAR_FREE_MINE, BAR_FREE_OTHER);
          mask_s(sacc, masks[s], q4);
          softmax_s(sacc, m2, l, alpha, sl2);
          rescale_o(o, alpha);
        }
        pack_p(pa, sacc);
        wgmma_fence();
        issue_pv<PV>(o, pa, stage, cw);
        wgmma_commit();
        wgmma_wait<0>();
        mbar_arrive(bar_empty + 8 * s);
      }
    } else {
      if (ntiles > 0) {
        mbar_wait(bar_full, 0);
        wgmma_fence();
        issue_s(sacc, sQ, sKV, cw);
        wgmma_commit();
        wgmma_wait<0>();
        exchange_s(sacc, xmine, xother, ctid, BAR_FREE_MINE, BAR_FREE_OTHER);
        mask_s(sacc, masks[0], q4);
        softmax_s(sacc, m2, l, alpha, sl2);  // O = 0: no rescale
        pack_p(pa, sacc);
      }
      // tiles 0 .. ntiles-2: P.V of tile i overlaps the exchange and softmax of tile i+1
      for (int i = 0; i + 1 < ntiles; ++i) {
        const int s = i & 1;
        mbar_wait(bar_full + 8 * (s ^ 1), ((i + 1) >> 1) & 1);
        wgmma_fence();
        issue_s(sacc, sQ, sKV + (s ^ 1) * kTileBytes, cw);
        wgmma_commit();
        issue_pv<PV>(o, pa, sKV + s * kTileBytes, cw);
        wgmma_commit();
        wgmma_wait<1>();  // S of tile i+1 is done; P.V of tile i may still run
        exchange_s(sacc, xmine, xother, ctid, BAR_FREE_MINE, BAR_FREE_OTHER);
        mask_s(sacc, masks[s ^ 1], q4);
        softmax_s(sacc, m2, l, alpha, sl2);
        wgmma_wait<0>();
        mbar_arrive(bar_empty + 8 * s);
        rescale_o(o, alpha);
        pack_p(pa, sacc);
      }
      if (ntiles > 0) {  // the last tile's P.V
        const int s = (ntiles - 1) & 1;
        wgmma_fence();
        issue_pv<PV>(o, pa, sKV + s * kTileBytes, cw);
        wgmma_commit();
        wgmma_wait<0>();
        mbar_arrive(bar_empty + 8 * s);
      }
    }
    named_sync(BAR_FREE_MINE, 256);  // balance the last arrive of the other consumer

    // ---- epilogue: normalise, lse, stage O through the (now unused) Q columns of this consumer
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 1);
      l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 2);
    }
    if (cw == 0 && q4 == 0) {
      float* lrow = p.lse2 + static_cast<int64_t>(t) * p.H + h0;
      lrow[r0] = m2[0] + __log2f(l[0]);
      lrow[r0 + 8] = m2[1] + __log2f(l[1]);
    }
    const float inv0 = 1.f / l[0], inv1 = 1.f / l[1];
    uint8_t* sOq = smem + kOffQ;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = cw * 256 + 8 * j + 2 * q4;  // element column in [0, 512)
      const int chunk = col >> 3;
      const uint32_t w = (col & 7) * 2;
      *reinterpret_cast<uint32_t*>(sOq + tile_off(r0, chunk) + w) = pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      *reinterpret_cast<uint32_t*>(sOq + tile_off(r0 + 8, chunk) + w) =
          pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
    named_sync(4 + cw, 128);
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.o) + (static_cast<int64_t>(t) * p.H + h0) * kD + cw * 256;
#pragma unroll
    for (int it = 0; it < 16; ++it) {
      const int L = it * 128 + ctid;
      const int row = L >> 5, c = L & 31;
      const uint4 v = *reinterpret_cast<const uint4*>(sOq + tile_off(row, cw * 32 + c));
      *reinterpret_cast<uint4*>(orow + row * kD + c * 8) = v;
    }
  }
}

// Persistent version (PIPE 0 schedule, lazy rescale): grid = min(items, SMs), each CTA loops over the
// (token, head block) items blockIdx.x, + gridDim.x, ... The KV ring runs on across items, so the producer
// gathers the next item's first tile while the consumers finish the current one; Q of the next item is
// loaded as soon as both consumers have done the last S of the current one (mbarrier q_free, count 256).
// O is stored straight from registers (bf16x2), so the Q space is never reused.
template <int PV, int SPLIT, int PP>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_persistent(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);

  const uint32_t sQ = base + kOffQ;
  const uint32_t sKV = base + kOffKV;
  const uint32_t bar_full = base + kOffBar;        // + 8*s
  const uint32_t bar_empty = base + kOffBar + 16;  // + 8*s
  const uint32_t bar_qfree = base + kOffBar + 48;
  uint2* masks = reinterpret_cast<uint2*>(smem + kOffBar + 32);  // [2]
  float* xbuf = reinterpret_cast<float*>(smem + kOffX);

  const int HB = p.H / kBH;
  const int nitems = p.T * HB;
  const int K = p.K;
  const int ntiles = (K + kBK - 1) / kBK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_full + 0, 128);
    mbar_init(bar_full + 8, 128);
    mbar_init(bar_empty + 0, 256);
    mbar_init(bar_empty + 8, 256);
    mbar_init(bar_qfree, 256);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<40>();
    if (ntiles == 0) return;
    const int ptid = threadIdx.x;
    const int lane = ptid & 31;
    const int half = ptid >> 6;
    const int chunk = ptid & 63;
    const __nv_bfloat16* kvp = static_cast<const __nv_bfloat16*>(p.kv);
    int g = 0;  // tiles issued so far by this CTA (ring position)
    int n = 0;  // items so far
    for (int w = blockIdx.x; w < nitems; w += gridDim.x, ++n) {
      const int hb = w % HB, t = w / HB;
      const int* idx_row = p.idx + static_cast<int64_t>(t) * K;
      for (int i = 0; i < ntiles; ++i, ++g) {
        const int s = g & 1;
        if (g >= kStages) mbar_wait(bar_empty + 8 * s, ((g >> 1) + 1) & 1);
        if (i == 0) {  // Q of this item, in the same copy group as its first tile
          if (n > 0) mbar_wait(bar_qfree, (n - 1) & 1);
          const __nv_bfloat16* qsrc =
              static_cast<const __nv_bfloat16*>(p.q) + (static_cast<int64_t>(t) * p.H + hb * kBH) * kD + chunk * 8;
#pragma unroll 8
          for (int it = 0; it < 32; ++it) {
            const int row = 2 * it + half;
            cp_async16(sQ + tile_off(row, chunk), qsrc + row * kD, 16);
          }
        }
        const int e = i * kBK + 2 * lane, o1 = e + 1;
        const int v0 = (e < K) ? __ldg(idx_row + e) : -1;
        const int v1 = (o1 < K) ? __ldg(idx_row + o1) : -1;
        const unsigned em = __ballot_sync(0xffffffffu, v0 >= 0);
        const unsigned om = __ballot_sync(0xffffffffu, v1 >= 0);
        const int my = half ? v1 : v0;
        const uint32_t stage = sKV + s * kTileBytes;
#pragma unroll 8
        for (int it = 0; it < 32; ++it) {
          const int r = __shfl_sync(0xffffffffu, my, it);
          const int row = 2 * it + half;
          const bool ok = r >= 0;
          const __nv_bfloat16* src = kvp + (ok ? static_cast<int64_t>(r) * kD + chunk * 8 : 0);
          cp_async16(stage + tile_off(row, chunk), src, ok ? 16u : 0u);
        }
        if (ptid == 0) masks[s] = make_uint2(em, om);
        cp_async_commit();
        cp_async_wait_all();
        fence_proxy_async();
        mbar_arrive(bar_full + 8 * s);
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int ctid = threadIdx.x - 128 * wg;
    const int warp = ctid >> 5, lane = ctid & 31;
    const int q4 = lane & 3;
    const int r0 = warp * 16 + (lane >> 2);
    const float sl2 = p.scale_log2;
    float4* xmine = reinterpret_cast<float4*>(xbuf + cw * (kBH * kBK));
    const float4* xother = reinterpret_cast<const float4*>(xbuf + (1 - cw) * (kBH * kBK));
    const int BAR_FREE_MINE = 2 + cw, BAR_FREE_OTHER = 3 - cw;
    if constexpr (SPLIT) named_arrive(BAR_FREE_OTHER, 256);
    // ping-pong (SPLIT = 0, PP = 1): consumer c issues its S only on its turn (named barrier 6 + c), then hands
    // the turn over, so the tensor cores run one consumer's S while the other does its softmax
    const int BAR_TURN_MINE = 6 + cw, BAR_TURN_OTHER = 7 - cw;
    if constexpr (!SPLIT && PP) {
      if (cw == 1) named_arrive(BAR_TURN_OTHER, 256);  // consumer 0 goes first
    }
    int g = 0;
    for (int w = blockIdx.x; w < nitems; w += gridDim.x) {
      const int hb = w % HB, t = w / HB;
      const int h0 = hb * kBH;
      float m2[2], l[2], alpha[2];
      m2[0] = p.sink[h0 + r0] * 1.4426950408889634f;
      m2[1] = p.sink[h0 + r0 + 8] * 1.4426950408889634f;
      l[0] = (q4 == 0) ? 1.f : 0.f;
      l[1] = l[0];
      float o[128];
#pragma unroll
      for (int k = 0; k < 128; ++k) o[k] = 0.f;
      float sacc[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) sacc[k] = 0.f;
      uint32_t pa[4][4];
      for (int i = 0; i < ntiles; ++i, ++g) {
        const int s = g & 1;
        const uint32_t stage = sKV + s * kTileBytes;
        mbar_wait(bar_full + 8 * s, (g >> 1) & 1);
        if constexpr (SPLIT) {
          wgmma_fence();
          issue_s(sacc, sQ, stage, cw);
          wgmma_commit();
          wgmma_wait<0>();
        } else {
          if constexpr (PP) named_sync(BAR_TURN_MINE, 256);
          wgmma_fence();
          issue_s_full(sacc, sQ, stage);
          wgmma_commit();
          if constexpr (PP) named_arrive(BAR_TURN_OTHER, 256);
          wgmma_wait<0>();
        }
        if (i == ntiles - 1) mbar_arrive(bar_qfree);  // this item's Q is no longer read
        if constexpr (SPLIT) exchange_s(sacc, xmine, xother, ctid, BAR_FREE_MINE, BAR_FREE_OTHER);
        mask_s(sacc, masks[s], q4);
        if (softmax_s_lazy(sacc, m2, l, alpha, sl2)) rescale_o(o, alpha);
        pack_p(pa, sacc);
        wgmma_fence();
        issue_pv<PV>(o, pa, stage, cw);
        wgmma_commit();
        wgmma_wait<0>();
        mbar_arrive(bar_empty + 8 * s);
      }
      // epilogue: straight from registers (bf16x2 per thread; 8 rows x 16 B per warp store)
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 1);
        l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 2);
      }
      if (cw == 0 && q4 == 0) {
        float* lrow = p.lse2 + static_cast<int64_t>(t) * p.H + h0;
        lrow[r0] = m2[0] + __log2f(l[0]);
        lrow[r0 + 8] = m2[1] + __log2f(l[1]);
      }
      const float inv0 = 1.f / l[0], inv1 = 1.f / l[1];
      __nv_bfloat16* orow0 = static_cast<__nv_bfloat16*>(p.o) + (static_cast<int64_t>(t) * p.H + h0 + r0) * kD +
                             cw * 256 + 2 * q4;
      __nv_bfloat16* orow1 = orow0 + 8 * kD;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<uint32_t*>(orow0 + 8 * j) = pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        *reinterpret_cast<uint32_t*>(orow1 + 8 * j) = pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      }
    }
    if constexpr (SPLIT) named_sync(BAR_FREE_MINE, 256);
    if constexpr (!SPLIT && PP) {
      if (cw == 0) named_sync(BAR_TURN_MINE, 256);  // balance consumer 1's last hand-over
    }
  }
}

template <int PV, int SPLIT = 1, int PP = 0>
cudaError_t launch_sparse_attn_fwd_persistent(const Params& p, cudaStream_t stream) {
  static bool configured[64] = {};
  static int sms[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (!configured[dev]) {
    e = cudaFuncSetAttribute(sparse_attn_fwd_persistent<PV, SPLIT, PP>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return e;
    e = cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    configured[dev] = true;
  }
  const int items = p.T * (p.H / kBH);
  if (items == 0) return cudaSuccess;
  const int grid = items < sms[dev] ? items : sms[dev];
  sparse_attn_fwd_persistent<PV, SPLIT, PP><<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Host-side launch (no torch): returns the launch's cudaError_t.
template <int PV, int PIPE, int MODE = 0>
cudaError_t launch_sparse_attn_fwd(const Params& p, cudaStream_t stream) {
  static bool configured[64] = {};  // per device: the dynamic shared-memory limit is raised once
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64 || !configured[dev]) {
    e = cudaFuncSetAttribute(sparse_attn_fwd_kernel<PV, PIPE, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return e;
    if (dev < 64) configured[dev] = true;
  }
  const int blocks = p.T * (p.H / kBH);
  if (blocks == 0) return cudaSuccess;
  sparse_attn_fwd_kernel<PV, PIPE, MODE><<<blocks, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsv4_cuda
