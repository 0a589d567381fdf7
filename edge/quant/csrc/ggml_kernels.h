// GEMV / small-batch GEMM for llama.cpp block formats kept packed as in the GGUF file:
// y[M,N] = x[M,K] @ W^T with W row n = K/QK blocks back to back (edge/quant/ggml.py is the
// reference; bit positions follow ggml's dequantize_row_*).
//
// Design: every format is decoded one block at a time into integers q[QK] (int8) and, per 16
// values, an affine pair (a, b) with  w = a * q + b.  The dot product with fp32 activations is
//   sum_s  a_s * (sum_{i in s} q_i x_i)  +  b_s * (sum_{i in s} x_i)
// where the per-16 activation sums are computed once per call (xs16).  Activations stay fp32,
// so the result equals the dequantized reference to fp32 rounding (no activation quantization).
// A decoded block is reused for all M activation rows while it is hot in L1.
//
// The decoders are plain C++ shared by every path (GCC vectorizes the byte loops); only the
// 16-value fp32 dot differs: AVX2+FMA, NEON (aarch64), scalar.  The ISA macros come from
// gemv_kernels.h, which must be included first.
#pragma once

#include <cstdint>
#include <cstring>

#include "gemv_kernels.h"

namespace lbq {
namespace ggml {

enum Type : int { Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// ---- decoders: block -> q[QK], a[QK/16], b[QK/16] ------------------------------------------
// Q4_1 / Q5_0 / Q5_1 (QK = 32): d [, m] [, qh[4]], qs[16]; value j in the low nibble of qs[j],
// value j+16 in the high nibble; 5th bit of value j is bit j of qh.
template <bool FIVE, bool MIN>
inline void decode32(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const float d = f16(blk);
  const float m = MIN ? f16(blk + 2) : 0.f;
  const uint8_t* p = blk + (MIN ? 4 : 2);
  uint32_t qh = 0;
  if (FIVE) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  for (int j = 0; j < 16; ++j) {
    int lo = p[j] & 0x0F, hi = p[j] >> 4;
    if (FIVE) {
      lo |= ((qh >> j) & 1) << 4;
      hi |= ((qh >> (j + 16)) & 1) << 4;
      if (!MIN) lo -= 16, hi -= 16;
    }
    q[j] = static_cast<int8_t>(lo);
    q[j + 16] = static_cast<int8_t>(hi);
  }
  a[0] = a[1] = d;
  b[0] = b[1] = m;
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
// Value 128h + 32j + l: bits 2j..2j+1 of qs[32h + l]; sub-block (value / 16).
inline void decode_q2k(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const uint8_t* sc = blk;
  const uint8_t* qs = blk + 16;
  const float d = f16(blk + 80), dmin = f16(blk + 82);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * j)) & 3);
  for (int s = 0; s < 16; ++s) {
    a[s] = d * static_cast<float>(sc[s] & 0x0F);
    b[s] = -(dmin * static_cast<float>(sc[s] >> 4));
  }
}

// Q3_K: hmask[32], qs[64], scales[12], d.  Value 32i + l: low 2 bits as Q2_K, minus 4 unless
// bit i of hmask[l] is set; 16 six-bit scales stored -32 (low nibbles in bytes 0..7, two high
// bits of scale s in byte 8 + s%4 at bit 2*(s/4)).
inline void decode_q3k(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const uint8_t* hm = blk;
  const uint8_t* qs = blk + 32;
  const uint8_t* s = blk + 96;
  const float d = f16(blk + 108);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int i = 4 * h + j;
        const int low = (qs[32 * h + l] >> (2 * j)) & 3;
        q[32 * i + l] = static_cast<int8_t>(low - (((hm[l] >> i) & 1) ? 0 : 4));
      }
  for (int k = 0; k < 16; ++k) {
    const int lo4 = k < 8 ? (s[k] & 0x0F) : (s[k - 8] >> 4);
    const int hi2 = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    a[k] = d * static_cast<float>((lo4 | (hi2 << 4)) - 32);
    b[k] = 0.f;
  }
}

