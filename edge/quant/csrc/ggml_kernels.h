// GEMV / small-batch GEMM for llama.cpp block formats kept packed as in the GGUF file:
// y[M,N] = x[M,K] @ W^T with W row n = K/QK blocks back to back (edge/quant/ggml.py is the
// reference; bit positions follow ggml's dequantize_row_*).
//
// Design: every format is decoded one block at a time into integers q[QK] (int8, |q| <= 32)
// and, per 16 values, an affine pair (a, b) with  w = a * q + b.  Activations are quantized
// once per call to int8 per 32 values (quantize_act_row: d = max|x|/127, as the Q8/Q4 kernels
// and llama.cpp's Q8 activations do), so with xq_i = round(x_i / d_c) the dot product is
//   sum_s  a_s * d_c(s) * (sum_{i in s} q_i xq_i)   +   b_s * (sum_{i in s} x_i)
// with exact int32 sub-block dots and the per-16 sums of the fp32 activations (xs16, computed
// once per call).  The error against the dequantized reference is the activation rounding
// only (<= d_c/2 per value), as for the Q8/Q4 kernels.
//
// Two routes compute this.  On AVX2 the K-quants (Q2_K..Q6_K) take the fused kernels (Fused,
// kdot): a super-block is unpacked in registers and dotted with the int8 activations directly,
// one weight row at a time for a single activation row (decode) and a few (decode batches);
// for more (prefill) an AVX-512 VNNI build runs gemm_rows (16 weight rows in the lanes of a
// zmm, no horizontal sums), an AVX2 build 32 x 8 blocks of weight x activation rows.  All of
// them do kdot's float arithmetic in kdot's order, so an output's bits do not depend on M.
// Everything else (the 32-value formats; NEON and scalar builds) decodes a block into q[QK],
// a, b and dots it with up to 4 activation rows: the decoders are plain C++ shared by every
// path (GCC vectorizes the byte loops; AVX2 has its own decoders), the integer sub-block dot
// is AVX2 (maddubs or AVX-VNNI), NEON (SDOT or vmull) or scalar.  The ISA macros come from
// gemv_kernels.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemv_kernels.h"

namespace lbq {
namespace ggml {

enum Type : int { Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// X(T) for every type above: the one list each dispatch on a type id expands.
#define LBQ_GGML_TYPES(X) X(Q4_1) X(Q5_0) X(Q5_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K)

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// ---- decoders: block -> q[QK], a[QK/16], b[QK/16] ------------------------------------------
// Q4_1 / Q5_0 / Q5_1 (QK = 32): d [, m] [, qh[4]], qs[16]; value j in the low nibble of qs[j],
// value j+16 in the high nibble; 5th bit of value j is bit j of qh.
template <bool FIVE, bool MIN, bool PORTABLE = false>
inline void decode32(const uint8_t* blk, int8_t* q, float* a, float* b) {
  const float d = f16(blk);
  const float m = MIN ? f16(blk + 2) : 0.f;
  const uint8_t* p = blk + (MIN ? 4 : 2);
  uint32_t qh = 0;
  if (FIVE) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  a[0] = a[1] = d;
  b[0] = b[1] = m;
#if defined(LBQ_AVX2)
  if (!PORTABLE) {
    // One 32-byte store (a byte loop here stalls the vector loads that follow on store forwarding).
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), m4), _mm_and_si128(t, m4));
    if (FIVE) {  // byte i = 0xFF where bit i of qh is set (llama.cpp's bytes_from_bits_32)
      const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
      __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
      bits = _mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
      bits = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
      v = _mm256_or_si256(v, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
      if (!MIN) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
    return;
  }
#endif
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

#if defined(LBQ_AVX2)
// AVX2 decoders (same output as the portable ones above; selftest.cpp checks byte for byte):
// whole 32-byte stores, so the vector loads of the dot that follows forward from them.
inline __m256i ld32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void st32(int8_t* q, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
}
inline __m256i srl16(__m256i v, int n) {
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n));
}
// 0xFF in each byte of v whose bit i is set.
inline __m256i bit_set(__m256i v, int i) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(1 << i));
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m);
}
// a[16] = d * float(s[16]) from 16 int8 scales.
inline void scale16(const int8_t* s, float d, float* a) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_storeu_ps(a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
  _mm256_storeu_ps(a + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
}

// The 16 six-bit Q3_K scales minus 32, as int8, with 32-bit masks (llama.cpp's kmask trick):
// byte k of aux is scale k.
inline __m128i q3k_scales(const uint8_t* blk) {
  uint32_t aux[4];
  std::memcpy(aux, blk + 96, 12);
  const uint32_t km1 = 0x03030303u, km2 = 0x0f0f0f0fu, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & km2) | (((tmp >> 4) & km1) << 4);
  aux[3] = ((aux[1] >> 4) & km2) | (((tmp >> 6) & km1) << 4);
  aux[0] = (aux[0] & km2) | ((tmp & km1) << 4);
  aux[1] = (aux[1] & km2) | (((tmp >> 2) & km1) << 4);
  return _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(aux)), _mm_set1_epi8(32));
}

// Q4_K / Q5_K per-32 scales av = d * sc and min terms bv = -dmin * mn (natural order) from the
// 12 bytes b of get_scale_min_k4, in SSE registers: scale j < 4 is b[j] & 63, min j < 4 is
// b[j+4] & 63; for j >= 4 the low 4 bits come from b[j+4] (scale: low nibble, min: high
// nibble) and the top 2 from bits 6-7 of b[j-4] (scale) / b[j] (min).
inline void q45k_scales(const uint8_t* blk, __m256* av, __m256* bv) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));  // 12 bytes used
  const __m128i low =
      _mm_and_si128(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, -1, -1, -1, -1)),
                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i mhi = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)),
                                       _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30)),
                                       _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i sm = _mm_or_si128(_mm_or_si128(low, mhi), top);  // bytes 0-7 scales, 8-15 mins
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
  *av = _mm256_mul_ps(_mm256_set1_ps(f16(blk)), sc);
  *bv = _mm256_mul_ps(_mm256_set1_ps(-f16(blk + 2)), mn);  // == -(dmin * mn)
}

struct KUnp {
  __m256i w[8];   // chunk c: the unsigned values 32c..32c+31
  __m256 a0, a1;  // SUB32: a0 per-32 scales; else scales of sub-blocks 0-7 / 8-15 in kFold order
  __m256 b0, b1;  // SUB32 with MIN: b0 per-32 min terms; Q2_K: per-16 min terms 0-7 / 8-15
};

// a0, a1 = d * s in kFold order from the 16 int8 scales s of sub-blocks 0-15.
inline void fold_scales(__m128i s, float d, KUnp& u) {
  const __m128i p = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  const __m256 dv = _mm256_set1_ps(d);
  u.a0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p)));
  u.a1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(p, 8))));
}

template <bool FIVE>
inline void unpack_q45k(const uint8_t* blk, KUnp& u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  const uint8_t* qs = blk + (FIVE ? 48 : 16);
  const __m256i qh = FIVE ? ld32(blk + 16) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = ld32(qs + 32 * j);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (FIVE) {
      lo = _mm256_or_si256(lo, _mm256_and_si256(bit_set(qh, 2 * j), sixteen));
      hi = _mm256_or_si256(hi, _mm256_and_si256(bit_set(qh, 2 * j + 1), sixteen));
    }
    u.w[2 * j] = lo;
    u.w[2 * j + 1] = hi;
  }
  q45k_scales(blk, &u.a0, &u.b0);
}

inline void unpack_q6k(const uint8_t* blk, KUnp& u) {  // values q + 32 in 0..63
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = ld32(blk + 64 * h), l1 = ld32(blk + 64 * h + 32), hv = ld32(blk + 128 + 32 * h);
    const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30);
    const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30);
    const __m256i h2 = _mm256_and_si256(hv, m30);
    const __m256i h3 = _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30);
    u.w[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), h0);
    u.w[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), h1);
    u.w[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h2);
    u.w[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h3);
  }
  fold_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)), f16(blk + 208), u);
}

