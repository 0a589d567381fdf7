// The lean decode step: every decoder layer of a Llama-family model for one token of each of B
// sequences, in C++.
//
// Eager PyTorch spends most of a small model's decode step outside the matrix kernels: ~25
// operator dispatches per layer, each a Python call, an allocation and a dispatcher round trip
// (profiled in edge/fastpath.py). This file runs the same arithmetic straight on the weights'
// memory with preallocated scratch buffers: RMSNorm, the q/k/v projections (fp32, Q8/Q4 packed
// or ggml blocks, see gemv_kernels.h and ggml_kernels.h), rotary embedding, the new K/V written
// into the caller's cache, grouped-query attention over the cached positions (optionally a
// sliding window), o_proj, SwiGLU and down_proj; Qwen3's per-head RMSNorm of q and k (one (D,)
// weight shared by every head, before rotary) where a layer has it; Gemma's per-layer parts:
// sandwich norms on each block's output, GeGLU, the sliding layers' own rotary base and window,
// the softmax scale (the (1 + w) norm scales come precomputed); NoPE layers skip rotary;
// routed-expert MLPs (Mixtral, Qwen3-MoE: a router, softmax, top-k and each chosen expert's
// SwiGLU through the same linear kernels, see Decoder::moe_block).
// Tensor parallelism: after
// o_proj and after down_proj the partial sums go through a Python callback (the transport's
// all-reduce), so the network code stays in Python and the GIL is held only for that call.
//
// Batches: decode reads every weight once per token and does a few flops per byte, so it is
// bound by memory bandwidth. With B sequences decoding together (Decoder::layers_batch) each
// linear is ONE call of the M-row kernels for all B rows: a weight row is read from memory once
// and dotted with every row's activations while it sits in L1. Everything that depends on the
// sequence (rotary angle, cache slot, the keys attended to) is per row; each row has its own KV
// cache. A batch row computes exactly what the same token alone computes (the kernels treat the
// rows independently and in the same order), and the TP partial sums of all B rows travel as
// one (1, B, H) all-reduce per block.
//
// Bound into the same extension as gemv.cpp (edge/quant/kernel.py builds both).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include "gemv_kernels.h"
#include "pool.h"
#include "ggml_kernels.h"
#include "splitk.h"
#include "starlink_wire.h"

namespace py = pybind11;

// The repacked layout of an [N, K] ggml weight of `type` (ggml_kernels.h, packed_bytes),
// checked against the weight's shape and type before anything reads it (also gemv.cpp's).
const uint8_t* ggml_packed_ptr(const torch::Tensor& packed, int64_t type, int64_t N, int64_t K) {
  const int64_t want = lbq::ggml::packed_bytes(static_cast<int>(type), N, K);
  TORCH_CHECK(want > 0, "this build has no repacked path for ggml type ", type, " at K=", K);
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.device().is_cpu() && packed.numel() == want,
              "packed must be a contiguous 1-D uint8 CPU tensor of ", want, " bytes for [", N, ", ", K, "] of type ",
              type, ", got ", packed.numel());
  return packed.data_ptr<uint8_t>();
}

namespace {

// ---- fp32 helpers -------------------------------------------------------------------------
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(LBQ_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  s = lbq::hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#elif defined(LBQ_NEON)
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = vdupq_n_f32(0.f), a2 = vdupq_n_f32(0.f), a3 = vdupq_n_f32(0.f);
  for (; i + 16 <= n; i += 16) {
    a0 = vfmaq_f32(a0, vld1q_f32(a + i), vld1q_f32(b + i));
    a1 = vfmaq_f32(a1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    a2 = vfmaq_f32(a2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
    a3 = vfmaq_f32(a3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
  }
  for (; i + 4 <= n; i += 4) a0 = vfmaq_f32(a0, vld1q_f32(a + i), vld1q_f32(b + i));
  s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[j] = dot_f32(w, x[j], n) for MR activation rows that share each load of w. Per row the
// accumulators and the order of the additions are dot_f32's, so a batch row gets the same bits
// as a lone row (MR = 4: the 16 accumulators fit the 32 registers of AVX-512 machines).
template <int MR>
inline void dot_f32_multi(const float* w, const float* const* x, int64_t n, float* out) {
  int64_t i = 0;
  float s[MR];
  for (int j = 0; j < MR; ++j) s[j] = 0.f;
#if defined(LBQ_AVX2)
  __m256 a0[MR], a1[MR], a2[MR], a3[MR];
  for (int j = 0; j < MR; ++j) a0[j] = a1[j] = a2[j] = a3[j] = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    const __m256 w2 = _mm256_loadu_ps(w + i + 16), w3 = _mm256_loadu_ps(w + i + 24);
    for (int j = 0; j < MR; ++j) {
      a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + i), a0[j]);
      a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + i + 8), a1[j]);
      a2[j] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x[j] + i + 16), a2[j]);
      a3[j] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x[j] + i + 24), a3[j]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + i);
    for (int j = 0; j < MR; ++j) a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + i), a0[j]);
  }
  for (int j = 0; j < MR; ++j)
    s[j] = lbq::hsum_ps(_mm256_add_ps(_mm256_add_ps(a0[j], a1[j]), _mm256_add_ps(a2[j], a3[j])));
#elif defined(LBQ_NEON)
  float32x4_t a0[MR], a1[MR], a2[MR], a3[MR];
  for (int j = 0; j < MR; ++j) a0[j] = a1[j] = a2[j] = a3[j] = vdupq_n_f32(0.f);
  for (; i + 16 <= n; i += 16) {
    const float32x4_t w0 = vld1q_f32(w + i), w1 = vld1q_f32(w + i + 4);
    const float32x4_t w2 = vld1q_f32(w + i + 8), w3 = vld1q_f32(w + i + 12);
    for (int j = 0; j < MR; ++j) {
      a0[j] = vfmaq_f32(a0[j], w0, vld1q_f32(x[j] + i));
      a1[j] = vfmaq_f32(a1[j], w1, vld1q_f32(x[j] + i + 4));
      a2[j] = vfmaq_f32(a2[j], w2, vld1q_f32(x[j] + i + 8));
      a3[j] = vfmaq_f32(a3[j], w3, vld1q_f32(x[j] + i + 12));
    }
  }
  for (; i + 4 <= n; i += 4) {
    const float32x4_t w0 = vld1q_f32(w + i);
    for (int j = 0; j < MR; ++j) a0[j] = vfmaq_f32(a0[j], w0, vld1q_f32(x[j] + i));
  }
  for (int j = 0; j < MR; ++j) s[j] = vaddvq_f32(vaddq_f32(vaddq_f32(a0[j], a1[j]), vaddq_f32(a2[j], a3[j])));
#endif
  for (; i < n; ++i)
    for (int j = 0; j < MR; ++j) s[j] += w[i] * x[j][i];
  for (int j = 0; j < MR; ++j) out[j] = s[j];
}

