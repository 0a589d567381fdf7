// Torch binding for the quantized GEMV kernels in gemv_kernels.h (built JIT by edge/quant/kernel.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "gemv_kernels.h"
#include "pool.h"
#include "ggml_kernels.h"
#include "splitk.h"

const uint8_t* ggml_packed_ptr(const torch::Tensor& packed, int64_t type, int64_t N, int64_t K);  // decode.cpp

namespace {

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales, int64_t bits,
                   int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128, got ", group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be a contiguous 2-D tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kHalf,
              "scales must be a contiguous 2-D float16 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % group == 0, "K=", K, " is not a multiple of group=", group);
  const int64_t nb = K / group;
  if (bits == 8) {
    TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == K, "Q8 qweight must be int8 [N, K]");
  } else {
    TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) == K / 2, "Q4 qweight must be uint8 [N, K/2]");
  }
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == nb, "scales must be [N, K/group]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor");
  }

  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) {
    y.zero_();
  } else {
    // Quantize the activations once (one block scale per weight group).
    std::vector<int8_t> xq(static_cast<size_t>(M * K));
    std::vector<float> xd(static_cast<size_t>(M * nb));
    std::vector<int32_t> xs(static_cast<size_t>(M * nb));
    const float* xp = x.data_ptr<float>();
    lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        lbq::quantize_act_row(xp + m * K, K, static_cast<int>(group), xq.data() + m * K, xd.data() + m * nb,
                              xs.data() + m * nb);
    });
    lbq::prepare_act(bits == 4, static_cast<int>(group), xq.data(), M, K);
    const lbq::Act a{xq.data(), xd.data(), xs.data(), M, K, nb};
    const lbq::Wt w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                    reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                    N,
                    K,
                    nb,
                    bits == 8 ? K : K / 2};
    float* yp = y.data_ptr<float>();
    const bool q4 = bits == 4;
    const int G = static_cast<int>(group);
    // ~64k weights per task; at one thread parallel_for runs inline.
    const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
    lbq::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { lbq::gemv_rows(q4, G, w, a, n0, n1, yp); });
  }
  if (bias.has_value()) {
    const float* bp = bias->data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
  }
  return y;
}

// Y[M, N] = x[m, 0:K] (rows ldx apart) @ W^T for N ggml weight rows of K values at wp (rows
// row_bytes apart); pp: their repacked layout for K values, or null.
void ggml_rows_all(const float* xp, int64_t ldx, int64_t M, int64_t K, int t, const uint8_t* wp, int64_t row_bytes,
                   int64_t N, const uint8_t* pp, float* yp) {
  // int8 activations per 32 values (as the Q8/Q4 kernels) and their sums.
  lbq::ggml::GActBuf buf;
  buf.resize(M, K);
  lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) buf.row(xp + m * ldx, m, K);
  });
  const lbq::ggml::GAct a = buf.view(M, K);
  if (pp != nullptr) {  // threads split on the 16-row groups of the repacked layout
    const int64_t groups = (N + 15) / 16;
    lbq::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      lbq::ggml::gemv_rows(t, wp, row_bytes, a, N, g0 * 16, std::min(N, g1 * 16), yp, pp);
    });
  } else {
    const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / K);
    lbq::parallel_for(0, N, grain,
                      [&](int64_t n0, int64_t n1) { lbq::ggml::gemv_rows(t, wp, row_bytes, a, N, n0, n1, yp); });
  }
}

