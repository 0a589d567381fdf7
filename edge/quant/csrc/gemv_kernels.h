// Weight-only quantized GEMV kernels for CPU decode: y[M,N] = x[M,K] @ W^T, M small.
//
// Pure C++ (no torch headers) so the same code can be built by gemv.cpp into the torch
// extension and by a stand-alone harness (e.g. cross-compiled for aarch64).
//
// Weight layouts (see edge/quant/formats.py, which is the reference):
//   Q8: qweight int8  [N, K]      row-major; group g of row n is qweight[n, g*G:(g+1)*G]
//   Q4: qweight uint8 [N, K/2]    row-major; group g of row n is the G/2 bytes
//       qweight[n, g*G/2:(g+1)*G/2]; byte j of a group holds element j in its low nibble and
//       element j+G/2 in its high nibble (llama.cpp Q4_0 order for G=32); value = (q-8)*scale
//   scales: fp16 [N, K/G] (raw uint16 bits here), one per group.
//
// Every call first quantizes each activation row to int8 in blocks of G (Q8_0 semantics with
// an fp32 scale: d = max|x|/127, q = round-half-even(x * (1/d))), then per group computes the
// exact int32 dot product and accumulates  y += (d_w * d_x) * dot  in fp32.  All code paths
// (AVX2, NEON, scalar) compute the same int32 per-group dots; they differ only in the order of
// the fp32 additions.
//
// Paths: AVX2+FMA+F16C (x86, optional AVX-VNNI), NEON (aarch64; uses SDOT when the target has the
// dot-product extension), portable scalar (anything else, or LOWBAND_QUANT_SCALAR defined).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(LOWBAND_QUANT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LBQ_AVX2 1
#include <immintrin.h>
#if defined(__AVXVNNI__)
#define LBQ_VNNI 1
#define LBQ_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LBQ_VNNI 1
#define LBQ_DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LBQ_GEMM512 1  // ggml_kernels.h's many-row GEMM on zmm registers
#endif
#elif !defined(LOWBAND_QUANT_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#define LBQ_NEON 1
#include <arm_neon.h>
#endif

namespace lbq {

inline const char* isa_name() {
#if defined(LBQ_AVX2) && defined(LBQ_VNNI) && defined(LBQ_GEMM512)
  return "avx2+fma+avxvnni+avx512vnni";
#elif defined(LBQ_AVX2) && defined(LBQ_VNNI)
  return "avx2+fma+avxvnni";
#elif defined(LBQ_AVX2)
  return "avx2+fma";
#elif defined(LBQ_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return "neon+dotprod";
#elif defined(LBQ_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// IEEE half (raw bits) -> float.
inline float fp16_to_fp32(uint16_t h) {
#if defined(LBQ_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: mant * 2^-24
      const float f = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -f : f;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Quantized activations: M rows of K int8, per-row nb = K/G block scales and block sums.
struct Act {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, nb]
  const int32_t* s;  // [M, nb]  sum of the int8 values of each block (Q4 zero-point fix)
  int64_t M, K, nb;
};

// Packed weights.
struct Wt {
  const uint8_t* q;   // Q8: int8 [N, K] (as bytes); Q4: uint8 [N, K/2]
  const uint16_t* s;  // fp16 bits [N, nb]
  int64_t N, K, nb, row_bytes;
};

// ---------------------------------------------------------------------------------------
// Activation quantization (one row, block size G, G a multiple of 32).
// ---------------------------------------------------------------------------------------
inline void quantize_act_row_scalar(const float* x, int64_t K, int G, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = K / G;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * G;
    float amax = 0.f;
    for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float dd = amax / 127.f;
    const float id = dd != 0.f ? 1.f / dd : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < G; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      q[b * G + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = dd;
    s[b] = sum;
  }
}

#if defined(LBQ_AVX2)
inline float hsum_ps(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(r);
}

inline void quantize_act_row(const float* x, int64_t K, int G, int8_t* q, float* d, int32_t* s) {
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t nb = K / G;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * G;
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < G; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, _mm256_loadu_ps(xb + j)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.f;
    const __m256 vid = _mm256_set1_ps(dd != 0.f ? 1.f / dd : 0.f);
    __m256i vs = _mm256_setzero_si256();
    for (int j = 0; j < G; j += 32) {
      // cvtps_epi32 rounds to nearest-even (default MXCSR), like nearbyint in the scalar path.
      __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), vid));
      __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), vid));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 16), vid));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 24), vid));
      vs = _mm256_add_epi32(vs, _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
      i0 = _mm256_packs_epi32(i0, i1);
      i2 = _mm256_packs_epi32(i2, i3);
      i0 = _mm256_packs_epi16(i0, i2);
      i0 = _mm256_permutevar8x32_epi32(i0, perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * G + j), i0);
    }
    d[b] = dd;
    s[b] = hsum_epi32(vs);
  }
}

