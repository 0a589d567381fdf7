// Split-K in a fixed reduction tree (edge/tp.py, "Bit-exact TP"): a row-parallel linear's K
// values are cut into S = K / chunk leaves of `chunk` values (S a power of two); each leaf's
// outputs are computed on their own (activations quantized per 32 values within the leaf, which
// is how the whole row is quantized too) and the leaves are added pairwise, level by level:
// ((l0 + l1) + (l2 + l3)) for S = 4. A tensor-parallel rank that holds an aligned run of
// leaves computes that subtree with the same kernels, so the ranks' all-reduce of their
// partial sums gives one device's bits (two ranks: a + b == b + a; more: the star sum's tree).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lbq {

// Y[m, 0:N] (rows ldy apart) = the tree sum over S leaves of leaf(c, part, ldp): leaf c writes
// its [M, N] outputs to part (rows ldp apart). scratch holds the S leaves' outputs.
template <class Leaf>
inline void split_k_tree(int64_t S, int64_t M, int64_t N, float* Y, int64_t ldy, std::vector<float>& scratch,
                         Leaf&& leaf) {
  const int64_t MN = M * N;
  scratch.resize(static_cast<size_t>(S * MN));
  float* p = scratch.data();
  for (int64_t c = 0; c < S; ++c) leaf(c, p + c * MN, N);
  for (int64_t step = 1; step < S; step *= 2)
    for (int64_t c = 0; c + step < S; c += 2 * step) {
      float* a = p + c * MN;
      const float* b = p + (c + step) * MN;
      for (int64_t i = 0; i < MN; ++i) a[i] += b[i];
    }
  for (int64_t m = 0; m < M; ++m) std::copy(p + m * N, p + (m + 1) * N, Y + m * ldy);
}

}  // namespace lbq