// y += a * x
inline void axpy_f32(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(LBQ_AVX2)
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#elif defined(LBQ_NEON)
  const float32x4_t va = vdupq_n_f32(a);
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_f32(vld1q_f32(y + i), va, vld1q_f32(x + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// The dots of key row k with the G query heads q + j * D (G <= 8), each with dot_f32's bits:
// dot_f32_multi shares each load of the key between heads.
inline void key_dots(const float* k, const float* q, int64_t D, int64_t G, float* out) {
  int64_t j = 0;
  for (; j + 4 <= G; j += 4) {
    const float* qs[4] = {q + j * D, q + (j + 1) * D, q + (j + 2) * D, q + (j + 3) * D};
    dot_f32_multi<4>(k, qs, D, out + j);
  }
  for (; j + 2 <= G; j += 2) {
    const float* qs[2] = {q + j * D, q + (j + 1) * D};
    dot_f32_multi<2>(k, qs, D, out + j);
  }
  if (j < G) out[j] = dot_f32(q + j * D, k, D);
}

// out[j] = sum_s (p[j * S + s] * inv[j]) v[s] for G heads (values v: S rows of D), each output
// value by fma in key order from 0, as axpy_f32 row after row computes it (the same bits); with
// AVX2 and D % 32 == 0 a 32-wide slice of up to 4 heads stays in registers over all S keys
// (axpy_f32 loads and stores the output for every key). p is scaled in place.
template <int HN>
inline void weighted_slice(const float* p, int64_t S, const float* v, int64_t D, int64_t d, float* out) {
#if defined(LBQ_AVX2)
  __m256 acc[HN][4];
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < 4; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const float* vr = v + s * D + d;
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
    const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
    for (int h = 0; h < HN; ++h) {
      const __m256 a = _mm256_set1_ps(p[h * S + s]);
      acc[h][0] = _mm256_fmadd_ps(a, v0, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(a, v1, acc[h][1]);
      acc[h][2] = _mm256_fmadd_ps(a, v2, acc[h][2]);
      acc[h][3] = _mm256_fmadd_ps(a, v3, acc[h][3]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + h * D + d + 8 * c, acc[h][c]);
#else
  (void)p, (void)S, (void)v, (void)D, (void)d, (void)out;
#endif
}

inline void weighted_values(float* p, const float* inv, const float* v, int64_t S, int64_t D, int64_t G, float* out) {
  for (int64_t j = 0; j < G; ++j)
    for (int64_t s = 0; s < S; ++s) p[j * S + s] *= inv[j];
#if defined(LBQ_AVX2)
  if (D % 32 == 0) {
    for (int64_t h = 0; h < G; h += 4) {
      const float* ph = p + h * S;
      float* oh = out + h * D;
      for (int64_t d = 0; d < D; d += 32) switch (std::min<int64_t>(4, G - h)) {
          case 4:
            weighted_slice<4>(ph, S, v, D, d, oh);
            break;
          case 3:
            weighted_slice<3>(ph, S, v, D, d, oh);
            break;
          case 2:
            weighted_slice<2>(ph, S, v, D, d, oh);
            break;
          default:
            weighted_slice<1>(ph, S, v, D, d, oh);
            break;
        }
    }
    return;
  }
#endif
  std::fill(out, out + G * D, 0.f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < G; ++j) axpy_f32(p[j * S + s], v + s * D, out + j * D, D);
}

// The loop nest of every M-row linear over its weight rows [n0, n1): tile(n, m0, m1) computes
// Y[m0:m1, n]. Weight rows go in blocks of ~32 KB and, inside a block, activation rows in
// groups of 32, so with many rows a block is read from memory once and then served from cache
// for every group; with up to 32 rows this is simply "each weight row once, all rows against
// it" (row after row is one sequential stream through memory, which the prefetcher follows
// best: measured on the benchmark's 32000 x 512 head, one core, ~40 GB/s for fp32 against ~29
// GB/s for four interleaved rows sharing each load of x).
template <typename Tile>
inline void tiled_rows(int64_t n0, int64_t n1, int64_t M, int64_t row_bytes, const Tile& tile) {
  constexpr int64_t kBlockBytes = int64_t{32} << 10, kRowGroup = 32;
  const int64_t nb = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row_bytes, 1));
  for (int64_t a = n0; a < n1; a += nb) {
    const int64_t b = std::min(n1, a + nb);
    for (int64_t m = 0; m < M; m += kRowGroup) {
      const int64_t me = std::min(M, m + kRowGroup);
      for (int64_t n = a; n < b; ++n) tile(n, m, me);
    }
  }
}

#if defined(__AVX512F__)
// ---- fp32 linears on AVX-512: a small GEMM ----------------------------------------------------
// A speculative verification group (k + 1 rows) or a decode batch multiplies the same weights by
// a few activation rows. dot_f32_multi shares a load of w between two rows but still loads every
// activation vector once per weight row and per row pair: at 6-9 rows the loads, not memory,
// set the pace (the Gemma 3 270M F32 head took 3.2x its one-row time at 8 rows). Here a tile
// of NR weight rows x MR activation rows keeps NR * MR accumulators in zmm registers, so each
// 16-value step costs NR + MR loads for NR * MR FMAs, and 8 rows cost about one pass over the
// weights. Every output is one accumulator fed by the same FMAs in k order (the tail by masked
// loads whose zero lanes add nothing), then _mm512_reduce_add_ps: its bits do not depend on the
// tile it ran in, so a batch row computes exactly what the same token alone does.
constexpr int kF32NR = 4, kF32MR = 6;  // 24 accumulators + 4 weight vectors + 1 activation

template <int NR, int MR>
inline void f32_tile(const float* W, int64_t K, const float* x, int64_t ldx, int64_t n, int64_t m, float* Y,
                     int64_t ldy) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* wr[NR];
  const float* xr[MR];
  for (int r = 0; r < NR; ++r) wr[r] = W + (n + r) * K;
  for (int j = 0; j < MR; ++j) xr[j] = x + (m + j) * ldx;
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) {
    __m512 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = _mm512_loadu_ps(wr[r] + i);
    // the next tile's weight rows: NR interleaved streams are more than the hardware
    // prefetcher follows at full speed (one-row decode ran 10% slower without this)
    for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + NR * K + i), _MM_HINT_T0);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_loadu_ps(xr[j] + i);
      for (int r = 0; r < NR; ++r) acc[r][j] = _mm512_fmadd_ps(w[r], xv, acc[r][j]);
    }
  }
  if (i < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - i)) - 1u);
    __m512 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = _mm512_maskz_loadu_ps(mask, wr[r] + i);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[j] + i);
      for (int r = 0; r < NR; ++r) acc[r][j] = _mm512_fmadd_ps(w[r], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j) Y[(m + j) * ldy + n + r] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int NR, int MR>
inline void f32_tile_n(int64_t mr, const float* W, int64_t K, const float* x, int64_t ldx, int64_t n, int64_t m,
                       float* Y, int64_t ldy) {
  if constexpr (MR > 1) {
    if (mr < MR) return f32_tile_n<NR, MR - 1>(mr, W, K, x, ldx, n, m, Y, ldy);
  }
  f32_tile<NR, MR>(W, K, x, ldx, n, m, Y, ldy);
}

// Rows m0..m1 against NR weight rows, in tiles of as even a size as fits: 8 rows go as 4 + 4,
// 9 as 5 + 4 (a 6 + 2 split would read the weights' tile twice for few rows).
template <int NR>
inline void f32_tiles_m(const float* W, int64_t K, const float* x, int64_t ldx, int64_t n, int64_t m0, int64_t m1,
                        float* Y, int64_t ldy) {
  for (int64_t m = m0; m < m1;) {
    const int64_t left = m1 - m, tiles = (left + kF32MR - 1) / kF32MR, mr = (left + tiles - 1) / tiles;
    f32_tile_n<NR, kF32MR>(mr, W, K, x, ldx, n, m, Y, ldy);
    m += mr;
  }
}

// Y[m, n] (row stride ldy) for a row-major fp32 W [N, K] and activation rows x + m * ldx:
// weight rows in blocks of ~32 KB (L1) against groups of 36 activation rows, tiles inside.
void gemv_f32_rows(const float* W, int64_t K, const float* x, int64_t ldx, int64_t M, float* Y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  constexpr int64_t kRowGroup = 6 * kF32MR;
  const int64_t nb = std::max<int64_t>(kF32NR, (int64_t{32} << 10) / std::max<int64_t>(4 * K, 1) / kF32NR * kF32NR);
  for (int64_t a = n0; a < n1; a += nb) {
    const int64_t b = std::min(n1, a + nb);
    for (int64_t mg = 0; mg < M; mg += kRowGroup) {
      const int64_t me = std::min(M, mg + kRowGroup);
      int64_t n = a;
      for (; n + kF32NR <= b; n += kF32NR) f32_tiles_m<kF32NR>(W, K, x, ldx, n, mg, me, Y, ldy);
      for (; n < b; ++n) f32_tiles_m<1>(W, K, x, ldx, n, mg, me, Y, ldy);
    }
  }
}
#else
// Y[m, n] (row stride ldy) for a row-major fp32 W [N, K] and activation rows x + m * ldx.
void gemv_f32_rows(const float* W, int64_t K, const float* x, int64_t ldx, int64_t M, float* Y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  tiled_rows(n0, n1, M, 4 * K, [&](int64_t n, int64_t m0, int64_t m1) {
    const float* wr = W + n * K;
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) {
      const float* xr[2] = {x + m * ldx, x + (m + 1) * ldx};
      float out[2];
      dot_f32_multi<2>(wr, xr, K, out);
      Y[m * ldy + n] = out[0];
      Y[(m + 1) * ldy + n] = out[1];
    }
    if (m < m1) Y[m * ldy + n] = dot_f32(wr, x + m * ldx, K);
  });
}
#endif

// ---- one linear layer (fp32, Q8/Q4 packed or ggml blocks) ----------------------------------
constexpr int kGGML = 0;  // Lin::kind of ggml blocks (the type id is in Lin::G)

struct Lin {
  int kind = 32;  // 32: fp32 [N, K]; 8 / 4: packed (gemv_kernels.h layouts); kGGML: ggml blocks
  int G = 32;     // group of a packed weight; the ggml type id of blocks
  int64_t N = 0, K = 0;
  int64_t row_bytes = 0;     // ggml: bytes per weight row
  torch::Tensor w, q, s, b;  // kept alive here
  const float* wp = nullptr;
  const uint8_t* qp = nullptr;
  const uint16_t* sp = nullptr;
  const float* bp = nullptr;
  const uint8_t* pp = nullptr;  // ggml: the repacked layout for batches (ggml_pack), or null
  // ggml: K values per leaf of the split-K tree (splitk.h), 0: none; leaves: the S = K / chunk
  // leaf linears (blocks and repacked layout at the leaf's offset, rows row_bytes apart)
  int64_t chunk = 0;
  std::vector<Lin> leaves;
};

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 CPU tensor");
}

// Cut a ggml linear into the leaves of its split-K tree (splitk.h): chunk K values each.
void split_lin(Lin& l, int64_t chunk) {
  if (chunk <= 0 || chunk >= l.K) return;
  TORCH_CHECK(l.kind == kGGML, "a split-K chunk is for ggml blocks only");
  int qk = 0, size = 0;
  lbq::ggml::block_shape(l.G, &qk, &size);
  const int64_t S = l.K / chunk;
  TORCH_CHECK(chunk % qk == 0 && l.K % chunk == 0 && (S & (S - 1)) == 0 && S <= lbq::kMaxLeaves, "split-K chunk ",
              chunk, " must be whole blocks of ", qk, " and cut K=", l.K, " into a power of two of leaves");
  const int64_t pb = l.pp != nullptr ? lbq::ggml::packed_bytes(l.G, l.N, chunk) : 0;
  l.chunk = chunk;
  for (int64_t c = 0; c < S; ++c) {
    Lin f;
    f.kind = kGGML;
    f.G = l.G;
    f.N = l.N;
    f.K = chunk;
    f.row_bytes = l.row_bytes;
    f.qp = l.qp + c * (chunk / qk) * size;
    f.pp = l.pp != nullptr ? l.pp + c * pb : nullptr;
    l.leaves.push_back(f);
  }
}