// Decode reads each weight row once, front to back, from memory. On the Zen 4 core these kernels
// were tuned on, the hardware prefetchers alone keep ~28 GB/s of one core's weight stream in
// flight; a software prefetch kPrefetchAhead bytes ahead of the loads ~40 GB/s (a 4864 x 896 Q8
// GEMV from memory, one core; 1 KiB ahead was slower than none, 8 and 16 KiB equal). A prefetch
// never faults (past the end of a weight too) and changes no arithmetic.
constexpr int64_t kPrefetchAhead = 8192;
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchAhead, _MM_HINT_T0);
}

// Sum of products of 32 u8 (<=127 for Q8 magnitudes, <=15 for Q4) by 32 s8, as 8 int32 partial
// sums added to acc.  maddubs cannot saturate here: 2*127*127 < 32767.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(LBQ_VNNI)
  return LBQ_DPBUSD(acc, u, s);
#else
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// ---- per-group int32 dot vectors (8 lanes whose total is the group's dot product) ----------

// Q8 group of G: sign trick so the unsigned operand is |w| (<= 127).
template <int MR, int G>
inline void q8_group(const int8_t* wb, const int8_t* const* xr, int64_t off, __m256i* out) {
  for (int j = 0; j < MR; ++j) out[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int c = 0; c < G; c += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c));
    const __m256i aw = _mm256_sign_epi8(wv, wv);
    for (int j = 0; j < MR; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off + c));
      out[j] = dot_u8s8(out[j], aw, _mm256_sign_epi8(xv, wv));
    }
  }
}

// Q4 group (natural activation layout), unsigned nibbles; the caller subtracts 8*sum(x).
template <int MR, int G>
inline void q4_group(const uint8_t* wb, const int8_t* const* xr, int64_t off, __m256i* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (G == 32) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
    const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), m4);
    for (int j = 0; j < MR; ++j)
      out[j] = dot_u8s8(_mm256_setzero_si256(), wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off)));
  } else {
#if defined(LBQ_VNNI)
    for (int j = 0; j < MR; ++j) out[j] = _mm256_setzero_si256();
#else
    __m256i s16[MR];  // <= G/32 * 2*15*127 = 15240 for G=128: no int16 overflow
    for (int j = 0; j < MR; ++j) s16[j] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 2
    for (int p = 0; p < G / 2; p += 32) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p));
      const __m256i lo = _mm256_and_si256(t, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), m4);
      for (int j = 0; j < MR; ++j) {
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off + p));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off + G / 2 + p));
#if defined(LBQ_VNNI)
        out[j] = LBQ_DPBUSD(LBQ_DPBUSD(out[j], lo, xl), hi, xh);
#else
        s16[j] = _mm256_add_epi16(s16[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
      }
    }
#if !defined(LBQ_VNNI)
    for (int j = 0; j < MR; ++j) out[j] = _mm256_madd_epi16(s16[j], _mm256_set1_epi16(1));
#endif
  }
}

// Q4 G=32, two consecutive groups at once in the "paired" activation layout (prepare_act):
// lanes 0-3 of the result belong to the first group, lanes 4-7 to the second.
template <int MR>
inline void q4_pair32(const uint8_t* wb, const int8_t* const* xr, int64_t off, __m256i* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
  const __m256i lo = _mm256_and_si256(t, m4);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), m4);
  for (int j = 0; j < MR; ++j) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + off + 32));
#if defined(LBQ_VNNI)
    out[j] = LBQ_DPBUSD(LBQ_DPBUSD(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
    out[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)),
                               _mm256_set1_epi16(1));
#endif
  }
}