inline void unpack_q3k(const uint8_t* blk, KUnp& u) {  // values q + 4 in 0..7
  const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  const __m256i hm = ld32(blk);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = ld32(blk + 32 + 32 * h);
    for (int j = 0; j < 4; ++j)
      u.w[4 * h + j] =
          _mm256_or_si256(_mm256_and_si256(srl16(v, 2 * j), m3), _mm256_and_si256(bit_set(hm, 4 * h + j), four));
  }
  fold_scales(q3k_scales(blk), f16(blk + 108), u);
}

inline void unpack_q2k(const uint8_t* blk, KUnp& u) {
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = ld32(blk + 16 + 32 * h);
    for (int j = 0; j < 4; ++j) u.w[4 * h + j] = _mm256_and_si256(srl16(v, 2 * j), m3);
  }
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i mn = _mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F));
  fold_scales(_mm_and_si128(s, _mm_set1_epi8(0x0F)), f16(blk + 80), u);
  const __m256 nd = _mm256_set1_ps(-f16(blk + 82));  // -(dmin * mn) == (-dmin) * mn exactly
  u.b0 = _mm256_mul_ps(nd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn)));
  u.b1 = _mm256_mul_ps(nd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(mn, 8))));
}

// The AVX2 decoders: a fused kernel's unpack (below), the offset taken off the values, and the
// scales in natural order (the unpack folds them for the hadd order of the fused dots).
inline void store_minus(const KUnp& u, int8_t* q, int offset) {
  const __m256i o = _mm256_set1_epi8(static_cast<char>(offset));
  for (int c = 0; c < 8; ++c) st32(q + 32 * c, _mm256_sub_epi8(u.w[c], o));
}

inline void decode_q2k_avx2(const uint8_t* blk, int8_t* q, float* a, float* b) {
  KUnp u;
  unpack_q2k(blk, u);
  store_minus(u, q, 0);
  alignas(16) int8_t sc[16], mn[16];
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  _mm_store_si128(reinterpret_cast<__m128i*>(sc), _mm_and_si128(s, _mm_set1_epi8(0x0F)));
  _mm_store_si128(reinterpret_cast<__m128i*>(mn), _mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F)));
  scale16(sc, f16(blk + 80), a);
  scale16(mn, -f16(blk + 82), b);  // -(dmin * mn) == (-dmin) * mn exactly
}

inline void decode_q3k_avx2(const uint8_t* blk, int8_t* q, float* a, float* b) {
  KUnp u;
  unpack_q3k(blk, u);
  store_minus(u, q, 4);
  alignas(16) int8_t sc[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(sc), q3k_scales(blk));
  scale16(sc, f16(blk + 108), a);
  std::memset(b, 0, 16 * sizeof(float));
}

template <bool FIVE>
inline void decode_q45k_avx2(const uint8_t* blk, int8_t* q, float* a, float* b) {
  KUnp u;
  unpack_q45k<FIVE>(blk, u);  // a0, b0: the 8 per-32 scales and min terms, natural order
  store_minus(u, q, 0);
  const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  _mm256_storeu_ps(a, _mm256_permutevar8x32_ps(u.a0, dup_lo));
  _mm256_storeu_ps(a + 8, _mm256_permutevar8x32_ps(u.a0, dup_hi));
  _mm256_storeu_ps(b, _mm256_permutevar8x32_ps(u.b0, dup_lo));
  _mm256_storeu_ps(b + 8, _mm256_permutevar8x32_ps(u.b0, dup_hi));
}

inline void decode_q6k_avx2(const uint8_t* blk, int8_t* q, float* a, float* b) {
  KUnp u;
  unpack_q6k(blk, u);
  store_minus(u, q, 32);
  scale16(reinterpret_cast<const int8_t*>(blk + 192), f16(blk + 208), a);
  std::memset(b, 0, 16 * sizeof(float));
}
#define LBQ_GGML_DEC(portable, avx2) avx2
#else
#define LBQ_GGML_DEC(portable, avx2) portable
#endif

template <int T>
struct Traits;
template <>
struct Traits<Q4_1> {
  static constexpr int QK = 32, SIZE = 20;
  static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<false, true>(p, q, a, b); }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<false, true, true>(p, q, a, b); }
};
template <>
struct Traits<Q5_0> {
  static constexpr int QK = 32, SIZE = 22;
  static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, false>(p, q, a, b); }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, false, true>(p, q, a, b); }
};
template <>
struct Traits<Q5_1> {
  static constexpr int QK = 32, SIZE = 24;
  static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, true>(p, q, a, b); }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode32<true, true, true>(p, q, a, b); }
};
template <>
struct Traits<Q2_K> {
  static constexpr int QK = 256, SIZE = 84;
  static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) {
    LBQ_GGML_DEC(decode_q2k, decode_q2k_avx2)(p, q, a, b);
  }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q2k(p, q, a, b); }
};
template <>
struct Traits<Q3_K> {
  static constexpr int QK = 256, SIZE = 110;
  static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) {
    LBQ_GGML_DEC(decode_q3k, decode_q3k_avx2)(p, q, a, b);
  }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q3k(p, q, a, b); }
};
template <>
struct Traits<Q4_K> {
  static constexpr int QK = 256, SIZE = 144;
  static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) {
    LBQ_GGML_DEC(decode_q45k<false>, decode_q45k_avx2<false>)(p, q, a, b);
  }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q45k<false>(p, q, a, b); }
};
template <>
struct Traits<Q5_K> {
  static constexpr int QK = 256, SIZE = 176;
  static constexpr bool MIN = true;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) {
    LBQ_GGML_DEC(decode_q45k<true>, decode_q45k_avx2<true>)(p, q, a, b);
  }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q45k<true>(p, q, a, b); }
};
template <>
struct Traits<Q6_K> {
  static constexpr int QK = 256, SIZE = 210;
  static constexpr bool MIN = false;
  static void decode(const uint8_t* p, int8_t* q, float* a, float* b) {
    LBQ_GGML_DEC(decode_q6k, decode_q6k_avx2)(p, q, a, b);
  }
  static void portable(const uint8_t* p, int8_t* q, float* a, float* b) { decode_q6k(p, q, a, b); }
};

// Decode one block of a type id with the compiled decoder (portable = false) or the plain C++
// one; false for an unknown id.  Used by selftest.cpp to check the SIMD decoders.
inline bool decode_block(int type, bool portable, const uint8_t* p, int8_t* q, float* a, float* b) {
  // clang-format off: one case per type (the formatter runs macro-made cases together)
  switch (type) {
#define LBQ_GGML_CASE(T)                                                        \
  case T:                                                                       \
    portable ? Traits<T>::portable(p, q, a, b) : Traits<T>::decode(p, q, a, b); \
    return true;
    LBQ_GGML_TYPES(LBQ_GGML_CASE)
#undef LBQ_GGML_CASE
    default:
      return false;
  }
  // clang-format on
}

// Block size and bytes per block of a type id, or false for an unknown id.
inline bool block_shape(int type, int* qk, int* size) {
  // clang-format off: one case per type (the formatter runs macro-made cases together)
  switch (type) {
#define LBQ_GGML_CASE(T)     \
  case T:                    \
    *qk = Traits<T>::QK;     \
    *size = Traits<T>::SIZE; \
    return true;
    LBQ_GGML_TYPES(LBQ_GGML_CASE)
#undef LBQ_GGML_CASE
    default:
      return false;
  }
  // clang-format on
}

// ---- integer dot of one decoded block with MR quantized activation rows -------------------
// acc[j] += sum_s a_s * dx_j[s/2] * dot(q[16s:16s+16], xq_j[16s:16s+16]), s = 0..QK/16-1.
#if defined(LBQ_AVX2)
using Acc = __m256;
inline Acc acc_zero() {
  return _mm256_setzero_ps();
}
inline float acc_sum(Acc v) {
  return hsum_ps(v);
}

