// Stand-alone self-test of gemv_kernels.h (no torch): builds with any C++17 compiler, e.g.
//   g++ -std=c++17 -O2 -march=native selftest.cpp && ./a.out                (AVX2 / native path)
//   g++ -std=c++17 -O2 -DLOWBAND_QUANT_SCALAR selftest.cpp && ./a.out       (scalar path)
//   aarch64-linux-gnu-g++ -std=c++17 -O2 -static -march=armv8.2-a+dotprod selftest.cpp
//       && qemu-aarch64 ./a.out                                            (NEON path)
//   python -m ziglang c++ -target aarch64-linux-musl -mcpu=generic+dotprod -std=c++17 -O2 -static
//       selftest.cpp && qemu-aarch64-static ./a.out     (NEON without a cross toolchain: pip
//                                                       install ziglang; -mcpu=generic: no SDOT)
// Compares the kernel with a double-precision evaluation of the same integer semantics
// (scalar activation quantization, exact int32 group dots) over many shapes; prints the ISA and
// the worst relative error and exits non-zero on a mismatch.  Used by tests/edge/test_quant.py.
// The ggml block kernels (ggml_kernels.h) are checked against a double-precision evaluation of
// their semantics (exact int dots of decoded q with the int8 activations, a*d_x per 16 values,
// b times the fp32 per-16 sums); the decoders themselves are checked
// against edge/quant/ggml.py by tests/edge/test_ggml_quant.py.
#include <cstdio>
#include <vector>

#include "gemv_kernels.h"
#include "ggml_kernels.h"

namespace {

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return static_cast<uint32_t>(rng_state >> 16);
}
float next_normalish() {  // sum of uniforms, roughly N(0, 1)
  float s = 0.f;
  for (int i = 0; i < 4; ++i) s += static_cast<float>(next_u32() % 20001) / 10000.f - 1.f;
  return s * 0.866f;
}

double half_ref(uint16_t h) {  // normal halves only (the test generates no others)
  const int e = (h >> 10) & 0x1f;
  const double v = std::ldexp(1024.0 + (h & 0x3ff), e - 25);
  return (h & 0x8000) ? -v : v;
}

int check(bool q4, int G, int64_t M, int64_t N, int64_t K, double* worst) {
  const int64_t nb = K / G;
  const int64_t row_bytes = q4 ? K / 2 : K;
  std::vector<uint8_t> wq(N * row_bytes);
  std::vector<uint16_t> ws(N * nb);
  for (auto& b : wq)
    b = q4 ? static_cast<uint8_t>(next_u32() & 0xff)
           : static_cast<uint8_t>(static_cast<int8_t>(next_u32() % 255 - 127));
  for (auto& s : ws)
    s = static_cast<uint16_t>(((next_u32() & 1) << 15) | ((10 + next_u32() % 5) << 10) | (next_u32() & 0x3ff));
  std::vector<float> x(M * K);
  for (auto& v : x) v = next_normalish();
  if (K >= 64) x[5] = 0.f, x[7] = 1e-30f;  // odd values
  if (M > 1)                               // an all-zero activation block (scale 0)
    for (int j = 0; j < G; ++j) x[K + j] = 0.f;

  std::vector<int8_t> xq(M * K), rq(M * K);
  std::vector<float> xd(M * nb), rd(M * nb);
  std::vector<int32_t> xs(M * nb), rs(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    lbq::quantize_act_row(x.data() + m * K, K, G, xq.data() + m * K, xd.data() + m * nb, xs.data() + m * nb);
    lbq::quantize_act_row_scalar(x.data() + m * K, K, G, rq.data() + m * K, rd.data() + m * nb, rs.data() + m * nb);
  }
  for (int64_t i = 0; i < M * K; ++i)
    if (xq[i] != rq[i]) {
      std::printf("FAIL act quant q4=%d G=%d i=%ld\n", q4, G, (long)i);
      return 1;
    }
  for (int64_t i = 0; i < M * nb; ++i)
    if (xd[i] != rd[i] || xs[i] != rs[i]) {
      std::printf("FAIL act scale q4=%d G=%d\n", q4, G);
      return 1;
    }
  lbq::prepare_act(q4, G, xq.data(), M, K);
  const lbq::Act a{xq.data(), xd.data(), xs.data(), M, K, nb};
  const lbq::Wt w{wq.data(), ws.data(), N, K, nb, row_bytes};
  std::vector<float> y(M * N, -1.f);
  if (!lbq::gemv_rows(q4, G, w, a, 0, N, y.data())) {
    std::printf("FAIL group %d\n", G);
    return 1;
  }

  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0.0, mag = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        int64_t isum = 0;
        for (int j = 0; j < G; ++j) {
          const int64_t k = b * G + j;
          int wv;
          if (q4) {
            const int jj = j < G / 2 ? j : j - G / 2;
            const uint8_t byte = wq[n * row_bytes + b * (G / 2) + jj];
            wv = (j < G / 2 ? (byte & 0x0F) : (byte >> 4)) - 8;
          } else {
            wv = static_cast<int8_t>(wq[n * row_bytes + k]);
          }
          isum += static_cast<int64_t>(wv) * rq[m * K + k];
        }
        const double t = static_cast<double>(static_cast<float>(half_ref(ws[n * nb + b])) * rd[m * nb + b]) * isum;
        ref += t;
        mag += std::fabs(t);
      }
      const double err = std::fabs(ref - y[m * N + n]) / (mag + 1e-30);
      if (err > *worst) *worst = err;
      if (err > 1e-5) {
        std::printf("FAIL q4=%d G=%d M=%ld N=%ld K=%ld m=%ld n=%ld: %g vs %g\n", q4, G, (long)M, (long)N, (long)K,
                    (long)m, (long)n, (double)y[m * N + n], ref);
        return 1;
      }
    }
  return 0;
}