// Rearranges quantized activations in place for q4_pair32: in each full chunk of 8 groups of 32,
// groups (2p, 2p+1) become [g0[0:16] g1[0:16] g0[16:32] g1[16:32]].  Other formats: no-op.
inline void prepare_act(bool q4, int G, int8_t* q, int64_t M, int64_t K) {
  if (!q4 || G != 32) return;
  const int64_t chunks = (K / 32) / 8;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* row = q + m * K;
    for (int64_t c = 0; c < chunks * 4; ++c) {
      __m256i* p = reinterpret_cast<__m256i*>(row + c * 64);
      const __m256i x0 = _mm256_loadu_si256(p), x1 = _mm256_loadu_si256(p + 1);
      _mm256_storeu_si256(p, _mm256_permute2x128_si256(x0, x1, 0x20));
      _mm256_storeu_si256(p + 1, _mm256_permute2x128_si256(x0, x1, 0x31));
    }
  }
}

// One weight row n x MR activation rows (m0..m0+MR).  Groups are processed 8 at a time: the 8
// per-group int32 vectors are folded with hadd into one vector of 8 group dots, so the fp32 work
// (scales, convert, FMA) is done once per 8 groups instead of once per group.
template <bool Q4, int MR, int G>
inline void row_tile(const Wt& w, const Act& a, int64_t n, int64_t m0, float* Y, int64_t ldy) {
  const uint8_t* wr = w.q + n * w.row_bytes;
  const uint16_t* sr = w.s + n * w.nb;
  constexpr int64_t GB = Q4 ? G / 2 : G;  // weight bytes per group
  const int8_t* xr[MR];
  const float* dr[MR];
  const int32_t* qs[MR];
  __m256 acc[MR];
  for (int j = 0; j < MR; ++j) {
    xr[j] = a.q + (m0 + j) * a.K;
    dr[j] = a.d + (m0 + j) * a.nb;
    qs[j] = a.s + (m0 + j) * a.nb;
    acc[j] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 8 <= w.nb; b += 8) {
    __m256i r[MR];
    if constexpr (Q4 && G == 32) {
      __m256i p0[MR], p1[MR], h0[MR];
      q4_pair32<MR>(wr + b * 16, xr, b * 32, p0);
      q4_pair32<MR>(wr + b * 16 + 32, xr, b * 32 + 64, p1);
      for (int j = 0; j < MR; ++j) h0[j] = _mm256_hadd_epi32(p0[j], p1[j]);
      q4_pair32<MR>(wr + b * 16 + 64, xr, b * 32 + 128, p0);
      q4_pair32<MR>(wr + b * 16 + 96, xr, b * 32 + 192, p1);
      const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (int j = 0; j < MR; ++j)  // hadd order is [g0 g2 g4 g6 | g1 g3 g5 g7]
        r[j] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h0[j], _mm256_hadd_epi32(p0[j], p1[j])), perm);
    } else {
      __m256i quad[2][MR];
      for (int h = 0; h < 2; ++h) {
        __m256i v0[MR], v1[MR], h01[MR];
        const int64_t g = b + 4 * h;
        if constexpr (Q4) {
          q4_group<MR, G>(wr + g * GB, xr, g * G, v0);
          q4_group<MR, G>(wr + (g + 1) * GB, xr, (g + 1) * G, v1);
        } else {
          q8_group<MR, G>(reinterpret_cast<const int8_t*>(wr + g * GB), xr, g * G, v0);
          q8_group<MR, G>(reinterpret_cast<const int8_t*>(wr + (g + 1) * GB), xr, (g + 1) * G, v1);
        }
        for (int j = 0; j < MR; ++j) h01[j] = _mm256_hadd_epi32(v0[j], v1[j]);
        if constexpr (Q4) {
          q4_group<MR, G>(wr + (g + 2) * GB, xr, (g + 2) * G, v0);
          q4_group<MR, G>(wr + (g + 3) * GB, xr, (g + 3) * G, v1);
        } else {
          q8_group<MR, G>(reinterpret_cast<const int8_t*>(wr + (g + 2) * GB), xr, (g + 2) * G, v0);
          q8_group<MR, G>(reinterpret_cast<const int8_t*>(wr + (g + 3) * GB), xr, (g + 3) * G, v1);
        }
        // [g0 g1 g2 g3 | g0 g1 g2 g3]: low-half and high-half partial sums of each group
        for (int j = 0; j < MR; ++j) quad[h][j] = _mm256_hadd_epi32(h01[j], _mm256_hadd_epi32(v0[j], v1[j]));
      }
      for (int j = 0; j < MR; ++j)
        r[j] = _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][j], quad[1][j], 0x20),
                                _mm256_permute2x128_si256(quad[0][j], quad[1][j], 0x31));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b)));
    for (int j = 0; j < MR; ++j) {
      if constexpr (Q4)  // dot(q - 8, x) = dot(q, x) - 8*sum(x)
        r[j] = _mm256_sub_epi32(r[j],
                                _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[j] + b)), 3));
      acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(dr[j] + b)), _mm256_cvtepi32_ps(r[j]), acc[j]);
    }
  }
  float tail[MR] = {};
  for (; b < w.nb; ++b) {  // tail groups, one at a time (natural activation layout)
    __m256i v[MR];
    if constexpr (Q4)
      q4_group<MR, G>(wr + b * GB, xr, b * G, v);
    else
      q8_group<MR, G>(reinterpret_cast<const int8_t*>(wr + b * GB), xr, b * G, v);
    const float dwb = fp16_to_fp32(sr[b]);
    for (int j = 0; j < MR; ++j) {
      int32_t isum = hsum_epi32(v[j]);  // exact group dot, like the 8-group path
      if constexpr (Q4) isum -= 8 * qs[j][b];
      // an explicit fma: the contraction a compiler may choose differs between instantiations
      tail[j] = std::fma(dwb * dr[j][b], static_cast<float>(isum), tail[j]);
    }
  }
  for (int j = 0; j < MR; ++j) Y[(m0 + j) * ldy + n] = hsum_ps(acc[j]) + tail[j];
}