// (kind, tensor0, tensor1 | None, group, bias | None[, chunk | None]): kind 32 (fp32 weight, None, 0), 8 / 4
// (qweight, fp16 scales, group) or 0 (ggml blocks uint8 [N, row_bytes], repacked layout | None,
// ggml type id).
Lin parse_lin(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  TORCH_CHECK(t.size() == 5 || t.size() == 6,
              "a linear is (kind, w_or_qweight, scales|None, group, bias|None[, chunk|None])");
  Lin l;
  l.kind = t[0].cast<int>();
  l.G = t[3].cast<int>();
  if (!t[4].is_none()) {
    l.b = t[4].cast<torch::Tensor>();
    check_f32(l.b, "bias");
    l.bp = l.b.data_ptr<float>();
  }
  if (l.kind == 32) {
    l.w = t[1].cast<torch::Tensor>();
    check_f32(l.w, "weight");
    TORCH_CHECK(l.w.dim() == 2, "weight must be 2-D");
    l.N = l.w.size(0);
    l.K = l.w.size(1);
    l.wp = l.w.data_ptr<float>();
  } else if (l.kind == kGGML) {
    int qk = 0, size = 0;
    TORCH_CHECK(lbq::ggml::block_shape(l.G, &qk, &size), "unsupported ggml type id ", l.G);
    l.q = t[1].cast<torch::Tensor>();
    TORCH_CHECK(l.q.dim() == 2 && l.q.is_contiguous() && l.q.scalar_type() == at::kByte && l.q.device().is_cpu(),
                "ggml blocks must be a contiguous 2-D uint8 CPU tensor");
    l.N = l.q.size(0);
    l.row_bytes = l.q.size(1);
    TORCH_CHECK(l.row_bytes % size == 0, "ggml rows of ", l.row_bytes, " bytes are not whole blocks of ", size);
    l.K = l.row_bytes / size * qk;
    l.qp = l.q.data_ptr<uint8_t>();
    if (!t[2].is_none()) {  // the repacked layout (kept alive in s)
      l.s = t[2].cast<torch::Tensor>();
      l.pp = ggml_packed_ptr(l.s, l.G, l.N, l.K);
    }
  } else {
    TORCH_CHECK(l.kind == 8 || l.kind == 4, "kind must be 32, 8, 4 or 0 (ggml), got ", l.kind);
    TORCH_CHECK(l.G == 32 || l.G == 64 || l.G == 128, "group must be 32, 64 or 128");
    l.q = t[1].cast<torch::Tensor>();
    l.s = t[2].cast<torch::Tensor>();
    TORCH_CHECK(l.q.is_contiguous() && l.q.dim() == 2 && l.s.is_contiguous() && l.s.scalar_type() == at::kHalf &&
                    l.q.device().is_cpu(),
                "packed weights must be contiguous CPU tensors with float16 scales");
    l.N = l.q.size(0);
    l.K = l.kind == 8 ? l.q.size(1) : 2 * l.q.size(1);
    TORCH_CHECK(l.K % l.G == 0, "K=", l.K, " is not a multiple of group ", l.G);
    TORCH_CHECK(l.s.size(0) == l.N && l.s.size(1) == l.K / l.G, "scales must be [N, K/group]");
    l.qp = reinterpret_cast<const uint8_t*>(l.q.data_ptr());
    l.sp = reinterpret_cast<const uint16_t*>(l.s.data_ptr<at::Half>());
  }
  if (l.bp != nullptr) TORCH_CHECK(l.b.numel() == l.N, "bias must have N elements");
  if (t.size() == 6 && !t[5].is_none()) split_lin(l, t[5].cast<int64_t>());
  return l;
}

// Scratch for the activation quantization of the packed and ggml kernels (M rows).
struct QScratch {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  lbq::ggml::GActBuf g;                // ggml: the int8 activations and their sums
  std::vector<lbq::ggml::GActBuf> gl;  // split-K: each leaf's int8 activations (splitk.h)
  std::vector<float> leaves;           // split-K: the leaves' outputs
};

// Y[m0:m1, n] of a packed weight: the kernel's row tiles of <= 4 activation rows.
template <bool Q4, int G>
inline void packed_tile(const lbq::Wt& w, const lbq::Act& a, int64_t n, int64_t m0, int64_t m1, float* Y, int64_t ldy) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) lbq::row_tile<Q4, 4, G>(w, a, n, m, Y, ldy);
  switch (m1 - m) {
    case 3:
      lbq::row_tile<Q4, 3, G>(w, a, n, m, Y, ldy);
      break;
    case 2:
      lbq::row_tile<Q4, 2, G>(w, a, n, m, Y, ldy);
      break;
    case 1:
      lbq::row_tile<Q4, 1, G>(w, a, n, m, Y, ldy);
      break;
    default:
      break;
  }
}

template <bool Q4, int G>
void packed_rows(const lbq::Wt& w, const lbq::Act& a, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
#if defined(LBQ_GEMM512)
  if constexpr (!Q4) {  // the same bits as the row tiles (gemv_kernels.h)
    if (a.M >= lbq::kQ8GemmM) {
      lbq::q8_gemm<G>(w, a, n0, n1, Y, ldy);
      return;
    }
    if constexpr (G == 32) {
      lbq::q8_small(w, a, n0, n1, Y, ldy);
      return;
    }
  }
#endif
  tiled_rows(n0, n1, a.M, w.row_bytes,
             [&](int64_t n, int64_t m0, int64_t m1) { packed_tile<Q4, G>(w, a, n, m0, m1, Y, ldy); });
}

void packed_dispatch(bool q4, int G, const lbq::Wt& w, const lbq::Act& a, int64_t n0, int64_t n1, float* Y,
                     int64_t ldy) {
  switch (G) {  // parse_lin admits 32, 64 and 128 only
    case 32:
      q4 ? packed_rows<true, 32>(w, a, n0, n1, Y, ldy) : packed_rows<false, 32>(w, a, n0, n1, Y, ldy);
      break;
    case 64:
      q4 ? packed_rows<true, 64>(w, a, n0, n1, Y, ldy) : packed_rows<false, 64>(w, a, n0, n1, Y, ldy);
      break;
    default:
      q4 ? packed_rows<true, 128>(w, a, n0, n1, Y, ldy) : packed_rows<false, 128>(w, a, n0, n1, Y, ldy);
      break;
  }
}

// Y[:, n0:n1] of ggml blocks of type T (ggml_kernels.h's rows_range: fused kernels where the
// type has one, with weight x activation row blocks for many rows; else decoded row tiles).
template <int T>
void ggml_rows(const uint8_t* w, int64_t row_bytes, const lbq::ggml::GAct& a, int64_t n0, int64_t n1, float* Y,
               int64_t ldy, const uint8_t* packed) {
  lbq::ggml::rows_range<T>(w, row_bytes, a, n0, n1, Y, ldy, packed);
}

void ggml_dispatch(int type, const uint8_t* w, int64_t row_bytes, const lbq::ggml::GAct& a, int64_t n0, int64_t n1,
                   float* Y, int64_t ldy, const uint8_t* packed) {
  namespace g = lbq::ggml;
  // clang-format off: one case per type (the formatter runs macro-made cases together)
  switch (type) {  // parse_lin admits known type ids only
#define LBQ_GGML_CASE(T)                                  \
  case g::T:                                              \
    ggml_rows<g::T>(w, row_bytes, a, n0, n1, Y, ldy, packed); \
    break;
    LBQ_GGML_TYPES(LBQ_GGML_CASE)
#undef LBQ_GGML_CASE
    default:
      break;
  }
  // clang-format on
}

// run_lin of a linear cut into split-K leaves (splitk.h): leaf c reads values c * chunk.. of
// each activation row, quantized once per leaf; groups of 16 weight rows, all leaves each.
void run_split(const Lin& l, const float* x, int64_t ldx, int64_t M, float* Y, int64_t ldy, QScratch& qs) {
  const int64_t S = static_cast<int64_t>(l.leaves.size()), C = l.chunk, N = l.N;
#if defined(LBQ_AVX2)
  if (M == 1 && lbq::ggml::leaves_row_type(l.G)) {  // a decode step of a K-quant: fused_leaves
    qs.g.resize(1, l.K);
    qs.g.row(x, 0, l.K);  // per 32 values: each leaf's activations as quantized alone
    const lbq::ggml::GAct a = qs.g.view(1, l.K);
    lbq::parallel_for(0, N, std::max<int64_t>(8, (int64_t{1} << 16) / l.K),
                      [&](int64_t n0, int64_t n1) { lbq::ggml::leaves_row(l.G, l.qp, l.row_bytes, a, S, n0, n1, Y); });
    return;
  }
#endif
  qs.gl.resize(static_cast<size_t>(S));
  for (auto& g : qs.gl) g.resize(M, C);
  lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t c = 0; c < S; ++c) qs.gl[c].row(x + m * ldx + c * C, m, C);
  });
  std::vector<lbq::ggml::GAct> acts;
  for (int64_t c = 0; c < S; ++c) acts.push_back(qs.gl[c].view(M, C));
  qs.leaves.resize(static_cast<size_t>(S * M * N));
  float* part = qs.leaves.data();
  auto rows = [&](int64_t n0, int64_t n1) {
    lbq::split_k_rows(S, M, N, n0, n1, part, Y, ldy, [&](int64_t c, int64_t a, int64_t b, float* pc) {
      const Lin& f = l.leaves[c];
      ggml_dispatch(f.G, f.qp, f.row_bytes, acts[c], a, b, pc, N, f.pp);
    });
  };
  if (l.pp != nullptr) {  // threads split on the 16-row groups of the repacked layout
    lbq::parallel_for(0, (N + 15) / 16, 1, [&](int64_t g0, int64_t g1) { rows(g0 * 16, std::min(N, g1 * 16)); });
  } else {
    lbq::parallel_for(0, N, std::max<int64_t>(16, (int64_t{1} << 16) / l.K), rows);
  }
}