void put_f16(uint8_t* p) {  // a normal half of magnitude ~2^-3..2^1 with a random sign
  const uint16_t h =
      static_cast<uint16_t>(((next_u32() & 1) << 15) | ((12 + next_u32() % 4) << 10) | (next_u32() & 0x3ff));
  std::memcpy(p, &h, 2);
}

int check_ggml(int type, int64_t M, int64_t N, int64_t nb, double* worst) {
  int qk, size;
  if (!lbq::ggml::block_shape(type, &qk, &size)) {
    std::printf("FAIL ggml type %d\n", type);
    return 1;
  }
  const int64_t K = nb * qk, row_bytes = nb * size;
  std::vector<uint8_t> w(N * row_bytes);
  for (auto& b : w) b = static_cast<uint8_t>(next_u32() & 0xff);
  const int f16_at[][2] = {{0, 2}, {0, -1}, {0, 2}, {80, 82}, {108, -1}, {0, 2}, {0, 2}, {208, -1}};
  const int idx = type == 3 ? 0 : type == 6 ? 1 : type == 7 ? 2 : type - 7;
  for (int64_t blk = 0; blk < N * nb; ++blk)
    for (int f : f16_at[idx])
      if (f >= 0) put_f16(w.data() + blk * size + f);
  std::vector<float> x(M * K), y(M * N, -1.f);
  for (auto& v : x) v = next_normalish();
  if (M > 1)  // an all-zero activation block (scale 0)
    for (int j = 0; j < 32; ++j) x[K + j] = 0.f;
  std::vector<int8_t> xq(M * K), rq(M * K);
  std::vector<float> xd(M * (K / 32)), rd(M * (K / 32));
  std::vector<int32_t> xs(M * (K / 32)), rs(M * (K / 32));
  for (int64_t m = 0; m < M; ++m) {
    lbq::quantize_act_row(x.data() + m * K, K, 32, xq.data() + m * K, xd.data() + m * (K / 32),
                          xs.data() + m * (K / 32));
    lbq::quantize_act_row_scalar(x.data() + m * K, K, 32, rq.data() + m * K, rd.data() + m * (K / 32),
                                 rs.data() + m * (K / 32));
  }
  lbq::ggml::GActBuf buf;
  buf.resize(M, K);
  for (int64_t m = 0; m < M; ++m) buf.row(x.data() + m * K, m, K);
  const lbq::ggml::GAct act = buf.view(M, K);
  const std::vector<float>& xs16 = buf.s16;
  lbq::ggml::gemv_rows(type, w.data(), row_bytes, act, N, 0, N, y.data());
  for (int64_t m = 0; m < M; ++m) {  // one row alone gives the same bits as in the M-row call
    const lbq::ggml::GAct one{buf.q.data() + m * K,
                              buf.d.data() + m * (K / 32),
                              buf.s16.data() + m * (K / 16),
                              buf.s32.data() + m * (K / 32),
                              buf.i16.data() + m * (K / 16),
                              1,
                              K};
    std::vector<float> y1(N, -1.f);
    lbq::ggml::gemv_rows(type, w.data(), row_bytes, one, N, 0, N, y1.data());
    for (int64_t n = 0; n < N; ++n)
      if (std::memcmp(&y1[n], &y[m * N + n], sizeof(float)) != 0) {
        std::printf("FAIL ggml type=%d M=%ld m=%ld n=%ld: alone %.9g, in the batch %.9g\n", type, (long)M, (long)m,
                    (long)n, (double)y1[n], (double)y[m * N + n]);
        return 1;
      }
  }
  std::vector<int8_t> q(qk);
  std::vector<float> a(qk / 16), b(qk / 16);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      double ref = 0.0, mag = 0.0;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint8_t* p = w.data() + n * row_bytes + blk * size;
        std::vector<int8_t> q2(qk);
        std::vector<float> a2(qk / 16), b2(qk / 16);
        lbq::ggml::decode_block(type, false, p, q.data(), a.data(), b.data());
        lbq::ggml::decode_block(type, true, p, q2.data(), a2.data(), b2.data());
        if (q != q2 || a != a2 || b != b2) {  // the SIMD decoder must equal the plain C++ one
          std::printf("FAIL ggml decode type=%d block=%ld\n", type, (long)blk);
          return 1;
        }
        for (int s = 0; s < qk / 16; ++s) {  // exact int dot per 16, fp32 scale a_s * d_x
          int64_t isum = 0;
          for (int i = 16 * s; i < 16 * s + 16; ++i) isum += q[i] * rq[m * K + blk * qk + i];
          const double t = static_cast<double>(a[s] * rd[m * (K / 32) + (blk * qk + 16 * s) / 32]) * isum;
          const double u = static_cast<double>(b[s]) * xs16[m * (K / 16) + blk * qk / 16 + s];
          ref += t + u;
          mag += std::fabs(t) + std::fabs(u);
        }
      }
      const double err = std::fabs(ref - y[m * N + n]) / (mag + 1e-30);
      if (err > *worst) *worst = err;
      if (err > 1e-5) {
        std::printf("FAIL ggml type=%d M=%ld N=%ld nb=%ld m=%ld n=%ld: %g vs %g\n", type, (long)M, (long)N, (long)nb,
                    (long)m, (long)n, (double)y[m * N + n], ref);
        return 1;
      }
    }
  return 0;
}

}  // namespace

int main() {
  double worst = 0.0;
  int fails = 0, cases = 0;
  const int64_t Ms[] = {1, 2, 3, 4, 5, 9};
  const int64_t Ns[] = {1, 5, 8};
  for (int q4 = 0; q4 < 2; ++q4)
    for (int G : {32, 64, 128})
      for (int64_t nb : {1, 3, 8, 9, 17})
        for (int64_t M : Ms)
          for (int64_t N : Ns) {
            fails += check(q4 != 0, G, M, N, nb * G, &worst);
            ++cases;
          }
  for (int type : {3, 6, 7, 10, 11, 12, 13, 14})
    // 5 super-blocks: the AVX-512 GEMM's K tiles of 4 and a tail; M: every route (one row,
    // row tiles, the GEMM, blocks)
    for (int64_t nb : {1, 3, 5})
      for (int64_t M : {1, 2, 5, 9, 33, 131})
        for (int64_t N : {1, 4, 37}) {
          fails += check_ggml(type, M, N, nb, &worst);
          ++cases;
        }
  std::printf("isa=%s cases=%d fails=%d worst_rel=%.3g\n", lbq::isa_name(), cases, fails, worst);
  return fails ? 1 : 0;
}