#if defined(LBQ_GEMM512)
// vpdpbusd acc, w, dword [p]{1to16}: the broadcast is the instruction's memory operand (a
// separate vpbroadcastd per dot costs a shuffle-pipe slot each).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
          : [acc] "+v"(acc)
          : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// ---- Q8 many-row GEMM (prefill; AVX-512 VNNI) ------------------------------------------------
// q8_gemm computes exactly what row_tile<Q8> computes, 16 weight rows in the lanes of a zmm and
// no horizontal sums: row_tile's int32 lane k of a chunk of 8 groups is the exact dot of group
// b + k, here vpdpbusd of w + 128 (unsigned) with the int8 activations started from -128 times
// the group's sum (Act::s); then row_tile's fma of that lane into its accumulator k with
// d_w * d_x, the tail groups' fmas into their own sum, and at the end hsum_ps's tree over the 8
// accumulators plus the tail.  So an output has the same bits on both routes and does not
// depend on how many rows share a call.
constexpr int kQ8Rows = 16;  // weight rows per group (one zmm lane each)
// From this many activation rows Q8 takes q8_gemm (below, the weight is unpacked per call).
constexpr int64_t kQ8GemmM = 8;

struct Q8Scratch {
  std::vector<int32_t> w;  // [K/4][16]: dword of values 4i..4i+3 (w + 128) of each row
  std::vector<float> d;    // [nb][16]: the rows' group scales
};

// acc[j] (16 weight rows of activation row m + j) += group g, as row_tile adds a group into its
// lane: acc = fma(d_w * d_x, float(dot), acc).
template <int R, int G>
inline void q8_group(const Q8Scratch& s, const Act& a, int64_t m, int64_t g, __m512* acc) {
  constexpr int D = G / 4;  // dwords per group
  const int32_t* wg = s.w.data() + g * D * kQ8Rows;
  __m512i i[R];
  for (int j = 0; j < R; ++j) i[j] = _mm512_set1_epi32(-128 * a.s[(m + j) * a.nb + g]);
#pragma GCC unroll 8
  for (int k = 0; k < D; ++k) {
    const __m512i wk = _mm512_loadu_si512(wg + k * kQ8Rows);
    for (int j = 0; j < R; ++j) i[j] = dpbusd_bcast(i[j], wk, a.q + (m + j) * a.K + g * G + 4 * k);
  }
  const __m512 dw = _mm512_loadu_ps(s.d.data() + g * kQ8Rows);
  for (int j = 0; j < R; ++j) {
    const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[(m + j) * a.nb + g]));
    acc[j] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(i[j]), acc[j]);
  }
}