// y[M,N] = x[M,K] @ W^T (+ bias) for ggml blocks kept as in the GGUF file (ggml_kernels.h);
// packed: their repacked layout for batches (ggml_pack), or None. chunk > 0: split-K in leaves
// of chunk values added in splitk.h's tree (packed then holds each leaf's layout in turn).
torch::Tensor ggml_gemv(const torch::Tensor& x, const torch::Tensor& blocks, int64_t type,
                        const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& packed,
                        int64_t chunk) {
  int qk = 0, size = 0;
  TORCH_CHECK(lbq::ggml::block_shape(static_cast<int>(type), &qk, &size), "unsupported ggml type id ", type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(
      blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte && blocks.device().is_cpu(),
      "blocks must be a contiguous 2-D uint8 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % qk == 0, "K=", K, " is not a multiple of the block size ", qk);
  const int64_t row_bytes = K / qk * size;
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks must be [N, ", row_bytes, "] for K=", K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor");
  }
  const bool split = chunk > 0 && chunk < K;
  const int64_t S = split ? K / chunk : 1;
  TORCH_CHECK(!split || (chunk % qk == 0 && K % chunk == 0 && (S & (S - 1)) == 0 && S <= lbq::kMaxLeaves),
              "split-K chunk ", chunk, " must be whole blocks of ", qk, " and cut K=", K,
              " into a power of two of leaves");
  auto y = torch::zeros({M, N}, x.options());
  if (M > 0 && N > 0 && K > 0) {
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int t = static_cast<int>(type);
    // (the layout's bytes grow with K, so the S leaves' layouts take the whole weight's)
    const uint8_t* pp = packed.has_value() ? ggml_packed_ptr(*packed, type, N, K) : nullptr;
    if (!split) {
      ggml_rows_all(xp, K, M, K, t, wp, row_bytes, N, pp, yp);
#if defined(LBQ_AVX2)
    } else if (M == 1 && lbq::ggml::leaves_row_type(t)) {  // as decode.cpp's run_split
      lbq::ggml::GActBuf buf;
      buf.resize(1, K);
      buf.row(xp, 0, K);
      const lbq::ggml::GAct a = buf.view(1, K);
      lbq::parallel_for(0, N, std::max<int64_t>(8, (int64_t{1} << 16) / K),
                        [&](int64_t n0, int64_t n1) { lbq::ggml::leaves_row(t, wp, row_bytes, a, S, n0, n1, yp); });
#endif
    } else {  // as decode.cpp's run_split: each leaf's activations, 16 weight rows at a time
      const int64_t pb = lbq::ggml::packed_bytes(t, N, chunk), leaf_bytes = chunk / qk * size;
      std::vector<lbq::ggml::GActBuf> bufs(static_cast<size_t>(S));
      for (auto& b : bufs) b.resize(M, chunk);
      lbq::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t c = 0; c < S; ++c) bufs[c].row(xp + m * K + c * chunk, m, chunk);
      });
      std::vector<lbq::ggml::GAct> acts;
      for (int64_t c = 0; c < S; ++c) acts.push_back(bufs[c].view(M, chunk));
      std::vector<float> part(static_cast<size_t>(S * M * N));
      auto rows = [&](int64_t n0, int64_t n1) {
        lbq::split_k_rows(S, M, N, n0, n1, part.data(), yp, N, [&](int64_t c, int64_t a, int64_t b, float* pc) {
          lbq::ggml::gemv_rows(t, wp + c * leaf_bytes, row_bytes, acts[c], N, a, b, pc,
                               pp != nullptr ? pp + c * pb : nullptr);
        });
      };
      if (pp != nullptr) {
        lbq::parallel_for(0, (N + 15) / 16, 1, [&](int64_t g0, int64_t g1) { rows(g0 * 16, std::min(N, g1 * 16)); });
      } else {
        lbq::parallel_for(0, N, std::max<int64_t>(16, (int64_t{1} << 16) / K), rows);
      }
    }
  }
  if (bias.has_value() && M > 0) y += bias->unsqueeze(0);
  return y;
}