template <int QK, int MR>
inline void block_dot(const int8_t* q, const float* a, const int8_t* const* xq, const float* const* dx, Acc* acc) {
  for (int c = 0; c < QK / 32; ++c) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    const __m256i aq = _mm256_sign_epi8(qv, qv);  // |q| <= 32: maddubs pairs cannot saturate
    const __m256 av = _mm256_set_m128(_mm_set1_ps(a[2 * c + 1]), _mm_set1_ps(a[2 * c]));
    for (int j = 0; j < MR; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + 32 * c));
      // int32 lanes 0-3: values 0-15 of the chunk (sub-block 2c), lanes 4-7: sub-block 2c+1
      const __m256i d = dot_u8s8(_mm256_setzero_si256(), aq, _mm256_sign_epi8(xv, qv));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(av, _mm256_set1_ps(dx[j][c])), acc[j]);
    }
  }
}
#elif defined(LBQ_NEON)
using Acc = float32x4_t;
inline Acc acc_zero() {
  return vdupq_n_f32(0.f);
}
inline float acc_sum(Acc v) {
  return vaddvq_f32(v);
}

inline int32x4_t dot16(int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdupq_n_s32(0), w, x);
#else
  int16x8_t p = vmull_s8(vget_low_s8(w), vget_low_s8(x));
  p = vmlal_s8(p, vget_high_s8(w), vget_high_s8(x));  // |w| <= 32: 2*32*127 fits int16
  return vpaddlq_s16(p);
#endif
}

template <int QK, int MR>
inline void block_dot(const int8_t* q, const float* a, const int8_t* const* xq, const float* const* dx, Acc* acc) {
  for (int s = 0; s < QK / 16; ++s) {
    const int8x16_t qv = vld1q_s8(q + 16 * s);
    for (int j = 0; j < MR; ++j) {
      const int32x4_t d = dot16(qv, vld1q_s8(xq[j] + 16 * s));
      acc[j] = vfmaq_n_f32(acc[j], vcvtq_f32_s32(d), a[s] * dx[j][s / 2]);
    }
  }
}
#else
using Acc = float;
inline Acc acc_zero() {
  return 0.f;
}
inline float acc_sum(Acc v) {
  return v;
}

template <int QK, int MR>
inline void block_dot(const int8_t* q, const float* a, const int8_t* const* xq, const float* const* dx, Acc* acc) {
  for (int s = 0; s < QK / 16; ++s)
    for (int j = 0; j < MR; ++j) {
      int32_t d = 0;
      for (int i = 0; i < 16; ++i) d += static_cast<int32_t>(q[16 * s + i]) * xq[j][16 * s + i];
      acc[j] += static_cast<float>(d) * (a[s] * dx[j][s / 2]);
    }
}
#endif

// Quantized activations for the ggml kernels: M rows of K int8 with one scale per 32 values
// (quantize_act_row at G = 32), the per-16 and per-32 sums of the fp32 activations, and the
// per-16 sums of the int8 values (in "fold order", see fused kernels below).
struct GAct {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32]
  const float* s16;    // [M, K/16]
  const float* s32;    // [M, K/32]
  const int32_t* i16;  // [M, K/16]
  int64_t M, K;
};

// Order of the 8 per-16 sums of 128 values after the fused kernels' hadd fold:
// sub-blocks [0 2 4 6 1 3 5 7] (chunk c of 32 values holds sub-blocks 2c and 2c+1).
constexpr int kFold[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// The sums of one activation row (x fp32, q its int8 quantization, K values): s16, s32 and
// i16 (per-16 integer sums, each full group of 8 in kFold order, a tail in natural order).
inline void act_sums(const float* x, const int8_t* q, int64_t K, float* s16, float* s32, int32_t* i16) {
  const int64_t n16 = K / 16;
  for (int64_t s = 0; s < n16; ++s) {
    float t = 0.f;
    for (int i = 0; i < 16; ++i) t += x[16 * s + i];
    s16[s] = t;
  }
  for (int64_t c = 0; c < K / 32; ++c) s32[c] = s16[2 * c] + s16[2 * c + 1];
  for (int64_t s = 0; s < n16; ++s) {
    const int64_t g = s / 8, src = (g + 1) * 8 <= n16 ? 8 * g + kFold[s % 8] : s;
    int32_t t = 0;
    for (int i = 0; i < 16; ++i) t += q[16 * src + i];
    i16[s] = t;
  }
}

// Owner of the activation arrays of M rows (x: M rows ldx apart, K values each).
struct GActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, s16, s32;
  std::vector<int32_t> i16, isum;
  void resize(int64_t M, int64_t K) {
    q.resize(static_cast<size_t>(M * K));
    d.resize(static_cast<size_t>(M * (K / 32)));
    isum.resize(static_cast<size_t>(M * (K / 32)));
    s16.resize(static_cast<size_t>(M * (K / 16)));
    s32.resize(static_cast<size_t>(M * (K / 32)));
    i16.resize(static_cast<size_t>(M * (K / 16)));
  }
  // Row m (after resize): quantize and sum.
  void row(const float* x, int64_t m, int64_t K) {
    quantize_act_row(x, K, 32, q.data() + m * K, d.data() + m * (K / 32), isum.data() + m * (K / 32));
    act_sums(x, q.data() + m * K, K, s16.data() + m * (K / 16), s32.data() + m * (K / 32), i16.data() + m * (K / 16));
  }
  GAct view(int64_t M, int64_t K) const { return GAct{q.data(), d.data(), s16.data(), s32.data(), i16.data(), M, K}; }
};

// ---- fused AVX2 kernels for the K-quants ---------------------------------------------------
// A super-block (256 weights) of one weight row is unpacked in registers into 8 chunks of 32
// unsigned bytes (q + offset, so the u8 x s8 dot instructions apply directly) and float scale
// vectors; each activation row then costs 8 integer dots of 32 values, a hadd fold of the 8
// int32 lane vectors into the per-16 (or per-32) sums, and 1-2 FMAs.  No decoded block goes
// through memory, and one unpack serves every activation row of a tile (prefill).  The
// arithmetic is the decode + block_dot route's: exact int32 sub-block dots (the offset removed
// with the integer activation sums i16), times a_s * d_x in fp32, plus b_s times the fp32 sums;
// only the order of the fp32 additions differs.  Every activation row of every tile goes
// through the same kdot, so an output does not depend on how many rows share a call.
template <int T>
struct Fused {
  static constexpr bool ok = false;
};

#if defined(LBQ_AVX2)
// SUB32: per-32 scales; SHIFT: the values carry an offset 1 << SHIFT (-1: none); MIN: b terms.
template <>
struct Fused<Q4_K> {
  static constexpr bool ok = true, SUB32 = true, MIN = true;
  static constexpr int SHIFT = -1;
  static void unpack(const uint8_t* p, KUnp& u) { unpack_q45k<false>(p, u); }
};
template <>
struct Fused<Q5_K> {
  static constexpr bool ok = true, SUB32 = true, MIN = true;
  static constexpr int SHIFT = -1;
  static void unpack(const uint8_t* p, KUnp& u) { unpack_q45k<true>(p, u); }
};
template <>
struct Fused<Q6_K> {
  static constexpr bool ok = true, SUB32 = false, MIN = false;
  static constexpr int SHIFT = 5;
  static void unpack(const uint8_t* p, KUnp& u) { unpack_q6k(p, u); }
};
template <>
struct Fused<Q3_K> {
  static constexpr bool ok = true, SUB32 = false, MIN = false;
  static constexpr int SHIFT = 2;
  static void unpack(const uint8_t* p, KUnp& u) { unpack_q3k(p, u); }
};
template <>
struct Fused<Q2_K> {
  static constexpr bool ok = true, SUB32 = false, MIN = true;
  static constexpr int SHIFT = -1;
  static void unpack(const uint8_t* p, KUnp& u) { unpack_q2k(p, u); }
};