// Y[m..m+R-1, 16 rows] (masked to the group's rows) over every group of K.
template <int R, int G>
inline void q8_tile(const Q8Scratch& s, const Act& a, int64_t m, float* Y, int64_t ldy, __mmask16 mask) {
  __m512 A[8][R];  // row_tile's 8 lanes (group b + k goes to lane k), for each activation row
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < R; ++j) A[k][j] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= a.nb; b += 8) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) q8_group<R, G>(s, a, m, b + k, A[k]);
  }
  __m512 T[R];  // row_tile's tail: tail += (dwb * dx) * float(dot), group by group
  for (int j = 0; j < R; ++j) T[j] = _mm512_setzero_ps();
  for (; b < a.nb; ++b) q8_group<R, G>(s, a, m, b, T);
  for (int j = 0; j < R; ++j) {  // hsum_ps's tree: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(A[0][j], A[4][j]), _mm512_add_ps(A[2][j], A[6][j])),
                                   _mm512_add_ps(_mm512_add_ps(A[1][j], A[5][j]), _mm512_add_ps(A[3][j], A[7][j])));
    _mm512_mask_storeu_ps(Y + (m + j) * ldy, mask, _mm512_add_ps(y, T[j]));
  }
}

// Y[:, n0:n1] (Y is [M, ldy]) for all M activation rows of Q8 weight rows, 16 at a time.
template <int G>
inline void q8_gemm(const Wt& w, const Act& a, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  static thread_local Q8Scratch s;
  const int64_t K = a.K, nb = a.nb, M = a.M;
  s.w.resize(static_cast<size_t>(K / 4 * kQ8Rows));
  s.d.resize(static_cast<size_t>(nb * kQ8Rows));
  for (int64_t n = n0; n < n1; n += kQ8Rows) {
    const int rows = static_cast<int>(std::min<int64_t>(kQ8Rows, n1 - n));
    for (int r = 0; r < kQ8Rows; ++r) {  // rows past the end: zeros (their lanes are not stored)
      const uint8_t* wr = w.q + (n + std::min(r, rows - 1)) * w.row_bytes;
      for (int64_t i = 0; i < K / 4; ++i) {
        uint32_t v;
        std::memcpy(&v, wr + 4 * i, 4);
        s.w[static_cast<size_t>(i * kQ8Rows + r)] = static_cast<int32_t>(r < rows ? v ^ 0x80808080u : 0u);
      }
      const uint16_t* sr = w.s + (n + std::min(r, rows - 1)) * nb;
      for (int64_t b = 0; b < nb; ++b) s.d[static_cast<size_t>(b * kQ8Rows + r)] = r < rows ? fp16_to_fp32(sr[b]) : 0.f;
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) q8_tile<3, G>(s, a, m, Y + n, ldy, mask);
    if (M - m == 2) q8_tile<2, G>(s, a, m, Y + n, ldy, mask);
    if (M - m == 1) q8_tile<1, G>(s, a, m, Y + n, ldy, mask);
  }
}