// Y[m, 0:N] = lin(x + m * ldx) for the M activation rows (K values each), rows of Y ldy apart:
// one kernel pass over the weight for all M rows, split over threads by output rows.
void run_lin(const Lin& l, const float* x, int64_t ldx, int64_t M, float* Y, int64_t ldy, QScratch& qs) {
  if (l.N == 0 || M == 0) return;
  if (!l.leaves.empty()) {
    run_split(l, x, ldx, M, Y, ldy, qs);
  } else if (l.K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(Y + m * ldy, Y + m * ldy + l.N, 0.f);
  } else if (l.kind == 32) {
    const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 16) / l.K);
    lbq::parallel_for(0, l.N, grain,
                      [&](int64_t n0, int64_t n1) { gemv_f32_rows(l.wp, l.K, x, ldx, M, Y, ldy, n0, n1); });
  } else {
    // int8 activations, one scale per G values (32 for ggml), quantized once for all rows.
    const int G = l.kind == kGGML ? 32 : l.G;
    const int64_t K = l.K, nb = K / G;
    if (l.kind == kGGML) {
      qs.g.resize(M, K);
      lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) qs.g.row(x + m * ldx, m, K);
      });
    } else {
      qs.q.resize(static_cast<size_t>(M * K));
      qs.d.resize(static_cast<size_t>(M * nb));
      qs.s.resize(static_cast<size_t>(M * nb));
      lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          lbq::quantize_act_row(x + m * ldx, K, G, qs.q.data() + m * K, qs.d.data() + m * nb, qs.s.data() + m * nb);
      });
    }
    const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / K);
    if (l.kind == kGGML) {
      const lbq::ggml::GAct a = qs.g.view(M, K);
      if (l.pp != nullptr) {  // threads split on the 16-row groups of the repacked layout
        lbq::parallel_for(0, (l.N + 15) / 16, 1, [&](int64_t g0, int64_t g1) {
          ggml_dispatch(l.G, l.qp, l.row_bytes, a, g0 * 16, std::min(l.N, g1 * 16), Y, ldy, l.pp);
        });
      } else {
        lbq::parallel_for(0, l.N, grain, [&](int64_t n0, int64_t n1) {
          ggml_dispatch(l.G, l.qp, l.row_bytes, a, n0, n1, Y, ldy, nullptr);
        });
      }
    } else {
      const bool q4 = l.kind == 4;
      lbq::prepare_act(q4, l.G, qs.q.data(), M, K);
      const lbq::Act a{qs.q.data(), qs.d.data(), qs.s.data(), M, K, nb};
      const lbq::Wt w{l.qp, l.sp, l.N, K, nb, l.kind == 8 ? K : K / 2};
      lbq::parallel_for(0, l.N, grain, [&](int64_t n0, int64_t n1) { packed_dispatch(q4, l.G, w, a, n0, n1, Y, ldy); });
    }
  }
  if (l.bp != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < l.N; ++n) Y[m * ldy + n] += l.bp[n];
}

// Several linears reading the same input, outputs concatenated per row (unfused q/k/v or
// gate/up): Y is [M, sum of N].
void run_parts(const std::vector<Lin>& parts, const float* x, int64_t ldx, int64_t M, float* Y, int64_t ldy,
               QScratch& qs) {
  int64_t off = 0;
  for (const Lin& l : parts) {
    run_lin(l, x, ldx, M, Y + off, ldy, qs);
    off += l.N;
  }
}

int64_t parts_n(const std::vector<Lin>& parts) {
  int64_t n = 0;
  for (const Lin& l : parts) n += l.N;
  return n;
}

// One routed expert: SwiGLU w2(silu(w1 x) * w3 x), its gate_up parts w1 then w3.
struct Expert {
  std::vector<Lin> gate_up;
  Lin down;
  int64_t inter = 0;
};

// The routed-expert MLP of a Mixtral / Qwen3-MoE layer (lowband.models.llama.SparseMoE):
// router logits, softmax over every expert in float32, the top k, renormalised to sum to 1
// where norm_topk is set, and the weighted sum of the chosen experts' outputs. Experts that
// live outside the model (the bit-nested store, edge/moe/store.py, decodes each from its bit
// planes in Python) come as `block` instead: a Python callable computing the whole block of
// (1, B, H) normed rows (routing included) before the TP reduce, called under the GIL.
struct Moe {
  Lin router;
  std::vector<Expert> experts;
  int64_t top_k = 0;
  bool norm_topk = true;
  py::object block;  // None: router and experts here
};

struct Layer {
  torch::Tensor ln1, ln2;  // the norms before attention and before the MLP
  torch::Tensor qn, kn;    // per-head q/k RMSNorm weights (D,); undefined: none (plain Llama)
  // Gemma's sandwich: norms of the attention output and of the MLP output before each is
  // added to the residual stream (after the TP all-reduce); undefined: none (Llama).
  torch::Tensor post_attn, post_ffn;
  std::vector<Lin> qkv, gate_up;
  Lin o, down;
  Moe moe;  // used where moe.top_k > 0 (then gate_up and down are empty)
  int64_t nq = 0, nkv = 0, inter = 0;
  int64_t window = 0;  // attention window W of this layer (keys j with pos - j < W); 0: all
  int rope = 1;        // rotary table: 0 none (NoPE), 1 global, 2 local (own base)
};

// The MLP's gate activation (HF hidden_act).
// GeGLU, g[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) u[i] with x = g[i], computed
// as the eager path's F.gelu(approximate="tanh") computes it on this CPU: torch's vectorized
// kernel calls SLEEF's tanh (exported by libtorch_cpu, which this extension links; weak, so a
// torch without them falls back to std::tanh) after x + kappa x^3 as one fma, so a gate here
// has the eager path's bits (2^20 random gates: all equal on AVX-512) at a tenth of std::tanh's cost
// (12% of a 512-token prefill of the real Gemma 3 270M went to glibc's tanhf).
extern "C" {
#if defined(__AVX512F__)
__m512 Sleef_tanhf16_u10(__m512) __attribute__((weak));
#endif
#if defined(LBQ_AVX2)
__m256 Sleef_tanhf8_u10avx2(__m256) __attribute__((weak));
#endif
}

inline void geglu(float* g, const float* u, int64_t n) {
  constexpr float kC = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kA = 0.044715f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (Sleef_tanhf16_u10 != nullptr) {
    const __m512 c = _mm512_set1_ps(kC), a = _mm512_set1_ps(kA), h = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 t = Sleef_tanhf16_u10(_mm512_mul_ps(c, _mm512_fmadd_ps(a, x3, x)));
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(h, x), _mm512_add_ps(one, t));
      _mm512_storeu_ps(g + i, _mm512_mul_ps(y, _mm512_loadu_ps(u + i)));
    }
  }
#elif defined(LBQ_AVX2)
  if (Sleef_tanhf8_u10avx2 != nullptr) {
    const __m256 c = _mm256_set1_ps(kC), a = _mm256_set1_ps(kA), h = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 t = Sleef_tanhf8_u10avx2(_mm256_mul_ps(c, _mm256_fmadd_ps(a, x3, x)));
      const __m256 y = _mm256_mul_ps(_mm256_mul_ps(h, x), _mm256_add_ps(one, t));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = g[i];
    const float inner = kC * std::fma(kA, x * x * x, x);
    g[i] = 0.5f * x * (1.f + std::tanh(inner)) * u[i];
  }
}

enum Act : int { kSilu = 0, kGeluTanh = 1 };

inline void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float ms = dot_f32(x, x, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(ms + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// ---- the star link, natively (transport/starlink.py's wire format) -------------------------
// When the reduce hook is a star link carrying float32 (no codec), the partial sums go straight
// over the link's sockets from here: no GIL, no Python, no msgpack per message. Messages are
// byte-identical to the Python implementation's (header, u32 table length, the msgpack frame
// table, the raw float32 frame), so either end may be Python or C++; the table of a (1, 1, H)
// float32 frame is fixed and comes from Python. The format's constants come from
// starlink_wire.h, generated from transport/starlink_wire.py. Errors surface as RuntimeError
// with a "lowband-link:<Kind>:" prefix, which edge/fastpath.py maps to the transport's errors.
namespace wire = starlink_wire;

struct LinkError : std::runtime_error {
  LinkError(const std::string& kind, const std::string& msg) : std::runtime_error("lowband-link:" + kind + ":" + msg) {}
};

struct Link {
  int role = 0;          // 0: none (Python callback), 1: hub (master), 2: spoke (worker)
  std::vector<int> fds;  // hub: one per worker slot, in slot order; spoke: the master's
  uint32_t seq = 0;
  double timeout = -1.0, spin = 0.0;
  std::string table;
  int64_t sent = 0, received = 0;
  double wait_s = 0.0;  // time inside all-reduces (link + waiting for the other devices)
  std::vector<uint8_t> msg, in;
};

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Wait until fd is readable/writable: spin (yielding the core) up to `spin` seconds, then sleep in
// poll() until the deadline. Returns false on timeout.
bool link_wait(int fd, short ev, double t0, const Link& L) {
  for (;;) {
    const double el = now_s() - t0;
    if (L.timeout >= 0 && el > L.timeout) return false;
    pollfd p{fd, ev, 0};
    int ms = 0;
    if (el >= L.spin) ms = L.timeout < 0 ? 200 : std::max(1, static_cast<int>(1e3 * (L.timeout - el)) + 1);
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throw LinkError("PeerLost", std::string("poll failed: ") + std::strerror(errno));
    if (r == 0 && ms == 0) sched_yield();
  }
}

void link_read(int fd, uint8_t* buf, size_t n, const Link& L, const char* who) {
  const double t0 = now_s();
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, buf + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      throw LinkError("PeerLost", std::string(who) + " closed the link");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!link_wait(fd, POLLIN, t0, L))
        throw LinkError("TransportTimeout",
                        std::string("no message from ") + who + " within " + std::to_string(L.timeout) + "s");
    } else {
      throw LinkError("PeerLost", std::string("link to ") + who + " broke: " + std::strerror(errno));
    }
  }
}

void link_write(int fd, const uint8_t* buf, size_t n, const Link& L, const char* who) {
  const double t0 = now_s();
  size_t put = 0;
  while (put < n) {
    const ssize_t r = ::send(fd, buf + put, n - put, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) {
      put += static_cast<size_t>(r);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!link_wait(fd, POLLOUT, t0, L))
        throw LinkError("TransportTimeout", std::string("send to ") + who + " timed out");
    } else {
      throw LinkError("PeerLost", std::string("link to ") + who + " broke: " + std::strerror(errno));
    }
  }
}