// One super-block of one activation row (xq: its 256 int8, dx: 8 scales, x32/x16: its fp32
// sums per 32 / 16, i16: its integer per-16 sums in kFold order) added to acc.
template <int T>
inline __m256 kdot(const KUnp& u, const int8_t* xq, const float* dx, const float* x32, const float* x16,
                   const int32_t* i16, __m256 acc) {
  using F = Fused<T>;
  __m256i v[8];
  for (int c = 0; c < 8; ++c)
    v[c] = dot_u8s8(_mm256_setzero_si256(), u.w[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * c)));
  // [s0 s2 s4 s6 | s1 s3 s5 s7]: the per-16 sums of chunks 0-3 (q0) and 4-7 (q1)
  __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  if constexpr (F::SUB32) {
    const __m256i t =
        _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(u.a0, _mm256_loadu_ps(dx)), acc);
    if constexpr (F::MIN) acc = _mm256_fmadd_ps(u.b0, _mm256_loadu_ps(x32), acc);
  } else {
    if constexpr (F::SHIFT >= 0) {
      q0 = _mm256_sub_epi32(q0, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(i16)), F::SHIFT));
      q1 = _mm256_sub_epi32(q1,
                            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(i16 + 8)), F::SHIFT));
    }
    const __m256 d0 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dx));
    const __m256 d1 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dx + 4));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_mul_ps(u.a0, d0), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_mul_ps(u.a1, d1), acc);
    if constexpr (F::MIN) {
      acc = _mm256_fmadd_ps(u.b0, _mm256_loadu_ps(x16), acc);
      acc = _mm256_fmadd_ps(u.b1, _mm256_loadu_ps(x16 + 8), acc);
    }
  }
  (void)x32;
  (void)x16;
  (void)i16;
  return acc;
}

// Y[m, n..n+NW-1] for NW weight rows (bytes wr, row_bytes apart) and the activation rows
// m0..m0+rows-1 (rows <= MAXR): each super-block is unpacked once for all the activation rows,
// and each activation chunk is read once for the NW weight rows.
template <int T, int MAXR, int NW>
inline void fused_rows(const uint8_t* wr, int64_t row_bytes, const GAct& x, int64_t n, int64_t m0, int64_t rows,
                       float* Y, int64_t ldy) {
  const int64_t R = MAXR == 1 ? 1 : rows, K = x.K;
  __m256 acc[NW][MAXR];
  for (int r = 0; r < NW; ++r)
    for (int64_t j = 0; j < R; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    KUnp u[NW];
    for (int r = 0; r < NW; ++r)
      for (int o = 0; o < Traits<T>::SIZE; o += 64) prefetch_ahead(wr + r * row_bytes + blk * Traits<T>::SIZE + o);
    for (int r = 0; r < NW; ++r) Fused<T>::unpack(wr + r * row_bytes + blk * Traits<T>::SIZE, u[r]);
    for (int64_t j = 0; j < R; ++j) {
      const int64_t m = m0 + j;
      const int8_t* xq = x.q + m * K + blk * 256;
      const float* dx = x.d + m * (K / 32) + blk * 8;
      const float* x32 = x.s32 + m * (K / 32) + blk * 8;
      const float* x16 = x.s16 + m * (K / 16) + blk * 16;
      const int32_t* i16 = x.i16 + m * (K / 16) + blk * 16;
      __m256 out[NW];  // no stores between the NW dots: the activation loads are shared
      for (int r = 0; r < NW; ++r) out[r] = kdot<T>(u[r], xq, dx, x32, x16, i16, acc[r][j]);
      for (int r = 0; r < NW; ++r) acc[r][j] = out[r];
    }
  }
  for (int r = 0; r < NW; ++r)
    for (int64_t j = 0; j < R; ++j) Y[(m0 + j) * ldy + n + r] = hsum_ps(acc[r][j]);
}
#endif

// One weight row n x MR activation rows m0..m0+MR-1.
template <int T, int MR>
inline void row_tile(const uint8_t* wr, const GAct& x, int64_t n, int64_t m0, float* Y, int64_t N) {
  using Tr = Traits<T>;
  constexpr int QK = Tr::QK, NS = QK / 16;
  alignas(32) int8_t q[QK];
  float a[NS], b[NS];
  const int8_t* xq[MR];
  const float* dx[MR];
  Acc acc[MR];
  float mins[MR];
  for (int j = 0; j < MR; ++j) acc[j] = acc_zero(), mins[j] = 0.f;
  for (int64_t blk = 0; blk < x.K / QK; ++blk) {
    Tr::decode(wr + blk * Tr::SIZE, q, a, b);
    for (int j = 0; j < MR; ++j) {
      xq[j] = x.q + (m0 + j) * x.K + blk * QK;
      dx[j] = x.d + (m0 + j) * (x.K / 32) + blk * (QK / 32);
    }
    block_dot<QK, MR>(q, a, xq, dx, acc);
    if (Tr::MIN)
      for (int j = 0; j < MR; ++j) {
        const float* xs = x.s16 + (m0 + j) * (x.K / 16) + blk * NS;
#if defined(LBQ_AVX2)
        if constexpr (NS % 8 == 0) {
          for (int s = 0; s < NS; s += 8)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(b + s), _mm256_loadu_ps(xs + s), acc[j]);
          continue;
        }
#elif defined(LBQ_NEON)
        if constexpr (NS % 4 == 0) {
          for (int s = 0; s < NS; s += 4) acc[j] = vfmaq_f32(acc[j], vld1q_f32(b + s), vld1q_f32(xs + s));
          continue;
        }
#endif
        for (int s = 0; s < NS; ++s) mins[j] += b[s] * xs[s];
      }
  }
  for (int j = 0; j < MR; ++j) Y[(m0 + j) * N + n] = acc_sum(acc[j]) + mins[j];
}

#if defined(LBQ_AVX2)
// Y[m0:m1, n0:n1] (n1 - n0 <= NB, m1 - m0 <= MB) for many activation rows (prefill): the loop
// over super-blocks is outermost, so one super-block column of the MB activation rows (MB x 256
// bytes) stays in L1 while the NB weight rows are unpacked and applied to it, and the NB x MB
// accumulators live in L1 too.  Each output goes through the same kdot sequence as fused_rows.
template <int T, int NB, int MB>
inline void fused_block(const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t n0, int64_t n1, int64_t m0,
                        int64_t m1, float* Y, int64_t ldy) {
  const int64_t K = x.K, nn = n1 - n0, mm = m1 - m0;
  __m256 acc[NB][MB];
  for (int64_t i = 0; i < nn; ++i)
    for (int64_t j = 0; j < mm; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    for (int64_t i = 0; i < nn; ++i) {
      KUnp u;
      Fused<T>::unpack(w + (n0 + i) * row_bytes + blk * Traits<T>::SIZE, u);
      for (int64_t j = 0; j < mm; ++j) {
        const int64_t m = m0 + j;
        acc[i][j] = kdot<T>(u, x.q + m * K + blk * 256, x.d + m * (K / 32) + blk * 8, x.s32 + m * (K / 32) + blk * 8,
                            x.s16 + m * (K / 16) + blk * 16, x.i16 + m * (K / 16) + blk * 16, acc[i][j]);
      }
    }
  }
  for (int64_t i = 0; i < nn; ++i)
    for (int64_t j = 0; j < mm; ++j) Y[(m0 + j) * ldy + n0 + i] = hsum_ps(acc[i][j]);
}
#endif