// Y[m..m+R-1, n0:n1] of Q8 G = 32 weight rows for a few activation rows (decode, small
// batches): row_tile's lanes and fmas (lane k of a chunk of 8 groups is the exact dot of group
// b + k, added with d_w * d_x; tail groups one by one), so the same bits.  A chunk is 4 zmm of
// w + 128 (unsigned) dotted by vpdpbusd, whose 8 dword sums per group are folded by two
// rounds of even/odd lane permutes and a qword fold; -128 times the group's activation sum
// (Act::s) takes the offset off.
template <int R>
inline void q8_rows(const Wt& w, const Act& a, int64_t m, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  const int64_t K = a.K, nb = a.nb;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  auto fold = [&](__m512i x, __m512i y) {  // pairs of lanes summed: x's then y's
    return _mm512_add_epi32(_mm512_permutex2var_epi32(x, even, y), _mm512_permutex2var_epi32(x, odd, y));
  };
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = reinterpret_cast<const int8_t*>(w.q + n * w.row_bytes);
    const uint16_t* sr = w.s + n * nb;
    __m256 acc[R];
    for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      __m512i I[4][R];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        prefetch_ahead(wr + b * 32 + 64 * c);
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(wr + b * 32 + 64 * c), flip);
        for (int j = 0; j < R; ++j)
          I[c][j] =
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a.q + (m + j) * K + b * 32 + 64 * c));
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + b)));
      for (int j = 0; j < R; ++j) {
        const __m512i t = fold(fold(I[0][j], I[1][j]), fold(I[2][j], I[3][j]));  // 2 lanes per group
        __m256i r = _mm512_cvtepi64_epi32(_mm512_add_epi32(t, _mm512_srli_epi64(t, 32)));
        const __m256i sx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s + (m + j) * nb + b));
        r = _mm256_sub_epi32(r, _mm256_slli_epi32(sx, 7));
        acc[j] =
            _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(a.d + (m + j) * nb + b)), _mm256_cvtepi32_ps(r), acc[j]);
      }
    }
    float tail[R] = {};
    for (; b < nb; ++b) {  // row_tile's tail groups
      if (b % 2 == 0) prefetch_ahead(wr + b * 32);
      const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * 32)),
                                         _mm256_set1_epi8(static_cast<char>(0x80)));
      const float dwb = fp16_to_fp32(sr[b]);
      for (int j = 0; j < R; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m + j) * K + b * 32));
        const int32_t isum =
            hsum_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv)) - 128 * a.s[(m + j) * nb + b];
        tail[j] = std::fma(dwb * a.d[(m + j) * nb + b], static_cast<float>(isum), tail[j]);  // row_tile's
      }
    }
    for (int j = 0; j < R; ++j) Y[(m + j) * ldy + n] = hsum_ps(acc[j]) + tail[j];
  }
}

// Y[:, n0:n1] of Q8 G = 32 weight rows for M < kQ8GemmM activation rows, up to 4 at a time.
inline void q8_small(const Wt& w, const Act& a, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) q8_rows<4>(w, a, m, n0, n1, Y, ldy);
  switch (a.M - m) {
    case 3:
      q8_rows<3>(w, a, m, n0, n1, Y, ldy);
      break;
    case 2:
      q8_rows<2>(w, a, m, n0, n1, Y, ldy);
      break;
    case 1:
      q8_rows<1>(w, a, m, n0, n1, Y, ldy);
      break;
    default:
      break;
  }
}
#endif  // LBQ_GEMM512

#else  // !LBQ_AVX2

inline void quantize_act_row(const float* x, int64_t K, int G, int8_t* q, float* d, int32_t* s) {
  quantize_act_row_scalar(x, K, G, q, d, s);
}

#if defined(LBQ_NEON)
// Signed dot of 2x16 int8 pairs, as 4 int32 partial sums added to acc.
inline int32x4_t dot_s8x32(int32x4_t acc, int8x16_t w0, int8x16_t x0, int8x16_t w1, int8x16_t x1) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdotq_s32(acc, w0, x0), w1, x1);
#else
  // |w|,|x| <= 127 (Q4: |w| <= 8), so a pair of products fits int16.
  int16x8_t p0 = vmull_s8(vget_low_s8(w0), vget_low_s8(x0));
  p0 = vmlal_s8(p0, vget_high_s8(w0), vget_high_s8(x0));
  int16x8_t p1 = vmull_s8(vget_low_s8(w1), vget_low_s8(x1));
  p1 = vmlal_s8(p1, vget_high_s8(w1), vget_high_s8(x1));
  return vaddq_s32(acc, vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)));
#endif
}
#endif

inline void prepare_act(bool, int, int8_t*, int64_t, int64_t) {}