// Checks ggml blocks [N, row_bytes] of `type` for K values a row; returns the type's values and
// bytes per block.
struct BlockShape {
  int64_t qk, size;
};
BlockShape check_blocks(const torch::Tensor& blocks, int64_t type, int64_t K) {
  int qk = 0, size = 0;
  TORCH_CHECK(lbq::ggml::block_shape(static_cast<int>(type), &qk, &size), "unsupported ggml type id ", type);
  TORCH_CHECK(
      blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte && blocks.device().is_cpu(),
      "blocks must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(K >= 0 && K % qk == 0, "K=", K, " is not a multiple of the block size ", qk);
  TORCH_CHECK(blocks.size(1) == K / qk * size, "blocks must be [N, ", K / qk * size, "] for K=", K);
  return {qk, size};
}

// The repacked layout of ggml blocks [N, row_bytes] for the batch GEMM, or None where this
// build or type has none.
py::object ggml_pack(const torch::Tensor& blocks, int64_t type, int64_t K) {
  check_blocks(blocks, type, K);
  const int64_t N = blocks.size(0);
  const int64_t bytes = lbq::ggml::packed_bytes(static_cast<int>(type), N, K);
  if (bytes == 0 || N == 0) return py::none();
  auto out = torch::empty({bytes}, torch::kUInt8);
  {
    py::gil_scoped_release nogil;
    lbq::ggml::pack(static_cast<int>(type), blocks.data_ptr<uint8_t>(), blocks.size(1), N, K, out.data_ptr<uint8_t>());
  }
  return py::cast(out);
}

// W [N, K] fp32 from ggml blocks (the prefill path: blockwise dequantize + GEMM).
torch::Tensor ggml_dequantize(const torch::Tensor& blocks, int64_t type, int64_t K) {
  const BlockShape shape = check_blocks(blocks, type, K);
  const int64_t qk = shape.qk, size = shape.size;
  const int64_t N = blocks.size(0), nb = K / qk;
  auto w = torch::empty({N, K}, torch::dtype(torch::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  const int t = static_cast<int>(type);
  lbq::parallel_for(0, N * nb, 256, [&](int64_t b0, int64_t b1) {
    alignas(32) int8_t q[256];
    float a[16], b[16];
    for (int64_t blk = b0; blk < b1; ++blk) {
      lbq::ggml::decode_block(t, false, bp + blk * size, q, a, b);
      float* out = wp + blk * qk;  // rows are whole blocks, so block blk starts at blk * qk
      for (int i = 0; i < qk; ++i) out[i] = a[i / 16] * static_cast<float>(q[i]) + b[i / 16];
    }
  });
  return w;
}

std::string isa() {
  return lbq::isa_name();
}

// Test hook: how many distinct threads ran the parts of one n-item job on the kernels' pool
// (items of one row each: as many threads as the thread count allows).
int64_t pool_threads(int64_t n) {
  std::vector<std::thread::id> who(static_cast<size_t>(std::max<int64_t>(n, 0)));
  {
    py::gil_scoped_release nogil;
    lbq::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) who[static_cast<size_t>(i)] = std::this_thread::get_id();
    });
  }
  std::sort(who.begin(), who.end());
  return static_cast<int64_t>(std::unique(who.begin(), who.end()) - who.begin());
}

}  // namespace

void init_decode(pybind11::module_& m);  // decode.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y[M,N] = x[M,K] @ dequant(W)^T (+ bias) for Q8/Q4 packed weights", py::arg("x"),
        py::arg("qweight"), py::arg("scales"), py::arg("bits"), py::arg("group"), py::arg("bias") = py::none());
  m.def("ggml_gemv", &ggml_gemv, "y[M,N] = x[M,K] @ dequant(W)^T (+ bias) for ggml blocks (Q4_1..Q6_K)", py::arg("x"),
        py::arg("blocks"), py::arg("type"), py::arg("bias") = py::none(), py::arg("packed") = py::none(),
        py::arg("chunk") = 0);
  m.def(
      "ggml_packed_bytes",
      [](int64_t type, int64_t N, int64_t K) { return lbq::ggml::packed_bytes(static_cast<int>(type), N, K); },
      "bytes of ggml_pack's layout for an [N, K] weight of this type (0: none)", py::arg("type"), py::arg("N"),
      py::arg("K"));
  m.def("ggml_pack", &ggml_pack, "the repacked layout of ggml blocks for batches, or None where there is none",
        py::arg("blocks"), py::arg("type"), py::arg("K"));
  m.def("ggml_dequantize", &ggml_dequantize, "W[N,K] fp32 from ggml blocks", py::arg("blocks"), py::arg("type"),
        py::arg("K"));
  m.def("isa", &isa, "SIMD path compiled in");
  m.def("pool_threads", &pool_threads, "test hook: distinct threads that ran an n-item job on the kernels' pool",
        py::arg("n"));
  m.def(
      "set_serial",
      [](bool on) {
        const bool was = lbq::serial();
        lbq::serial() = on;
        return was;
      },
      "this thread's kernels run on it alone (True) or on the pool; returns the previous setting", py::arg("on"));
  init_decode(m);
}