#if defined(LBQ_GEMM512)
// ---- many-row GEMM for the K-quants (AVX-512 VNNI) ------------------------------------------
// kdot spends most of its instructions folding each activation row's 8 lane vectors into
// sub-block sums (hadd, permutes) before 1-2 FMAs.  Here the zmm lanes are 16 weight rows
// instead: a group of 16 rows is unpacked once into a scratch where each dword holds 4
// consecutive values of one row (16 rows side by side), so a vpdpbusd of that zmm with 4
// activation bytes broadcast adds 4 products to each row's own sum, and a sub-block's sum for
// 16 rows is 4 or 8 vpdpbusd with no horizontal step.  The float side keeps kdot's
// arithmetic exactly: one accumulator per kdot lane (8 per output, a zmm each for the 16
// rows), the same FMAs with the same operands in the same order per lane, and at the end
// hsum_ps's addition tree across the 8 accumulators.  So an output has the same bits on every
// route (decode, decode batch, prefill), which the batched == single-step identity needs.
constexpr int kGemmRows = 16;        // weight rows per group (one zmm lane each)
constexpr int64_t kGemmTileBlk = 4;  // super-blocks per K tile: 16 KB of unpacked weights (L1)
// kdot's lane for sub-block s % 8 of a half super-block (the inverse of kFold).
constexpr int kUnfold[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// Scratch of one thread: the unpacked, row-interleaved weights of a group of 16 rows (K bytes
// per row), their scales per scale unit (per 32 values for SUB32 types, else per 16) and min
// terms, and the accumulators of every activation row between K tiles.
struct GemmScratch {
  std::vector<int32_t> w;   // [K/4][16]: dword of values 4i..4i+3 of each row
  std::vector<float> a, b;  // [units][16]
  std::vector<float> acc;   // [M][8][16]: kdot's 8 lanes for the 16 rows, per activation row
  std::vector<KUnp> unp;    // [8][K/256]: 8 rows unpacked, before the transpose
};

inline GemmScratch& gemm_scratch() {
  static thread_local GemmScratch s;
  return s;
}

// One group of 16 rows in the interleaved layout, wherever it lives (the scratch, or a weight
// repacked at load).
struct GemmGroup {
  const int32_t* w;
  const float *a, *b;
};

// Scale units per super-block: per 32 values for SUB32 types, else per 16.
template <int T>
constexpr int64_t gemm_units() {
  return Fused<T>::SUB32 ? 8 : 16;
}

// Repacked weights: a weight may be laid out once, at load, as gemm_unpack leaves a group of
// 16 rows (the last group zero-padded), group after group: [K/4][16] int32 values, then
// [units][16] scales, then (types with mins) [units][16] min terms.  Batches then skip the
// unpack, which at 16 rows costs a third of the GEMM's time; the price is memory: 1.125 (Q4_K)
// to 1.5 (Q2_K) bytes per weight beside the file's blocks, which single rows keep reading.
template <int T>
constexpr int64_t packed_group_bytes(int64_t K) {
  return K * kGemmRows + (Fused<T>::MIN ? 2 : 1) * (K / 256) * gemm_units<T>() * kGemmRows * 4;
}

template <int T>
inline GemmGroup packed_group(const uint8_t* packed, int64_t K, int64_t g) {
  const uint8_t* base = packed + g * packed_group_bytes<T>(K);
  const float* a = reinterpret_cast<const float*>(base + K * kGemmRows);
  return {reinterpret_cast<const int32_t*>(base), a, a + (K / 256) * gemm_units<T>() * kGemmRows};
}

// out[g] = lane g of r[0..7] (an 8 x 8 transpose of 32-bit lanes).
inline void transpose8(const __m256i* r, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7
    const __m256i* q = t + 4 * h;
    u[4 * h] = _mm256_unpacklo_epi64(q[0], q[2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(q[0], q[2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(q[1], q[3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(q[1], q[3]);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    out[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}
inline void transpose8(const __m256* r, __m256* out) {
  __m256i ri[8], oi[8];
  for (int i = 0; i < 8; ++i) ri[i] = _mm256_castps_si256(r[i]);
  transpose8(ri, oi);
  for (int i = 0; i < 8; ++i) out[i] = _mm256_castsi256_ps(oi[i]);
}

// Unpack weight rows n0..n0+rows-1 (rows <= 16; the others zero) into s, 8 rows at a time:
// each row is unpacked front to back (Fused<T>::unpack, one read stream: interleaving the 8
// rows' reads starves the prefetcher on weights that come from memory), then each super-block
// of the 8 rows is transposed into the interleaved layout.
template <int T>
inline void gemm_unpack(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows, GemmScratch& s) {
  using F = Fused<T>;
  constexpr int NS = static_cast<int>(gemm_units<T>());
  const int64_t nblk = K / 256;
  s.w.resize(static_cast<size_t>(K / 4 * kGemmRows));
  s.a.resize(static_cast<size_t>(nblk * NS * kGemmRows));
  s.b.resize(static_cast<size_t>(nblk * NS * kGemmRows));
  s.unp.resize(static_cast<size_t>(8 * nblk));
  for (int64_t r0 = 0; r0 < kGemmRows; r0 += 8) {
    for (int64_t r = 0; r < 8; ++r) {
      KUnp* ur = s.unp.data() + r * nblk;
      if (r0 + r < rows) {
        const uint8_t* wr = w + (n0 + r0 + r) * row_bytes;
        for (int64_t blk = 0; blk < nblk; ++blk) F::unpack(wr + blk * Traits<T>::SIZE, ur[blk]);
      } else {
        for (int64_t blk = 0; blk < nblk; ++blk) {
          for (int c = 0; c < 8; ++c) ur[blk].w[c] = _mm256_setzero_si256();
          ur[blk].a0 = ur[blk].a1 = ur[blk].b0 = ur[blk].b1 = _mm256_setzero_ps();
        }
      }
    }
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const KUnp* u[8];
      for (int r = 0; r < 8; ++r) u[r] = s.unp.data() + r * nblk + blk;
      int32_t* wd = s.w.data() + blk * 64 * kGemmRows + r0;
      for (int c = 0; c < 8; ++c) {
        __m256i in[8], out[8];
        for (int r = 0; r < 8; ++r) in[r] = u[r]->w[c];
        transpose8(in, out);
        for (int g = 0; g < 8; ++g)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wd + (c * 8 + g) * kGemmRows), out[g]);
      }
      float* ad = s.a.data() + blk * NS * kGemmRows + r0;
      float* bd = s.b.data() + blk * NS * kGemmRows + r0;
      __m256 in[8], out[8];
      for (int r = 0; r < 8; ++r) in[r] = u[r]->a0;
      transpose8(in, out);
      if constexpr (F::SUB32) {  // lane c: chunk c
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(ad + c * kGemmRows, out[c]);
        if constexpr (F::MIN) {
          for (int r = 0; r < 8; ++r) in[r] = u[r]->b0;
          transpose8(in, out);
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(bd + c * kGemmRows, out[c]);
        }
      } else {  // a0 lane l: sub-block kFold[l]; a1: 8 + kFold[l]
        for (int l = 0; l < 8; ++l) _mm256_storeu_ps(ad + kFold[l] * kGemmRows, out[l]);
        for (int r = 0; r < 8; ++r) in[r] = u[r]->a1;
        transpose8(in, out);
        for (int l = 0; l < 8; ++l) _mm256_storeu_ps(ad + (8 + kFold[l]) * kGemmRows, out[l]);
        if constexpr (F::MIN) {  // natural order (kdot adds b0 * x16[0:8], b1 * x16[8:16])
          for (int r = 0; r < 8; ++r) in[r] = u[r]->b0;
          transpose8(in, out);
          for (int l = 0; l < 8; ++l) _mm256_storeu_ps(bd + l * kGemmRows, out[l]);
          for (int r = 0; r < 8; ++r) in[r] = u[r]->b1;
          transpose8(in, out);
          for (int l = 0; l < 8; ++l) _mm256_storeu_ps(bd + (8 + l) * kGemmRows, out[l]);
        }
      }
    }
  }
}

// acc[j][0..7] (kdot's 8 lanes for 16 weight rows) += super-blocks blk0..blk1-1 of activation
// rows m..m+R-1.
template <int T, int R>
inline void gemm_tile(const GemmGroup& s, const GAct& x, int64_t m, int64_t blk0, int64_t blk1, float* acc) {
  using F = Fused<T>;
  constexpr int NS = static_cast<int>(gemm_units<T>());
  const int64_t K = x.K;
  __m512 A[R][8];
  for (int j = 0; j < R; ++j)
    for (int l = 0; l < 8; ++l) A[j][l] = _mm512_loadu_ps(acc + (j * 8 + l) * kGemmRows);
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int32_t* wb = s.w + blk * 64 * kGemmRows;
    const float* ab = s.a + blk * NS * kGemmRows;
    const float* bb = s.b + blk * NS * kGemmRows;
    const int8_t* xq[R];
    const float* dx[R];
    for (int j = 0; j < R; ++j) {
      xq[j] = x.q + (m + j) * K + blk * 256;
      dx[j] = x.d + (m + j) * (K / 32) + blk * 8;
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {  // unrolled: A[j][lane] stays in registers
      __m512i i0[R], i1[R];
      for (int j = 0; j < R; ++j) i0[j] = i1[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m512i w0 = _mm512_loadu_si512(wb + (c * 8 + g) * kGemmRows);
        const __m512i w1 = _mm512_loadu_si512(wb + (c * 8 + g + 4) * kGemmRows);
        for (int j = 0; j < R; ++j) {
          i0[j] = dpbusd_bcast(i0[j], w0, xq[j] + 32 * c + 4 * g);
          i1[j] = dpbusd_bcast(i1[j], w1, xq[j] + 32 * c + 16 + 4 * g);
        }
      }
      if constexpr (F::SUB32) {
        const __m512 a = _mm512_loadu_ps(ab + c * kGemmRows);
        for (int j = 0; j < R; ++j) {
          const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(i0[j], i1[j]));
          A[j][c] = _mm512_fmadd_ps(t, _mm512_mul_ps(a, _mm512_set1_ps(dx[j][c])), A[j][c]);
          if constexpr (F::MIN) {
            const float* x32 = x.s32 + (m + j) * (K / 32) + blk * 8;
            A[j][c] = _mm512_fmadd_ps(_mm512_loadu_ps(bb + c * kGemmRows), _mm512_set1_ps(x32[c]), A[j][c]);
          }
        }
      } else {
        // sub-blocks 2c and 2c + 1 (same half: c < 4 in half 0): kdot lanes kUnfold[s % 8]
        const int s0 = 2 * c, s1 = 2 * c + 1, h = c / 4, l0 = kUnfold[s0 % 8], l1 = kUnfold[s1 % 8];
        const __m512 a0 = _mm512_loadu_ps(ab + s0 * kGemmRows), a1 = _mm512_loadu_ps(ab + s1 * kGemmRows);
        for (int j = 0; j < R; ++j) {
          if constexpr (F::SHIFT >= 0) {
            const int32_t* i16 = x.i16 + (m + j) * (K / 16) + blk * 16 + 8 * h;  // kFold order
            i0[j] = _mm512_sub_epi32(i0[j], _mm512_set1_epi32(i16[l0] << F::SHIFT));
            i1[j] = _mm512_sub_epi32(i1[j], _mm512_set1_epi32(i16[l1] << F::SHIFT));
          }
          const __m512 d = _mm512_set1_ps(dx[j][c]);
          A[j][l0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[j]), _mm512_mul_ps(a0, d), A[j][l0]);
          A[j][l1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[j]), _mm512_mul_ps(a1, d), A[j][l1]);
        }
      }
    }
    if constexpr (!F::SUB32 && F::MIN) {
      for (int j = 0; j < R; ++j) {
        const float* x16 = x.s16 + (m + j) * (K / 16) + blk * 16;
        for (int l = 0; l < 8; ++l)
          A[j][l] = _mm512_fmadd_ps(_mm512_loadu_ps(bb + l * kGemmRows), _mm512_set1_ps(x16[l]), A[j][l]);
        for (int l = 0; l < 8; ++l)
          A[j][l] = _mm512_fmadd_ps(_mm512_loadu_ps(bb + (8 + l) * kGemmRows), _mm512_set1_ps(x16[8 + l]), A[j][l]);
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int l = 0; l < 8; ++l) _mm512_storeu_ps(acc + (j * 8 + l) * kGemmRows, A[j][l]);
}

inline void gemm_prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Y[:, n0:n1] for all M activation rows, groups of 16 weight rows, K tiles of kGemmTileBlk
// super-blocks (the tile's unpacked weights stay in L1 while every activation row passes).
template <int T>
inline void gemm_rows(const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t n0, int64_t n1, float* Y, int64_t ldy,
                      const uint8_t* packed = nullptr) {
  GemmScratch& s = gemm_scratch();
  const int64_t M = x.M, nblk = x.K / 256;
  s.acc.resize(static_cast<size_t>(M * 8 * kGemmRows));
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const int64_t rows = std::min<int64_t>(kGemmRows, n1 - n);
    GemmGroup grp, next{nullptr, nullptr, nullptr};
    if (packed != nullptr && n % kGemmRows == 0) {  // (a range split off group bounds unpacks)
      grp = packed_group<T>(packed, x.K, n / kGemmRows);
      if (n + kGemmRows < n1) next = packed_group<T>(packed, x.K, n / kGemmRows + 1);
    } else {
      gemm_unpack<T>(w, row_bytes, x.K, n, rows, s);
      grp = {s.w.data(), s.a.data(), s.b.data()};
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.f);
    for (int64_t b0 = 0; b0 < nblk; b0 += kGemmTileBlk) {
      const int64_t b1 = std::min(nblk, b0 + kGemmTileBlk);
      if (next.w != nullptr) {  // the next group's tile comes from memory while this one computes
        gemm_prefetch(next.w + b0 * 64 * kGemmRows, (b1 - b0) * 64 * kGemmRows * 4);
        constexpr int64_t NS = gemm_units<T>();
        gemm_prefetch(next.a + b0 * NS * kGemmRows, (b1 - b0) * NS * kGemmRows * 4);
        if constexpr (Fused<T>::MIN) gemm_prefetch(next.b + b0 * NS * kGemmRows, (b1 - b0) * NS * kGemmRows * 4);
      }
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) gemm_tile<T, 2>(grp, x, m, b0, b1, s.acc.data() + m * 8 * kGemmRows);
      if (m < M) gemm_tile<T, 1>(grp, x, m, b0, b1, s.acc.data() + m * 8 * kGemmRows);
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
    for (int64_t m = 0; m < M; ++m) {
      __m512 a[8];  // hsum_ps's tree: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
      for (int l = 0; l < 8; ++l) a[l] = _mm512_loadu_ps(s.acc.data() + (m * 8 + l) * kGemmRows);
      const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                     _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
      _mm512_mask_storeu_ps(Y + m * ldy + n, mask, y);
    }
  }
}

// Repack weight rows [N, row_bytes] into out (N / 16 rounded up groups of packed_group_bytes).
template <int T>
inline void gemm_pack(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out) {
  GemmScratch s;
  const int64_t units = (K / 256) * gemm_units<T>() * kGemmRows;
  for (int64_t n = 0; n < N; n += kGemmRows) {
    gemm_unpack<T>(w, row_bytes, K, n, std::min<int64_t>(kGemmRows, N - n), s);
    uint8_t* dst = out + (n / kGemmRows) * packed_group_bytes<T>(K);
    std::memcpy(dst, s.w.data(), static_cast<size_t>(K * kGemmRows));
    std::memcpy(dst + K * kGemmRows, s.a.data(), static_cast<size_t>(units * 4));
    if constexpr (Fused<T>::MIN)
      std::memcpy(dst + K * kGemmRows + units * 4, s.b.data(), static_cast<size_t>(units * 4));
  }
}
#endif

#if defined(__AVX512F__)
#define LBQ_TILE8 true
#else
#define LBQ_TILE8 false
#endif
// Tiles of the many-row (prefill) path: weight rows x activation rows per fused_block.
constexpr int64_t kBlockN = 32, kBlockM = 8;
// Up to this many activation rows (a decode batch, a short prefill chunk) go weight row by weight
// row (fused_rows): measured level with or better than fused_block up to 128 rows, below at 264.
constexpr int64_t kSmallM = 128;
#if defined(LBQ_GEMM512)
// From this many activation rows the AVX-512 build takes gemm_rows.  Chosen on the whole
// model, not on single matrices: 16 clients of benchmarks.edge_serving's workload served
// in-process at Llama-3.2-1B Q4_K_M on one core took 52-56 s from 10 rows (Q4_K, Q5_K) and 4
// (Q6_K..Q2_K), 61-66 s from 12 and 8 (alternating runs); single matrices streamed from
// memory put the crossovers at 12 and 5-8, which the decode batches of the real model do not.
// Q6_K..Q2_K start at 5, not 4: a 4-row decode step of that model (context 128, one core) took
// 121-123 ms with them on the fused rows against 140-147 ms on gemm_rows (its Q6_K head, 128256
// rows, reads the blocks once either way, and the unpack is not paid back at 4 rows).
template <int T>
constexpr int64_t gemm_min_m() {
  return Fused<T>::SUB32 ? 10 : 5;
}
// With the weight repacked (no unpack to pay for) the GEMM takes every batch from this many rows.
constexpr int64_t kPackedMinM = 5;
// Q5_0 takes q50_gemm from this many rows: one core, 2048 x 640, level with row_tile at 6-8
// rows, 1.2x faster at 12, 2x at 512.
constexpr int64_t kQ50GemmM = 8;
#endif

// Y[m0:m1, n] for weight row n (bytes wr) on the decode + block_dot route: row tiles of <= 4
// activation rows per decoded block.
template <int T>
inline void tile_rows(const uint8_t* wr, const GAct& x, int64_t n, int64_t m0, int64_t m1, float* Y, int64_t ldy) {
  int64_t m = m0;
  // 8-row tiles where the registers allow (AVX-512's 32): each block is decoded once per tile
  for (; LBQ_TILE8 && m + 8 <= m1; m += 8) row_tile<T, 8>(wr, x, n, m, Y, ldy);
  for (; m + 4 <= m1; m += 4) row_tile<T, 4>(wr, x, n, m, Y, ldy);
  switch (m1 - m) {
    case 3:
      row_tile<T, 3>(wr, x, n, m, Y, ldy);
      break;
    case 2:
      row_tile<T, 2>(wr, x, n, m, Y, ldy);
      break;
    case 1:
      row_tile<T, 1>(wr, x, n, m, Y, ldy);
      break;
    default:
      break;
  }
}

#if defined(LBQ_GEMM512)
// ---- Q5_0 prefill (the 32-value blocks llama.cpp falls back to where K is not a multiple of
// 256: Gemma 3 270M's q/k/v/gate/up) -----------------------------------------------------------
// q50_gemm computes exactly what row_tile<Q5_0> (decode + block_dot) computes, 16 weight rows in
// the lanes of a zmm and no horizontal sums: block_dot's int32 lane k of a block is the exact
// dot of values 4k..4k+3, here vpdpbusd of q + 16 (0..31, unsigned) with the int8 activations
// started from -16 times their sum; then block_dot's fma of that lane into its accumulator k
// with d_w * d_x, and at the end hsum_ps's tree over the 8 accumulators.  So an output has the
// same bits on both routes and does not depend on how many rows share a call.

// The 32 values q + 16 of a Q5_0 block as unsigned bytes (value j in byte j).
inline __m256i unpack_q50(const uint8_t* blk) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), m4), _mm_and_si128(t, m4));
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  bits = _mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  bits = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
  return _mm256_or_si256(v, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
}

