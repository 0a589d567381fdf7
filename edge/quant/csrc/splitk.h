// Split-K in a fixed reduction tree (edge/tp.py, "Bit-exact TP"): a row-parallel linear's K
// values are cut into S = K / chunk leaves of `chunk` values (S a power of two); each leaf's
// outputs are computed on their own (activations quantized per 32 values within the leaf, which
// is how the whole row is quantized too) and the leaves are added pairwise, level by level:
// ((l0 + l1) + (l2 + l3)) for S = 4. A tensor-parallel rank that holds an aligned run of
// leaves computes that subtree with the same kernels, so the ranks' all-reduce of their
// partial sums gives one device's bits (two ranks: a + b == b + a).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lbq {

constexpr int64_t kMaxLeaves = 64;

constexpr int64_t kLeafRows = 16;  // weight rows whose leaves are computed one after another

// The pairwise tree over p[0..S-1], level by level; the sum in p[0].
inline float tree_sum(float* p, int64_t S) {
  for (int64_t step = 1; step < S; step *= 2)
    for (int64_t c = 0; c + step < S; c += 2 * step) p[c] += p[c + step];
  return p[0];
}

// Y[m, n0:n1] (rows ldy apart) for M activation rows: for each group of kLeafRows weight rows, leaf(c, a, b, part_c)
// writes leaf c's outputs of rows [a, b) to part_c[m * N + n] (part_c = part + c * M * N), every leaf of a group before
// the next group, then the tree adds them into Y.
template <class Leaf>
inline void split_k_rows(int64_t S, int64_t M, int64_t N, int64_t n0, int64_t n1, float* part, float* Y, int64_t ldy,
                         Leaf&& leaf) {
  const int64_t MN = M * N;
  for (int64_t a = n0; a < n1; a += kLeafRows) {
    const int64_t b = std::min(n1, a + kLeafRows);
    for (int64_t c = 0; c < S; ++c) leaf(c, a, b, part + c * MN);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = a; n < b; ++n) {
        float v[kMaxLeaves];
        for (int64_t c = 0; c < S; ++c) v[c] = part[c * MN + m * N + n];
        Y[m * ldy + n] = tree_sum(v, S);
      }
  }
}

#if defined(LBQ_AVX2)
namespace ggml {
// The decode route (one activation row x, over the whole K) of a K-quant cut into S leaves:
// for each weight row, fused_rows<T, 1, 1>'s kdot sequence from a zero accumulator over each
// leaf's super-blocks and its hsum_ps (the bits rows_range gives that leaf alone), the leaves
// then added in the tree. One pass over each row, front to back, and no call per leaf: the
// generic split_k_rows route cost a 640 x 2048 Q6_K GEMV a fifth more here.
template <int T>
inline void fused_leaves(const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t S, int64_t n0, int64_t n1,
                         float* Y) {
  const int64_t lb = x.K / 256 / S;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float p[kMaxLeaves];
    for (int64_t c = 0; c < S; ++c) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t blk = c * lb; blk < (c + 1) * lb; ++blk) {
        KUnp u;
        Fused<T>::unpack(wr + blk * Traits<T>::SIZE, u);
        acc = kdot<T>(u, x.q + blk * 256, x.d + blk * 8, x.s32 + blk * 8, x.s16 + blk * 16, x.i16 + blk * 16, acc);
      }
      p[c] = hsum_ps(acc);
    }
    Y[n] = tree_sum(p, S);
  }
}

// fused_leaves for a K-quant type id (false: another type, which takes split_k_rows).
inline bool leaves_row(int type, const uint8_t* w, int64_t row_bytes, const GAct& x, int64_t S, int64_t n0, int64_t n1,
                       float* Y) {
  switch (type) {
    case Q2_K:
      fused_leaves<Q2_K>(w, row_bytes, x, S, n0, n1, Y);
      return true;
    case Q3_K:
      fused_leaves<Q3_K>(w, row_bytes, x, S, n0, n1, Y);
      return true;
    case Q4_K:
      fused_leaves<Q4_K>(w, row_bytes, x, S, n0, n1, Y);
      return true;
    case Q5_K:
      fused_leaves<Q5_K>(w, row_bytes, x, S, n0, n1, Y);
      return true;
    case Q6_K:
      fused_leaves<Q6_K>(w, row_bytes, x, S, n0, n1, Y);
      return true;
    default:
      return false;
  }
}

inline bool leaves_row_type(int type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K;
}
}  // namespace ggml
#endif

}  // namespace lbq