// Q4_K / Q5_K: d, dmin, scales[12] (get_scale_min_k4), [qh[32],] qs[128].
// Value 64j + l: low nibble of qs[32j + l]; value 64j + 32 + l: its high nibble; the 5th bit of
// value 32i + l is bit i of qh[l].  Scale/min per 32 values.
template <bool FIVE>
inline void decode_q45k(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const float d = f16(blk), dmin = f16(blk + 2);
  const uint8_t* s = blk + 4;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (FIVE ? 48 : 16);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 0x0F);
      q[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
    }
  if (FIVE)
    for (int i = 0; i < 8; ++i)
      for (int l = 0; l < 32; ++l) q[32 * i + l] = static_cast<int8_t>(q[32 * i + l] | (((qh[l] >> i) & 1) << 4));
  for (int i = 0; i < 8; ++i) {
    int sc, mn;
    if (i < 4) {
      sc = s[i] & 63;
      mn = s[i + 4] & 63;
    } else {
      sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 6) << 4);
      mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
    a[2 * i] = a[2 * i + 1] = d * static_cast<float>(sc);
    b[2 * i] = b[2 * i + 1] = -(dmin * static_cast<float>(mn));
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8), d.  In half h (128 values, ql += 64h, qh += 32h):
// value 32c + l (c = 0..3) = (ql[l + 32(c%2)] >> 4(c/2)) & 15 | ((qh[l] >> 2c) & 3) << 4, - 32.
inline void decode_q6k(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const float d = f16(blk + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = (ql[l + 32 * (c % 2)] >> (4 * (c / 2))) & 0x0F;
        const int hi = (qh[l] >> (2 * c)) & 3;
        q[128 * h + 32 * c + l] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      }
  }
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  for (int s = 0; s < 16; ++s) {
    a[s] = d * static_cast<float>(sc[s]);
    b[s] = 0.f;
  }
}

template <int T>
struct Traits;
template <> struct Traits<Q4_1> { static constexpr int QK = 32, SIZE = 20; static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<false, true>(p, q, a, b); } };
template <> struct Traits<Q5_0> { static constexpr int QK = 32, SIZE = 22; static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, false>(p, q, a, b); } };
template <> struct Traits<Q5_1> { static constexpr int QK = 32, SIZE = 24; static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, true>(p, q, a, b); } };
template <> struct Traits<Q2_K> { static constexpr int QK = 256, SIZE = 84; static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q2k(p, q, a, b); } };
template <> struct Traits<Q3_K> { static constexpr int QK = 256, SIZE = 110; static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q3k(p, q, a, b); } };
template <> struct Traits<Q4_K> { static constexpr int QK = 256, SIZE = 144; static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q45k<false>(p, q, a, b); } };
template <> struct Traits<Q5_K> { static constexpr int QK = 256, SIZE = 176; static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q45k<true>(p, q, a, b); } };
template <> struct Traits<Q6_K> { static constexpr int QK = 256, SIZE = 210; static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q6k(p, q, a, b); } };

// Block size and bytes per block of a type id, or false for an unknown id.
inline bool block_shape(int type, int* qk, int* size) {
  switch (type) {
#define LBQ_GGML_CASE(T) case T: *qk = Traits<T>::QK; *size = Traits<T>::SIZE; return true;
    LBQ_GGML_CASE(Q4_1) LBQ_GGML_CASE(Q5_0) LBQ_GGML_CASE(Q5_1) LBQ_GGML_CASE(Q2_K)
    LBQ_GGML_CASE(Q3_K) LBQ_GGML_CASE(Q4_K) LBQ_GGML_CASE(Q5_K) LBQ_GGML_CASE(Q6_K)
#undef LBQ_GGML_CASE
    default: return false;
  }
}

// ---- the 16-value dot: sum_s a_s * dot(q[16s:16s+16], x[16s:16s+16]) over NS sub-blocks ----
template <int NS>
inline float block_dot(const int8_t* q, const float* a, const float* x) {
#if defined(LBQ_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (int s = 0; s < NS; ++s) {
    const __m128i q16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * s));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q16));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q16, 8)));
    __m256 t = _mm256_mul_ps(lo, _mm256_loadu_ps(x + 16 * s));
    t = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 16 * s + 8), t);
    acc = _mm256_fmadd_ps(t, _mm256_set1_ps(a[s]), acc);
  }
  return hsum_ps(acc);