struct Q50Scratch {
  std::vector<int32_t> w;    // [K/4][16]: dword of values 4i..4i+3 (q + 16) of each row
  std::vector<float> d;      // [K/32][16]
  std::vector<int32_t> off;  // [M][K/4]: -16 times the sum of activation values 4i..4i+3
};

// acc = Y[m..m+R-1, 16 rows] in block_dot's lanes, over every block.
template <int R>
inline void q50_tile(const Q50Scratch& s, const GAct& x, int64_t m, int64_t ldy, float* Y, __mmask16 mask) {
  const int64_t K = x.K, nb = K / 32;
  __m512 A[R][8];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < 8; ++k) A[j][k] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* wb = s.w.data() + b * 8 * 16;
    const __m512 dw = _mm512_loadu_ps(s.d.data() + b * 16);
    __m512 sc[R];
    for (int j = 0; j < R; ++j) sc[j] = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(m + j) * nb + b]));
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i wk = _mm512_loadu_si512(wb + k * 16);
      for (int j = 0; j < R; ++j) {
        const __m512i o = _mm512_set1_epi32(s.off[static_cast<size_t>((m + j) * (K / 4) + b * 8 + k)]);
        const __m512i i = dpbusd_bcast(o, wk, x.q + (m + j) * K + b * 32 + 4 * k);
        A[j][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc[j], A[j][k]);
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(A[j][0], A[j][4]), _mm512_add_ps(A[j][2], A[j][6])),
                                   _mm512_add_ps(_mm512_add_ps(A[j][1], A[j][5]), _mm512_add_ps(A[j][3], A[j][7])));
    // + 0.f: row_tile's acc_sum(acc) + mins (0 for Q5_0)
    _mm512_mask_storeu_ps(Y + (m + j) * ldy, mask, _mm512_add_ps(y, _mm512_setzero_ps()));
  }
}