void link_send(Link& L, int fd, uint8_t kind, const float* frame, int64_t H, const char* who) {
  const uint32_t tlen = static_cast<uint32_t>(L.table.size());
  wire::Header h{};
  std::memcpy(h.magic, wire::MAGIC, sizeof h.magic);
  h.version = wire::VERSION;
  h.kind = kind;
  h.seq = L.seq;  // little-endian hosts only (checked at set-up)
  h.length = wire::TABLE_LEN_SIZE + tlen + 4 * static_cast<uint64_t>(H);
  L.msg.resize(wire::HEADER_SIZE + h.length);
  uint8_t* p = L.msg.data();
  std::memcpy(p, &h, wire::HEADER_SIZE);
  std::memcpy(p + wire::HEADER_SIZE, &tlen, wire::TABLE_LEN_SIZE);
  uint8_t* table = p + wire::HEADER_SIZE + wire::TABLE_LEN_SIZE;
  std::memcpy(table, L.table.data(), tlen);
  std::memcpy(table + tlen, frame, 4 * static_cast<size_t>(H));
  link_write(fd, p, L.msg.size(), L, who);
  L.sent += 4 * H;
}

// Reads one whole message; returns its kind and leaves the float32 frame (if the expected one)
// at frame_out. Any other message is consumed entirely before an error is raised, so the
// stream stays aligned for the Python side's resynchronisation.
uint8_t link_recv(Link& L, int fd, uint8_t want, int64_t H, float* frame_out, const char* who) {
  uint8_t raw[wire::HEADER_SIZE];
  link_read(fd, raw, wire::HEADER_SIZE, L, who);
  wire::Header h;
  std::memcpy(&h, raw, wire::HEADER_SIZE);
  const uint32_t seq = h.seq;
  const uint64_t n = h.length;
  if (std::memcmp(h.magic, wire::MAGIC, sizeof h.magic) != 0 || h.version != wire::VERSION || n > wire::MAX_PAYLOAD)
    throw LinkError("ProtocolError", std::string("bad link header from ") + who);
  L.in.resize(static_cast<size_t>(n));
  link_read(fd, L.in.data(), static_cast<size_t>(n), L, who);
  const uint8_t kind = h.kind;
  if (kind == wire::KIND_ABORT) return kind;
  if (kind != want || seq != L.seq)
    throw LinkError("ProtocolError", std::string("link out of step with ") + who + ": got kind " +
                                         std::to_string(kind) + " seq " + std::to_string(seq) + ", expected kind " +
                                         std::to_string(want) + " seq " + std::to_string(L.seq));
  const size_t tlen = L.table.size();
  uint32_t got_tlen = 0;
  if (n >= wire::TABLE_LEN_SIZE) std::memcpy(&got_tlen, L.in.data(), wire::TABLE_LEN_SIZE);
  if (n != wire::TABLE_LEN_SIZE + tlen + 4 * static_cast<uint64_t>(H) || got_tlen != tlen ||
      std::memcmp(L.in.data() + wire::TABLE_LEN_SIZE, L.table.data(), tlen) != 0)
    throw LinkError("ProtocolError", std::string("unexpected frame from ") + who +
                                         " (a different wire codec or hidden size on the other end?)");
  std::memcpy(frame_out, L.in.data() + wire::TABLE_LEN_SIZE + tlen, 4 * static_cast<size_t>(H));
  L.received += 4 * H;
  return kind;
}

// In place: x (H floats) becomes the sum over the star, identical on every rank.
void link_all_reduce(Link& L, float* x, int64_t H, std::vector<float>& tmp) {
  const double t0 = now_s();
  struct Timer {
    Link& l;
    double t0;
    ~Timer() { l.wait_s += now_s() - t0; }
  } timer{L, t0};
  ++L.seq;
  tmp.resize(static_cast<size_t>(H));
  if (L.role == 1) {
    for (size_t i = 0; i < L.fds.size(); ++i) {  // slot order: the same sums every time
      const std::string who = "worker slot #" + std::to_string(i + 1);
      if (link_recv(L, L.fds[i], wire::KIND_DATA, H, tmp.data(), who.c_str()) == wire::KIND_ABORT)
        throw LinkError("ProtocolError", "a worker sent ABORT");
      for (int64_t j = 0; j < H; ++j) x[j] += tmp[j];
    }
    for (size_t i = 0; i < L.fds.size(); ++i) link_send(L, L.fds[i], wire::KIND_RESULT, x, H, "a worker");
  } else {
    link_send(L, L.fds[0], wire::KIND_DATA, x, H, "the master");
    if (link_recv(L, L.fds[0], wire::KIND_RESULT, H, tmp.data(), "the master") == wire::KIND_ABORT)
      throw LinkError("PeerLost", "the master aborted this forward (a device failed)");
    std::copy(tmp.begin(), tmp.end(), x);
  }
}

// link: (role, fds, seq, timeout|-1, spin_s, table), see StarHub.native_spec.
void parse_link(const py::object& link, Link& L) {
  auto t = link.cast<py::tuple>();
  TORCH_CHECK(t.size() == 6, "link must be (role, fds, seq, timeout, spin_s, table)");
  L.role = t[0].cast<int>();
  TORCH_CHECK(L.role == 1 || L.role == 2, "link role must be 1 (hub) or 2 (spoke)");
  L.fds = t[1].cast<std::vector<int>>();
  TORCH_CHECK(L.role == 1 || L.fds.size() == 1, "a spoke has one link");
  L.seq = t[2].cast<uint32_t>();
  L.timeout = t[3].cast<double>();
  L.spin = t[4].cast<double>();
  L.table = t[5].cast<std::string>();
  const uint16_t probe = 1;
  TORCH_CHECK(*reinterpret_cast<const uint8_t*>(&probe) == 1, "the native link needs a little-endian host");
}

// Test hook (tests/edge/test_starlink_native.py): ONE all-reduce of the float32 tensor x, in
// place, exactly as Decoder::layers runs it between layers, so a test can hold the native and
// the Python ends of the wire format against each other byte for byte. Returns what
// Decoder::link_state does.
py::tuple link_all_reduce_once(torch::Tensor x, const py::object& link) {
  check_f32(x, "x");
  Link L;
  parse_link(link, L);
  std::vector<float> tmp;
  {
    py::gil_scoped_release nogil;
    link_all_reduce(L, x.data_ptr<float>(), x.numel(), tmp);
  }
  return py::make_tuple(L.seq, L.sent, L.received, L.wait_s);
}

// Where one sequence's K/V of one layer live: the (1, n_kv, cap, D) float32 buffers of its cache.
struct KVRef {
  float* k = nullptr;
  float* v = nullptr;
  int64_t cap = 0;
};

std::atomic<int64_t> g_decoder_ids{1};

class Decoder {
 public:
  // window: the window the shared cache drops positions by (0: none); scale: the softmax
  // scale (<= 0: head_dim^-0.5); act: Act; inv_freq_local: the sliding layers' own rotary
  // frequencies (Gemma 3) or None.
  Decoder(int64_t hidden, int64_t head_dim, double eps, torch::Tensor inv_freq, int64_t window, double scale,
          int64_t act, const py::object& inv_freq_local)
      : H_(hidden),
        D_(head_dim),
        eps_(static_cast<float>(eps)),
        window_(window),
        scale_(scale > 0 ? static_cast<float>(scale) : 1.f / std::sqrt(static_cast<float>(head_dim))),
        act_(static_cast<int>(act)),
        id_(g_decoder_ids++) {
    TORCH_CHECK(act == kSilu || act == kGeluTanh, "act must be 0 (silu) or 1 (gelu tanh)");
    inv_freq_ = freqs(inv_freq, head_dim);
    if (!inv_freq_local.is_none()) inv_local_ = freqs(inv_freq_local.cast<torch::Tensor>(), head_dim);
  }