// Portable tile (NEON or scalar): one weight row n x MR activation rows.
template <bool Q4, int MR, int G>
inline void row_tile(const Wt& w, const Act& a, int64_t n, int64_t m0, float* Y, int64_t ldy) {
  const uint8_t* wr = w.q + n * w.row_bytes;
  const uint16_t* sr = w.s + n * w.nb;
  constexpr int64_t GB = Q4 ? G / 2 : G;
  for (int j = 0; j < MR; ++j) {
    const int8_t* xr = a.q + (m0 + j) * a.K;
    const float* dr = a.d + (m0 + j) * a.nb;
    float acc = 0.f;
    for (int64_t b = 0; b < w.nb; ++b) {
      const int8_t* xb = xr + b * G;
      int32_t isum;
      if constexpr (Q4) {
        const uint8_t* wb = wr + b * GB;
#if defined(LBQ_NEON)
        const uint8x16_t m4 = vdupq_n_u8(0x0F);
        const int8x16_t s8 = vdupq_n_s8(8);
        int32x4_t v = vdupq_n_s32(0);
        for (int p = 0; p < G / 2; p += 16) {
          const uint8x16_t t = vld1q_u8(wb + p);
          const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(t, m4)), s8);
          const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(t, 4)), s8);
          v = dot_s8x32(v, lo, vld1q_s8(xb + p), hi, vld1q_s8(xb + G / 2 + p));
        }
        isum = vaddvq_s32(v);
#else
        isum = 0;
        for (int k = 0; k < G / 2; ++k) {
          isum += (static_cast<int32_t>(wb[k] & 0x0F) - 8) * xb[k];
          isum += (static_cast<int32_t>(wb[k] >> 4) - 8) * xb[k + G / 2];
        }
#endif
      } else {
        const int8_t* wb = reinterpret_cast<const int8_t*>(wr + b * GB);
#if defined(LBQ_NEON)
        int32x4_t v = vdupq_n_s32(0);
        for (int c = 0; c < G; c += 32)
          v = dot_s8x32(v, vld1q_s8(wb + c), vld1q_s8(xb + c), vld1q_s8(wb + c + 16), vld1q_s8(xb + c + 16));
        isum = vaddvq_s32(v);
#else
        isum = 0;
        for (int k = 0; k < G; ++k) isum += static_cast<int32_t>(wb[k]) * xb[k];
#endif
      }
      acc += (fp16_to_fp32(sr[b]) * dr[b]) * static_cast<float>(isum);
    }
    Y[(m0 + j) * ldy + n] = acc;
  }
}
#endif  // LBQ_AVX2

// ---------------------------------------------------------------------------------------
// Row-range driver: Y[:, n0:n1] for all M rows (Y is [M, N] fp32).  For each weight row, the
// activation rows are processed in chunks of <= 4 while the row's bytes are hot in L1.
// ---------------------------------------------------------------------------------------
template <bool Q4, int G>
inline void gemv_rows_g(const Wt& w, const Act& a, int64_t n0, int64_t n1, float* Y) {
  const int64_t ldy = w.N;
#if defined(LBQ_GEMM512)
  if constexpr (!Q4) {
    if (a.M >= kQ8GemmM) {
      q8_gemm<G>(w, a, n0, n1, Y, ldy);
      return;
    }
    if constexpr (G == 32) {
      q8_small(w, a, n0, n1, Y, ldy);
      return;
    }
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m0 = 0;
    for (; m0 + 4 <= a.M; m0 += 4) row_tile<Q4, 4, G>(w, a, n, m0, Y, ldy);
    switch (a.M - m0) {
      case 3:
        row_tile<Q4, 3, G>(w, a, n, m0, Y, ldy);
        break;
      case 2:
        row_tile<Q4, 2, G>(w, a, n, m0, Y, ldy);
        break;
      case 1:
        row_tile<Q4, 1, G>(w, a, n, m0, Y, ldy);
        break;
      default:
        break;
    }
  }
}

// Returns false for an unsupported group size.
inline bool gemv_rows(bool q4, int G, const Wt& w, const Act& a, int64_t n0, int64_t n1, float* Y) {
  switch (G) {
    case 32:
      q4 ? gemv_rows_g<true, 32>(w, a, n0, n1, Y) : gemv_rows_g<false, 32>(w, a, n0, n1, Y);
      return true;
    case 64:
      q4 ? gemv_rows_g<true, 64>(w, a, n0, n1, Y) : gemv_rows_g<false, 64>(w, a, n0, n1, Y);
      return true;
    case 128:
      q4 ? gemv_rows_g<true, 128>(w, a, n0, n1, Y) : gemv_rows_g<false, 128>(w, a, n0, n1, Y);
      return true;
    default:
      return false;
  }
}

}  // namespace lbq