// -16 times the sums of activation values 4i..4i+3 of rows m0..m1-1, [m1 - m0][K/4].
inline void q50_offsets(const GAct& x, int64_t m0, int64_t m1, std::vector<int32_t>& off) {
  const int64_t K4 = x.K / 4;
  off.resize(static_cast<size_t>((m1 - m0) * K4));
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t i = 0; i < K4; ++i) {
      const int8_t* q = x.q + m * x.K + 4 * i;
      off[static_cast<size_t>((m - m0) * K4 + i)] = -16 * (q[0] + q[1] + q[2] + q[3]);
    }
}

// Y[m, n0:n1] for all M activation rows of Q5_0 weight rows w.
// (rows row_bytes apart: a split-K leaf's rows are the whole weight's)
inline void q50_gemm(const uint8_t* w, const GAct& x, int64_t n0, int64_t n1, float* Y, int64_t ldy,
                     int64_t row_bytes) {
  static thread_local Q50Scratch s;
  const int64_t K = x.K, nb = K / 32, M = x.M;
  s.w.resize(static_cast<size_t>(K / 4 * 16));
  s.d.resize(static_cast<size_t>(nb * 16));
  q50_offsets(x, 0, M, s.off);
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, n1 - n));
    std::fill(s.w.begin(), s.w.end(), 0);
    std::fill(s.d.begin(), s.d.end(), 0.f);
    for (int r = 0; r < rows; ++r) {
      const uint8_t* wr = w + (n + r) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        alignas(32) int32_t v[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(v), unpack_q50(wr + b * 22));
        for (int k = 0; k < 8; ++k) s.w[static_cast<size_t>((b * 8 + k) * 16 + r)] = v[k];
        s.d[static_cast<size_t>(b * 16 + r)] = f16(wr + b * 22);
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) q50_tile<3>(s, x, m, ldy, Y + n, mask);
    if (M - m == 2) q50_tile<2>(s, x, m, ldy, Y + n, mask);
    if (M - m == 1) q50_tile<1>(s, x, m, ldy, Y + n, mask);
  }
}

// The values q + 16 of Q5_0 blocks p and p + 22 (two consecutive blocks of a row) as unsigned
// bytes, value j of block i in byte 32i + j: the nibbles by a per-128-bit shift, the fifth bit
// by a masked add of 16 under qh.
inline __m512i unpack_q50_pair(const uint8_t* p) {
  const __m512i t = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 6)))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 28))), 1);
  const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);  // the high nibbles' 128 bits
  const __m512i v = _mm512_and_si512(_mm512_srlv_epi64(t, shift), _mm512_set1_epi8(0x0F));
  uint32_t h0, h1;
  std::memcpy(&h0, p + 2, 4);
  std::memcpy(&h1, p + 24, 4);
  const __mmask64 hm = _cvtu64_mask64(static_cast<uint64_t>(h0) | static_cast<uint64_t>(h1) << 32);
  return _mm512_mask_add_epi8(v, hm, v, _mm512_set1_epi8(0x10));
}