  // moe: None (a dense MLP: gate_up and down) or (router, [(gate_up, down) per expert], top_k,
  // norm_topk, block) with gate_up empty and down None; block: None, or a callable computing
  // the block in Python (then router is None and the expert list empty), see Moe.
  void add_layer(torch::Tensor ln1, torch::Tensor ln2, py::list qkv, py::tuple o, py::list gate_up,
                 const py::object& down, int64_t nq, int64_t nkv, const py::object& q_norm, const py::object& k_norm,
                 const py::object& post_attn, const py::object& post_ffn, int64_t window, int64_t rope,
                 const py::object& moe) {
    Layer L;
    TORCH_CHECK(post_attn.is_none() == post_ffn.is_none(), "the sandwich norms come together");
    if (!post_attn.is_none()) {
      L.post_attn = post_attn.cast<torch::Tensor>();
      L.post_ffn = post_ffn.cast<torch::Tensor>();
      check_f32(L.post_attn, "post-attention norm");
      check_f32(L.post_ffn, "post-feedforward norm");
      TORCH_CHECK(L.post_attn.numel() == H_ && L.post_ffn.numel() == H_,
                  "sandwich norms must have hidden_size entries");
    }
    TORCH_CHECK(window >= -1, "window must be -1 (the decoder's), 0 (full) or W > 0");
    L.window = window < 0 ? window_ : window;
    TORCH_CHECK(window_ == 0 || L.window == window_, "a cache that drops positions needs every layer's window equal");
    TORCH_CHECK(rope >= 0 && rope <= 2, "rope must be 0 (none), 1 (global) or 2 (local)");
    TORCH_CHECK(rope != 2 || !inv_local_.empty(), "a local-rope layer needs inv_freq_local");
    L.rope = static_cast<int>(rope);
    check_f32(ln1, "input_layernorm");
    check_f32(ln2, "post_attention_layernorm");
    TORCH_CHECK(ln1.numel() == H_ && ln2.numel() == H_, "norm weights must have hidden_size entries");
    L.ln1 = ln1;
    L.ln2 = ln2;
    TORCH_CHECK(q_norm.is_none() == k_norm.is_none(), "q_norm and k_norm come together");
    if (!q_norm.is_none()) {
      L.qn = q_norm.cast<torch::Tensor>();
      L.kn = k_norm.cast<torch::Tensor>();
      check_f32(L.qn, "q_norm");
      check_f32(L.kn, "k_norm");
      TORCH_CHECK(L.qn.numel() == D_ && L.kn.numel() == D_, "q/k norm weights must have head_dim entries");
    }
    for (auto h : qkv) L.qkv.push_back(parse_lin(h));
    L.o = parse_lin(o);
    if (moe.is_none()) {
      TORCH_CHECK(!down.is_none(), "a dense layer needs down_proj");
      for (auto h : gate_up) L.gate_up.push_back(parse_lin(h));
      L.down = parse_lin(down);
      for (const Lin& l : L.gate_up) TORCH_CHECK(l.K == H_, "gate/up must read hidden_size inputs");
      const int64_t gu = parts_n(L.gate_up);
      TORCH_CHECK(gu % 2 == 0, "gate/up outputs must split in two halves");
      L.inter = gu / 2;
      TORCH_CHECK(L.down.N == H_ && L.down.K == L.inter, "down_proj shape does not match");
    } else {
      TORCH_CHECK(gate_up.empty() && down.is_none(), "a routed-expert layer has no dense gate/up or down");
      L.moe = parse_moe(moe);
    }
    L.nq = nq;
    L.nkv = nkv;
    TORCH_CHECK(nkv == 0 ? nq == 0 : nq % nkv == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(parts_n(L.qkv) == (nq + 2 * nkv) * D_, "q/k/v outputs do not match the head counts");
    for (const Lin& l : L.qkv) TORCH_CHECK(l.K == H_, "q/k/v must read hidden_size inputs");
    TORCH_CHECK(L.o.N == H_ && L.o.K == nq * D_, "o_proj shape does not match");
    layers_.push_back(std::move(L));
    k_.emplace_back();
    v_.emplace_back();
  }

  // The caller's KV cache for layers(): per layer (1, n_kv, cap, D) float32 tensors.
  void set_cache(py::list k, py::list v) {
    TORCH_CHECK(static_cast<size_t>(k.size()) == layers_.size() && v.size() == k.size(),
                "one K and one V tensor per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      torch::Tensor kt = k[i].cast<torch::Tensor>(), vt = v[i].cast<torch::Tensor>();
      check_kv(kt, vt, i);
      k_[i] = kt;
      v_[i] = vt;
    }
  }

  // One sequence's cache for layers_batch(): an int64 (L + 1, 3) table of (K address, V
  // address, capacity) per layer and a last row naming this decoder. The caller keeps the
  // tensors alive and asks again whenever the cache reallocates (KVCache.generation); the
  // shapes are checked here, once, not on every step.
  torch::Tensor cache_table(py::list k, py::list v) {
    TORCH_CHECK(static_cast<size_t>(k.size()) == layers_.size() && v.size() == k.size(),
                "one K and one V tensor per layer");
    const int64_t L = num_layers();
    auto t = torch::empty({L + 1, 3}, torch::kLong);
    int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < L; ++i) {
      torch::Tensor kt = k[i].cast<torch::Tensor>(), vt = v[i].cast<torch::Tensor>();
      check_kv(kt, vt, static_cast<size_t>(i));
      p[3 * i] = reinterpret_cast<intptr_t>(kt.data_ptr<float>());
      p[3 * i + 1] = reinterpret_cast<intptr_t>(vt.data_ptr<float>());
      p[3 * i + 2] = kt.size(2);
    }
    p[3 * L] = id_;
    p[3 * L + 1] = L;
    p[3 * L + 2] = D_;
    return t;
  }

  // x: (1, 1, H) hidden state of the token at position pos -> (1, 1, H) after every layer.
  // link: None (use the reduce callback, if any) or (role, fds, seq, timeout|-1, spin_s, table).
  // base: the absolute position held by slot 0 of the cache (a sliding-window cache that
  // dropped old positions, see KVCache.prepare).
  torch::Tensor layers(const torch::Tensor& x_in, int64_t pos, const py::object& reduce, const py::object& link,
                       int64_t base) {
    check_f32(x_in, "x");
    TORCH_CHECK(x_in.numel() == H_, "x must hold hidden_size values (one token)");
    check_position(pos, base, "");
    const size_t L = layers_.size();
    kv_.resize(L);
    for (size_t i = 0; i < L; ++i) {
      TORCH_CHECK(k_[i].defined() && k_[i].size(2) > pos - base, "KV cache of layer ", i, " cannot hold position ", pos,
                  " (call set_cache)");
      kv_[i] = KVRef{k_[i].data_ptr<float>(), v_[i].data_ptr<float>(), k_[i].size(2)};
    }
    pos_.assign(1, pos);
    base_.assign(1, base);
    return run(x_in, reduce, link);
  }

  // B tokens in one pass: x (B, H) (any shape of B * H values), row b at position pos[b] of the
  // sequence whose cache is described by tables[b] (cache_table), whose slot 0 holds position
  // base[b]; rows of one sequence at distinct positions may share its cache (see below).
  // Returns the rows after every layer, shaped like x.
  torch::Tensor layers_batch(const torch::Tensor& x_in, const std::vector<int64_t>& pos,
                             const std::vector<int64_t>& base, const std::vector<torch::Tensor>& tables,
                             const py::object& reduce, const py::object& link) {
    const int64_t B = static_cast<int64_t>(pos.size());
    TORCH_CHECK(B >= 1, "a batch needs at least one row");
    TORCH_CHECK(base.size() == pos.size() && tables.size() == pos.size(), "got ", pos.size(), " positions, ",
                base.size(), " bases and ", tables.size(), " cache tables: one of each per row");
    check_f32(x_in, "x");
    TORCH_CHECK(x_in.numel() == B * H_, "x must hold ", B, " rows of hidden_size=", H_, " values, got ", x_in.numel(),
                " values");
    const int64_t L = num_layers();
    kv_.resize(static_cast<size_t>(B * L));
    for (int64_t b = 0; b < B; ++b) {
      const torch::Tensor& t = tables[static_cast<size_t>(b)];
      TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() &&
                      t.dim() == 2 && t.size(0) == L + 1 && t.size(1) == 3,
                  "row ", b, ": not a cache table of this decoder (see cache_table)");
      const int64_t* p = t.data_ptr<int64_t>();
      TORCH_CHECK(p[3 * L] == id_ && p[3 * L + 1] == L && p[3 * L + 2] == D_, "row ", b,
                  ": the cache table belongs to another decoder");
      check_position(pos[b], base[b], "row " + std::to_string(b) + ": ");
      for (int64_t i = 0; i < L; ++i) {
        TORCH_CHECK(p[3 * i + 2] > pos[b] - base[b], "row ", b, ": KV cache of layer ", i, " cannot hold position ",
                    pos[b], " (reserve it and take a new cache_table)");
        kv_[b * L + i] =
            KVRef{reinterpret_cast<float*>(p[3 * i]), reinterpret_cast<float*>(p[3 * i + 1]), p[3 * i + 2]};
      }
    }
    // Rows may share a cache at distinct positions (a speculative verification group: k + 1
    // consecutive tokens of one sequence): every row's K/V is written before any row attends,
    // and row b attends to positions <= pos[b] only, so each row computes what it alone would.
    // A cache without heads (a tensor-parallel rank holding none of the KV heads: Gemma 3's
    // single KV head lives on one rank) has no buffer, so every such cache has the null pointer.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < b; ++c)
        TORCH_CHECK(L == 0 || kv_[b * L].k == nullptr || kv_[b * L].k != kv_[c * L].k ||
                        (pos[b] != pos[c] && base[b] == base[c]),
                    "rows ", c, " and ", b, " write one position of one KV cache");
    pos_ = pos;
    base_ = base;
    return run(x_in, reduce, link);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // (seq, payload bytes sent, payload bytes received, seconds inside all-reduces) of the native
  // link in the last call.
  py::tuple link_state() const { return py::make_tuple(link_.seq, link_.sent, link_.received, link_.wait_s); }

 private:
  Moe parse_moe(const py::object& spec) const {
    auto t = spec.cast<py::tuple>();
    TORCH_CHECK(t.size() == 5, "moe must be (router, [(gate_up, down), ...], top_k, norm_topk, block)");
    Moe m;
    m.top_k = t[2].cast<int64_t>();
    m.norm_topk = t[3].cast<bool>();
    m.block = py::reinterpret_borrow<py::object>(t[4]);
    if (!m.block.is_none()) {
      TORCH_CHECK(PyCallable_Check(m.block.ptr()) != 0, "moe block must be callable");
      TORCH_CHECK(m.top_k >= 1, "top_k must be >= 1");
      return m;
    }
    m.router = parse_lin(t[0]);
    for (auto h : t[1].cast<py::list>()) {
      auto e = h.cast<py::tuple>();
      TORCH_CHECK(e.size() == 2, "an expert is (gate_up, down)");
      Expert ex;
      for (auto g : e[0].cast<py::list>()) ex.gate_up.push_back(parse_lin(g));
      ex.down = parse_lin(e[1]);
      for (const Lin& l : ex.gate_up) TORCH_CHECK(l.K == H_, "an expert's w1/w3 must read hidden_size inputs");
      const int64_t gu = parts_n(ex.gate_up);
      TORCH_CHECK(gu % 2 == 0, "an expert's w1/w3 outputs must split in two halves");
      ex.inter = gu / 2;
      TORCH_CHECK(ex.down.N == H_ && ex.down.K == ex.inter, "an expert's w2 shape does not match");
      m.experts.push_back(std::move(ex));
    }
    const int64_t E = static_cast<int64_t>(m.experts.size());
    TORCH_CHECK(m.router.K == H_ && m.router.N == E, "the router must map hidden_size inputs to one logit per expert (",
                E, "), got [", m.router.N, ", ", m.router.K, "]");
    TORCH_CHECK(m.top_k >= 1 && m.top_k <= E, "top_k must be in [1, ", E, "]");
    return m;
  }