#elif defined(LBQ_NEON)
  float32x4_t acc = vdupq_n_f32(0.f);
  for (int s = 0; s < NS; ++s) {
    const int8x16_t q16 = vld1q_s8(q + 16 * s);
    const int16x8_t l16 = vmovl_s8(vget_low_s8(q16)), h16 = vmovl_s8(vget_high_s8(q16));
    const float* xs = x + 16 * s;
    float32x4_t t = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(l16))), vld1q_f32(xs));
    t = vfmaq_f32(t, vcvtq_f32_s32(vmovl_s16(vget_high_s16(l16))), vld1q_f32(xs + 4));
    t = vfmaq_f32(t, vcvtq_f32_s32(vmovl_s16(vget_low_s16(h16))), vld1q_f32(xs + 8));
    t = vfmaq_f32(t, vcvtq_f32_s32(vmovl_s16(vget_high_s16(h16))), vld1q_f32(xs + 12));
    acc = vfmaq_n_f32(acc, t, a[s]);
  }
  return vaddvq_f32(acc);
#else
  float acc = 0.f;
  for (int s = 0; s < NS; ++s) {
    float t = 0.f;
    for (int i = 0; i < 16; ++i) t += static_cast<float>(q[16 * s + i]) * x[16 * s + i];
    acc += a[s] * t;
  }
  return acc;
#endif
}

// Rows n0..n1 of Y [M, N] (fp32).  w: N rows of row_bytes; x: [M, K]; xs16: [M, K/16] sums of
// 16 consecutive activations (only read by types with a non-zero b).
template <int T>
inline void gemv_rows_t(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs16,
                        int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* Y, float* acc) {
  using Tr = Traits<T>;
  constexpr int QK = Tr::QK, NS = QK / 16;
  alignas(32) int8_t q[QK];
  float a[NS], b[NS];
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
    for (int64_t blk = 0; blk < nb; ++blk) {
      Tr::decode(wr + blk * Tr::SIZE, q, a, b);
      for (int64_t m = 0; m < M; ++m) {
        float v = block_dot<NS>(q, a, x + m * K + blk * QK);
        if (Tr::MIN) {
          const float* xs = xs16 + m * (K / 16) + blk * NS;
          for (int s = 0; s < NS; ++s) v += b[s] * xs[s];
        }
        acc[m] += v;
      }
    }
    for (int64_t m = 0; m < M; ++m) Y[m * N + n] = acc[m];
  }
}

// Per-16 sums of each activation row: xs16 [M, K/16].
inline void sums16(const float* x, int64_t M, int64_t K, float* xs16) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < K / 16; ++s) {
      float t = 0.f;
      for (int i = 0; i < 16; ++i) t += x[m * K + 16 * s + i];
      xs16[m * (K / 16) + s] = t;
    }
}

// Dispatch on the type id; acc is scratch of M floats.  Returns false for an unknown type.
inline bool gemv_rows(int type, const uint8_t* w, int64_t row_bytes, const float* x, const float* xs16,
                      int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* Y, float* acc) {
  switch (type) {
#define LBQ_GGML_CASE(T) case T: gemv_rows_t<T>(w, row_bytes, x, xs16, M, K, N, n0, n1, Y, acc); return true;
    LBQ_GGML_CASE(Q4_1) LBQ_GGML_CASE(Q5_0) LBQ_GGML_CASE(Q5_1) LBQ_GGML_CASE(Q2_K)
    LBQ_GGML_CASE(Q3_K) LBQ_GGML_CASE(Q4_K) LBQ_GGML_CASE(Q5_K) LBQ_GGML_CASE(Q6_K)
#undef LBQ_GGML_CASE
    default: return false;
  }
}

}  // namespace ggml
}  // namespace lbq