// Y[m..m+R-1, n0:n1] of Q5_0 weight rows for a few activation rows (decode, small batches): the
// int32 lanes and fmas of row_tile<Q5_0> (block_dot: lane k of a block is the exact dot of
// values 4k..4k+3, added with d_w * d_x into accumulator lane k, block after block), so the
// same bits; two blocks are unpacked per zmm (unpack_q50_pair) and dotted by one vpdpbusd
// started from -16 times the activations' per-4 sums (off, [R][K/4]).
template <int R>
inline void q50_rows(const uint8_t* w, const GAct& x, int64_t m, const int32_t* off, int64_t n0, int64_t n1, float* Y,
                     int64_t ldy, int64_t row_bytes) {
  const int64_t K = x.K, nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[R];
    for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const uint8_t* p = wr + b * 22;
      prefetch_ahead(p);  // 44 bytes a pass: every line of the row
      const __m512i u = unpack_q50_pair(p);
      const float d0 = f16(p), d1 = f16(p + 22);
      for (int j = 0; j < R; ++j) {
        const __m512i o = _mm512_loadu_si512(off + j * (K / 4) + b * 8);
        const __m512i i = _mm512_dpbusd_epi32(o, u, _mm512_loadu_si512(x.q + (m + j) * K + b * 32));
        const float* dx = x.d + (m + j) * nb + b;
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(i)), _mm256_set1_ps(d0 * dx[0]), acc[j]);
        acc[j] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(i, 1)), _mm256_set1_ps(d1 * dx[1]), acc[j]);
      }
    }
    if (b < nb) {  // an odd last block
      const uint8_t* p = wr + b * 22;
      const __m256i u = unpack_q50(p);
      const float d0 = f16(p);
      for (int j = 0; j < R; ++j) {
        const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(off + j * (K / 4) + b * 8));
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m + j) * K + b * 32));
        const __m256i i = _mm256_dpbusd_epi32(o, u, xv);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d0 * x.d[(m + j) * nb + b]), acc[j]);
      }
    }
    for (int j = 0; j < R; ++j) Y[(m + j) * ldy + n] = hsum_ps(acc[j]) + 0.f;  // row_tile: + mins (0)
  }
}

// Y[:, n0:n1] of Q5_0 weight rows for M < kQ50GemmM activation rows, up to 4 at a time.
inline void q50_small(const uint8_t* w, const GAct& x, int64_t n0, int64_t n1, float* Y, int64_t ldy,
                      int64_t row_bytes) {
  static thread_local std::vector<int32_t> off;
  q50_offsets(x, 0, x.M, off);
  const int64_t K4 = x.K / 4;
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) q50_rows<4>(w, x, m, off.data() + m * K4, n0, n1, Y, ldy, row_bytes);
  switch (x.M - m) {
    case 3:
      q50_rows<3>(w, x, m, off.data() + m * K4, n0, n1, Y, ldy, row_bytes);
      break;
    case 2:
      q50_rows<2>(w, x, m, off.data() + m * K4, n0, n1, Y, ldy, row_bytes);
      break;
    case 1:
      q50_rows<1>(w, x, m, off.data() + m * K4, n0, n1, Y, ldy, row_bytes);
      break;
    default:
      break;
  }
}
#endif

// Y[:, n0:n1] (Y is [M, ldy] fp32) for all M activation rows; w: weight rows of row_bytes.
// Fused types: one row at a time for M = 1; with AVX-512 VNNI gemm_rows from gemm_min_m<T>()
// rows; else a weight row at a time against tiles of kBlockM activation rows up to kSmallM
// rows, and kBlockN x kBlockM blocks (fused_block) beyond; all run kdot's float sequence per
// output, so a row's result does not depend on M.  Other types: weight
// rows in groups of ~32 KiB (L1) against 32 activation rows at a time, decoded per row tile.
template <int T>
inline void rows_range(const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t n0, int64_t n1, float* Y,
                       int64_t ldy, const uint8_t* packed = nullptr) {
#if defined(LBQ_AVX2)
#if defined(LBQ_GEMM512)
  if constexpr (T == Q5_0) {
    if (x.M >= kQ50GemmM)
      q50_gemm(w, x, n0, n1, Y, ldy, row_bytes);
    else
      q50_small(w, x, n0, n1, Y, ldy, row_bytes);
    return;
  }
#endif
  if constexpr (Fused<T>::ok) {
#if defined(LBQ_GEMM512)
    if (packed != nullptr && x.M >= kPackedMinM) {
      gemm_rows<T>(w, row_bytes, x, n0, n1, Y, ldy, packed);
      return;
    }
#endif
    if (x.M == 1) {
      for (int64_t n = n0; n < n1; ++n) fused_rows<T, 1, 1>(w + n * row_bytes, row_bytes, x, n, 0, 1, Y, ldy);
#if defined(LBQ_GEMM512)
    } else if (x.M >= gemm_min_m<T>()) {
      gemm_rows<T>(w, row_bytes, x, n0, n1, Y, ldy);
#endif
    } else if (x.M <= kSmallM) {
      // A decode batch: each weight row is read once, front to back (the prefetcher's one
      // stream; fused_block's 32 rows at a time read uncached weights at a tenth of the
      // bandwidth), and stays in L1 for the batch's tiles of kBlockM activation rows.
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < x.M; m += kBlockM)
          fused_rows<T, kBlockM, 1>(w + n * row_bytes, row_bytes, x, n, m, std::min(kBlockM, x.M - m), Y, ldy);
    } else {
      for (int64_t n = n0; n < n1; n += kBlockN)
        for (int64_t m = 0; m < x.M; m += kBlockM)
          fused_block<T, kBlockN, kBlockM>(w, row_bytes, x, n, std::min(n1, n + kBlockN), m, std::min(x.M, m + kBlockM),
                                           Y, ldy);
    }
    return;
  }
#endif
  constexpr int64_t kBlockBytes = int64_t{32} << 10, kRowGroup = 32;
  const int64_t nb = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row_bytes, 1));
  for (int64_t a = n0; a < n1; a += nb) {
    const int64_t b = std::min(n1, a + nb);
    for (int64_t m = 0; m < x.M; m += kRowGroup) {
      const int64_t me = std::min(x.M, m + kRowGroup);
      for (int64_t n = a; n < b; ++n) tile_rows<T>(w + n * row_bytes, x, n, m, me, Y, ldy);
    }
  }
}

// Rows n0..n1 of Y [M, N] (fp32); w: N rows of row_bytes.
template <int T>
inline void gemv_rows_t(const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t N, int64_t n0, int64_t n1, float* Y,
                        const uint8_t* packed) {
  rows_range<T>(w, row_bytes, x, n0, n1, Y, N, packed);
}

// Dispatch on the type id.  Returns false for an unknown type.
inline bool gemv_rows(int type, const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t N, int64_t n0, int64_t n1,
                      float* Y, const uint8_t* packed = nullptr) {
  // clang-format off: one case per type (the formatter runs macro-made cases together)
  switch (type) {
#define LBQ_GGML_CASE(T)                                   \
  case T:                                                  \
    gemv_rows_t<T>(w, row_bytes, x, N, n0, n1, Y, packed); \
    return true;
    LBQ_GGML_TYPES(LBQ_GGML_CASE)
#undef LBQ_GGML_CASE
    default:
      return false;
  }
  // clang-format on
}

#if defined(LBQ_GEMM512)
// f(std::integral_constant<int, T>{}) for the K-quant type id `type`; false for other types.
template <class F>
inline bool with_kquant(int type, F&& f) {
  switch (type) {
#define LBQ_KQUANT_CASE(T)               \
  case T:                                \
    f(std::integral_constant<int, T>{}); \
    return true;
    LBQ_KQUANT_CASE(Q2_K)
    LBQ_KQUANT_CASE(Q3_K)
    LBQ_KQUANT_CASE(Q4_K)
    LBQ_KQUANT_CASE(Q5_K)
    LBQ_KQUANT_CASE(Q6_K)
#undef LBQ_KQUANT_CASE
    default:
      return false;
  }
}
#endif

// Bytes of the repacked layout of an [N, K] weight of this type, or 0 where this build has no
// repacked path for it (not a K-quant, or no AVX-512 VNNI GEMM).
inline int64_t packed_bytes(int type, int64_t N, int64_t K) {
  int64_t bytes = 0;
#if defined(LBQ_GEMM512)
  if (K % 256 == 0)
    with_kquant(type,
                [&](auto t) { bytes = (N + kGemmRows - 1) / kGemmRows * packed_group_bytes<decltype(t)::value>(K); });
#else
  (void)type, (void)N, (void)K;
#endif
  return bytes;
}

// Fill out (packed_bytes(type, N, K) bytes) from the weight's blocks; false where not packable.
inline bool pack(int type, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out) {
  if (packed_bytes(type, N, K) == 0) return false;
#if defined(LBQ_GEMM512)
  return with_kquant(type, [&](auto t) { gemm_pack<decltype(t)::value>(w, row_bytes, N, K, out); });
#else
  (void)w, (void)row_bytes, (void)out;
  return false;
#endif
}

}  // namespace ggml
}  // namespace lbq