  void check_kv(const torch::Tensor& kt, const torch::Tensor& vt, size_t i) const {
    check_f32(kt, "K cache");
    check_f32(vt, "V cache");
    TORCH_CHECK(kt.dim() == 4 && kt.size(0) == 1 && kt.size(1) == layers_[i].nkv && kt.size(3) == D_ &&
                    vt.sizes() == kt.sizes(),
                "K/V cache of layer ", i, " must be (1, n_kv, capacity, head_dim)");
  }

  void check_position(int64_t pos, int64_t base, const std::string& row) const {
    TORCH_CHECK(pos >= 0 && base >= 0 && base <= pos, row, "need 0 <= base <= position");
    TORCH_CHECK(base == 0 || (window_ > 0 && pos - window_ + 1 >= base), row,
                "the cache no longer holds the keys position ", pos, " attends to");
  }

  // Every layer for the rows described by pos_, base_ and kv_ (row-major [B, L]).
  torch::Tensor run(const torch::Tensor& x_in, const py::object& reduce, const py::object& link) {
    const int64_t B = static_cast<int64_t>(pos_.size());
    torch::Tensor x = x_in.clone();
    float* xp = x.data_ptr<float>();
    link_.role = 0;
    link_.sent = link_.received = 0;
    link_.wait_s = 0.0;
    if (!link.is_none()) parse_link(link, link_);
    const bool tp = !reduce.is_none() || link_.role != 0;
    if (!part_.defined() || part_.numel() < B * H_) part_ = torch::empty({B * H_}, torch::kFloat);
    {
      py::gil_scoped_release nogil;
      rope_tables(B);
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& L = layers_[i];
        attention_block(L, i, xp, B);
        combine(xp, B, tp, reduce, L.post_attn);
        ffn_block(L, xp, B);
        combine(xp, B, tp, reduce, L.post_ffn);
      }
    }
    return x;
  }

  // part_ holds B partial sums (o_proj or down_proj outputs); add them (all-reduced under TP,
  // one exchange for the whole batch, shaped (1, B, H) like the eager path's ragged batch of B
  // single tokens, so a rank on either path can sum with the other) to x; through `norm`
  // first where it is defined (Gemma's sandwich: the norm of the whole sum, on every rank).
  void combine(float* xp, int64_t B, bool tp, const py::object& reduce, const torch::Tensor& norm) {
    const int64_t n = B * H_;
    const float* src = part_.data_ptr<float>();
    torch::Tensor summed;
    if (link_.role != 0) {
      link_all_reduce(link_, part_.data_ptr<float>(), n, link_tmp_);
      add_rows(xp, src, B, norm);
      return;
    }
    if (tp) {
      py::gil_scoped_acquire gil;
      // a copy: the transport may still be sending from the tensor it was given
      summed = reduce(part_.narrow(0, 0, n).clone().view({1, B, H_})).cast<torch::Tensor>();
      TORCH_CHECK(summed.numel() == n, "the reduce hook must return as many values as it was given");
      if (summed.scalar_type() != at::kFloat || !summed.is_contiguous()) summed = summed.to(at::kFloat).contiguous();
      src = summed.data_ptr<float>();
    }
    add_rows(xp, src, B, norm);
    if (tp) {
      py::gil_scoped_acquire gil;  // drop the tensor under the GIL (it may own Python state)
      summed = torch::Tensor();
    }
  }

  // x[b] += norm(src[b]) for each of the B rows (or src[b] itself where norm is undefined).
  void add_rows(float* xp, const float* src, int64_t B, const torch::Tensor& norm) {
    if (!norm.defined()) {
      for (int64_t i = 0; i < B * H_; ++i) xp[i] += src[i];
      return;
    }
    ensure(normed_, H_);
    for (int64_t b = 0; b < B; ++b) {
      rmsnorm(src + b * H_, norm.data_ptr<float>(), normed_.data(), H_, eps_);
      for (int64_t i = 0; i < H_; ++i) xp[b * H_ + i] += normed_[i];
    }
  }

  static std::vector<float> freqs(const torch::Tensor& f, int64_t head_dim) {
    check_f32(f, "inv_freq");
    TORCH_CHECK(f.numel() == head_dim / 2 && head_dim % 2 == 0, "inv_freq must have head_dim/2 entries");
    return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
  }

  void ensure(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  }

  // cos/sin of every row's own position: [B, D/2] (global, then local where there is one).
  void rope_tables(int64_t B) {
    const int64_t h = D_ / 2;
    for (int t = 0; t < 2; ++t) {
      const std::vector<float>& inv = t == 0 ? inv_freq_ : inv_local_;
      if (inv.empty()) continue;
      ensure(cos_[t], B * h);
      ensure(sin_[t], B * h);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < h; ++i) {
          const float f = static_cast<float>(pos_[b]) * inv[i];
          cos_[t][b * h + i] = std::cos(f);
          sin_[t][b * h + i] = std::sin(f);
        }
    }
  }

  // table: Layer::rope (1 global, 2 local)
  void rope(float* v, int64_t b, int table) const {
    const int64_t h = D_ / 2;
    const float* c = cos_[table - 1].data() + b * h;
    const float* s = sin_[table - 1].data() + b * h;
    for (int64_t i = 0; i < h; ++i) {
      const float a = v[i], w = v[i + h];
      v[i] = a * c[i] - w * s[i];
      v[i + h] = w * c[i] + a * s[i];
    }
  }

  // Query heads of one KV head processed together by attention_block (larger groups in turns).
  static constexpr int64_t kMaxGroup = 8;

  void attention_block(const Layer& L, size_t li, const float* xp, int64_t B) {
    const int64_t nq = L.nq, nkv = L.nkv, D = D_, QKV = (nq + 2 * nkv) * D, nl = num_layers();
    ensure(xn_, B * H_);
    for (int64_t b = 0; b < B; ++b) rmsnorm(xp + b * H_, L.ln1.data_ptr<float>(), xn_.data() + b * H_, H_, eps_);
    ensure(qkv_, B * QKV);
    run_parts(L.qkv, xn_.data(), H_, B, qkv_.data(), QKV, qs_);
    ensure(att_, B * nq * D);
    int64_t max_s = 0;
    for (int64_t b = 0; b < B; ++b) {
      float* q = qkv_.data() + b * QKV;
      float* k = q + nq * D;
      float* v = k + nkv * D;
      if (L.qn.defined()) {  // per head, before rotary; in place (rmsnorm reads x[i], then writes y[i])
        for (int64_t h = 0; h < nq; ++h) rmsnorm(q + h * D, L.qn.data_ptr<float>(), q + h * D, D, eps_);
        for (int64_t h = 0; h < nkv; ++h) rmsnorm(k + h * D, L.kn.data_ptr<float>(), k + h * D, D, eps_);
      }
      if (L.rope != 0) {
        for (int64_t h = 0; h < nq; ++h) rope(q + h * D, b, L.rope);
        for (int64_t h = 0; h < nkv; ++h) rope(k + h * D, b, L.rope);
      }
      if (nkv == 0) continue;
      const KVRef& c = kv_[b * nl + static_cast<int64_t>(li)];
      const int64_t slot = pos_[b] - base_[b];
      for (int64_t g = 0; g < nkv; ++g) {
        std::copy(k + g * D, k + (g + 1) * D, c.k + (g * c.cap + slot) * D);
        std::copy(v + g * D, v + (g + 1) * D, c.v + (g * c.cap + slot) * D);
      }
      max_s = std::max(max_s, pos_[b] + 1 - first_key(b, L.window));
    }
    if (nkv > 0) {
      const int64_t group = nq / nkv;
      const float scale = scale_;
      // One task per (row, KV head): the group's query heads walk the cached keys and values
      // together, so each K/V row is read from memory once and reused from L1 by the others
      // (and the heads' independent updates hide each other's latency). Per head the
      // operations and their order are those of one head alone: the same bits. With fewer
      // (row, KV head) pairs than threads (one sequence of a model with one KV head, Gemma 3
      // 270M) each group's heads are split across tasks, so attention uses every thread too.
      const int64_t pairs = B * nkv, threads = lbq::num_threads();
      const int64_t split = std::min(group, std::max<int64_t>(1, (threads + pairs - 1) / pairs));
      const int64_t chunk = (group + split - 1) / split;
      lbq::parallel_for(0, pairs * split, 1, [&](int64_t t0, int64_t t1) {
        thread_local std::vector<float> scores;
        const size_t need = static_cast<size_t>(group * max_s);
        if (scores.size() < need) scores.resize(need);
        float mx[kMaxGroup], inv[kMaxGroup];
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t b = t / split / nkv, g = t / split % nkv;
          const int64_t hs = t % split * chunk, he = std::min(group, hs + chunk);
          const KVRef& c = kv_[b * nl + static_cast<int64_t>(li)];
          const int64_t first = first_key(b, L.window);
          const int64_t lo = first - base_[b];  // slot of the first key this token sees
          const int64_t S = pos_[b] + 1 - first;
          const float* q0 = qkv_.data() + b * QKV + g * group * D;
          const float* kg = c.k + (g * c.cap + lo) * D;
          const float* vg = c.v + (g * c.cap + lo) * D;
          for (int64_t h0 = hs; h0 < he; h0 += kMaxGroup) {
            const int64_t G = std::min(kMaxGroup, he - h0);
            const float* q = q0 + h0 * D;
            float* out = att_.data() + (b * nq + g * group + h0) * D;
            for (int64_t j = 0; j < G; ++j) mx[j] = -INFINITY;
            for (int64_t s = 0; s < S; ++s) {
              const float* kr = kg + s * D;
              float dots[kMaxGroup];
              key_dots(kr, q, D, G, dots);
              for (int64_t j = 0; j < G; ++j) {
                float& x = scores[static_cast<size_t>(j * S + s)];
                x = dots[j] * scale;
                mx[j] = std::max(mx[j], x);
              }
            }
            for (int64_t j = 0; j < G; ++j) {
              float* sc = scores.data() + j * S;
              float sum = 0.f;
              for (int64_t s = 0; s < S; ++s) {
                sc[s] = std::exp(sc[s] - mx[j]);
                sum += sc[s];
              }
              inv[j] = 1.f / sum;
            }
            weighted_values(scores.data(), inv, vg, S, D, G, out);
          }
        }
      });
    }
    float* part = part_.data_ptr<float>();
    run_lin(L.o, att_.data(), nq * D, B, part, H_, qs_);
    if (L.o.N == 0) std::fill(part, part + B * H_, 0.f);
  }

  // The first absolute position row b's token attends to in a layer of window W (0: all).
  int64_t first_key(int64_t b, int64_t W) const { return W > 0 ? std::max<int64_t>(0, pos_[b] - W + 1) : 0; }

  void ffn_block(const Layer& L, const float* xp, int64_t B) {
    for (int64_t b = 0; b < B; ++b) rmsnorm(xp + b * H_, L.ln2.data_ptr<float>(), xn_.data() + b * H_, H_, eps_);
    if (L.moe.top_k > 0) {
      moe_block(L.moe, B);
      return;
    }
    glu(L.gate_up, L.down, L.inter, act_, xn_.data(), B, part_.data_ptr<float>());
  }

  // y (M rows of H) = down(act(gate(x)) * up(x)) for the M rows x (H apart) of one gated MLP.
  void glu(const std::vector<Lin>& gate_up, const Lin& down, int64_t I, int act, const float* x, int64_t M, float* y) {
    ensure(gu_, M * 2 * I);
    run_parts(gate_up, x, H_, M, gu_.data(), 2 * I, qs_);
    // The activation in chunks of kActChunk values of every row, split over threads (one
    // sequence's 2 x I values are work for every thread too); elementwise, so the split
    // never changes a value.
    constexpr int64_t kActChunk = 512;
    const int64_t nc = (I + kActChunk - 1) / kActChunk;
    lbq::parallel_for(0, M * nc, 2, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float* g = gu_.data() + c / nc * 2 * I;
        const float* u = g + I;
        const int64_t i0 = c % nc * kActChunk, i1 = std::min(I, i0 + kActChunk);
        if (act == kGeluTanh)
          geglu(g + i0, u + i0, i1 - i0);
        else
          for (int64_t i = i0; i < i1; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      }
    });
    // SwiGLU wrote each row's product over its gate half: rows 2I apart
    run_lin(down, gu_.data(), 2 * I, M, y, H_, qs_);
  }

  // The routed experts of the B rows in xn_ into part_, as SparseMoE.forward computes them:
  // router logits, softmax over all E experts in float32 (exp(l - max) times 1 / sum), the top
  // k (largest first), divided by their sum where norm_topk is set; then expert after expert in
  // ascending id, the rows that chose it gathered into one M-row pass over its weights (each
  // row computes what it alone would: the kernels keep rows independent), and each row's
  // output scaled by its weight and added to the row's sum (zero first), in that order.
  void moe_block(const Moe& m, int64_t B) {
    if (!m.block.is_none()) {
      external_block(m.block, B);
      return;
    }
    const int64_t E = static_cast<int64_t>(m.experts.size()), k = m.top_k;
    ensure(logits_, B * E);
    run_lin(m.router, xn_.data(), H_, B, logits_.data(), E, qs_);
    route_e_.resize(static_cast<size_t>(B * k));
    route_w_.resize(static_cast<size_t>(B * k));
    for (int64_t b = 0; b < B; ++b)
      route(logits_.data() + b * E, E, k, m.norm_topk, &route_e_[b * k], &route_w_[b * k]);
    float* out = part_.data_ptr<float>();
    std::fill(out, out + B * H_, 0.f);
    for (int64_t e = 0; e < E; ++e) {
      rows_.clear();
      for (int64_t i = 0; i < B * k; ++i)
        if (route_e_[i] == e) rows_.push_back(i);  // row i / k, weight route_w_[i]
      if (rows_.empty()) continue;
      const int64_t M = static_cast<int64_t>(rows_.size());
      ensure(xe_, M * H_);
      ensure(ye_, M * H_);
      for (int64_t r = 0; r < M; ++r) std::copy_n(xn_.data() + rows_[r] / k * H_, H_, xe_.data() + r * H_);
      const Expert& ex = m.experts[static_cast<size_t>(e)];
      glu(ex.gate_up, ex.down, ex.inter, kSilu, xe_.data(), M, ye_.data());
      for (int64_t r = 0; r < M; ++r) {
        const float w = route_w_[rows_[r]];
        float* y = ye_.data() + r * H_;
        float* o = out + rows_[r] / k * H_;
        for (int64_t i = 0; i < H_; ++i) y[i] *= w;  // the product first, then the sum (no fma)
        for (int64_t i = 0; i < H_; ++i) o[i] += y[i];
      }
    }
  }

  // part_ = block(xn_ as (1, B, H)): experts outside the model, computed in Python.
  void external_block(const py::object& block, int64_t B) {
    py::gil_scoped_acquire gil;
    torch::Tensor x = torch::from_blob(xn_.data(), {1, B, H_}, torch::kFloat).clone();
    torch::Tensor y = block(x).cast<torch::Tensor>();
    TORCH_CHECK(y.numel() == B * H_, "the routed-expert block must return as many values as it was given");
    if (y.scalar_type() != at::kFloat || !y.is_contiguous()) y = y.to(at::kFloat).contiguous();
    std::copy_n(y.data_ptr<float>(), B * H_, part_.data_ptr<float>());
  }

  // One row's routing: the k largest softmax probabilities of the E logits l (ties: the lower
  // expert id first) into ids / w, largest first, divided by their sum where norm is set.
  static void route(const float* l, int64_t E, int64_t k, bool norm, int64_t* ids, float* w) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
    thread_local std::vector<float> p;
    p.resize(static_cast<size_t>(E));
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - mx);
      sum += p[e];
    }
    const float inv = 1.f / sum;
    for (int64_t e = 0; e < E; ++e) p[e] *= inv;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ids[j] = best;
      w[j] = p[best];
    }
    if (!norm) return;
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) s += w[j];
    for (int64_t j = 0; j < k; ++j) w[j] /= s;
  }

  int64_t H_, D_;
  float eps_;
  int64_t window_;
  float scale_;
  int act_;
  int64_t id_;  // names this decoder in its cache tables
  std::vector<float> inv_freq_, inv_local_, normed_;
  std::vector<float> cos_[2], sin_[2];  // [global, local] of the running call
  std::vector<Layer> layers_;
  std::vector<torch::Tensor> k_, v_;  // the cache of layers() (set_cache)
  std::vector<int64_t> pos_, base_;   // per row of the running call
  std::vector<KVRef> kv_;             // [B, L] of the running call
  torch::Tensor part_;
  std::vector<float> xn_, qkv_, att_, gu_;
  std::vector<float> logits_, route_w_, xe_, ye_;  // routed experts (moe_block)
  std::vector<int64_t> route_e_, rows_;
  QScratch qs_;
  Link link_;
  std::vector<float> link_tmp_;
};

