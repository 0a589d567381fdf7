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

// Y[m, n0:n1] (rows ldy apart) for M activation rows: for each group of kLeafRows weight rows,
// leaf(c, a, b, part_c) writes leaf c's outputs of rows [a, b) to part_c[m * N + n] (part_c =
// part + c * M * N), every leaf of a group before the next group (so a weight row's bytes are
// read close together in time, as without the split), then the tree adds them into Y.
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
        for (int64_t step = 1; step < S; step *= 2)
          for (int64_t c = 0; c + step < S; c += 2 * step) v[c] += v[c + step];
        Y[m * ldy + n] = v[0];
      }
  }
}

}  // namespace lbq