// logits (M, N) = lin(rmsnorm(x)) for the LM head: x holds M rows of H values; one pass over
// the head's weights for all of them.
torch::Tensor head(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, py::tuple lin) {
  check_f32(x, "x");
  check_f32(norm_w, "norm weight");
  const Lin l = parse_lin(lin);
  const int64_t H = norm_w.numel();
  TORCH_CHECK(l.K == H && H > 0 && x.numel() % H == 0 && x.numel() > 0, "head shapes do not match (x has ", x.numel(),
              " values, the head reads rows of ", l.K, ")");
  const int64_t M = x.numel() / H;
  auto y = torch::empty({M, l.N}, torch::kFloat);
  std::vector<float> xn(static_cast<size_t>(M * H));
  QScratch qs;
  {
    py::gil_scoped_release nogil;
    for (int64_t m = 0; m < M; ++m)
      rmsnorm(x.data_ptr<float>() + m * H, norm_w.data_ptr<float>(), xn.data() + m * H, H, static_cast<float>(eps));
    run_lin(l, xn.data(), H, M, y.data_ptr<float>(), l.N, qs);
  }
  return y;
}

}  // namespace

void init_decode(py::module_& m) {
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, double, torch::Tensor, int64_t, double, int64_t, py::object>(), py::arg("hidden"),
           py::arg("head_dim"), py::arg("eps"), py::arg("inv_freq"), py::arg("window"), py::arg("scale") = 0.0,
           py::arg("act") = 0, py::arg("inv_freq_local") = py::none())
      .def("add_layer", &Decoder::add_layer, py::arg("ln1"), py::arg("ln2"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("nq"), py::arg("nkv"), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("post_attn") = py::none(), py::arg("post_ffn") = py::none(),
           py::arg("window") = -1, py::arg("rope") = 1, py::arg("moe") = py::none())
      .def("set_cache", &Decoder::set_cache)
      .def("cache_table", &Decoder::cache_table, py::arg("k"), py::arg("v"))
      .def("layers", &Decoder::layers, py::arg("x"), py::arg("pos"), py::arg("reduce") = py::none(),
           py::arg("link") = py::none(), py::arg("base") = 0)
      .def("layers_batch", &Decoder::layers_batch, py::arg("x"), py::arg("pos"), py::arg("base"), py::arg("tables"),
           py::arg("reduce") = py::none(), py::arg("link") = py::none())
      .def("link_state", &Decoder::link_state)
      .def("num_layers", &Decoder::num_layers);
  m.def("head", &head, "logits = lm_head(rmsnorm(x)) for rows of x");
  m.def("link_all_reduce", &link_all_reduce_once, py::arg("x"), py::arg("link"),
        "test hook: one native star-link all-reduce of x in place -> (seq, sent, received, seconds)");
}
