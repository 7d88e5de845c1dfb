// bf16 GEMM for the token2wav estimator's layers on AMX CPUs: y = x @ W^T + bias, with the epilogue fused.
//
// Why not torch's prepacked oneDNN GEMM: at the estimator's shapes (a few hundred rows, K and N 256-1536) one
// oneDNN call spends about as long outside its kernel (descriptor and argument set-up, a fresh scratchpad) as in
// it, more when layers of different shapes alternate, as they do in every transformer block. Here the tile
// kernel is oneDNN's own (torch's `cpublas::brgemm`, which caches one kernel per shape): what remains per call is
// a loop over tiles and the epilogue, written once into the output.
//
// Weights (packed once in Python, see bf16_gemm.py): N padded with zeros to panels of 64 output channels, each
// panel in the kernel's VNNI layout w[panel][k / 2][64][2] = W[panel * 64 + c][k] (pairs of consecutive k).
// Tiles: 32 rows x one panel, accumulated in fp32 (K whole in one kernel call), ordered panel-major so each
// thread streams its share of the panels once while the rows stay in its cache.
// Epilogues: + bias (fp32), then one of: round to bf16 (RNE, as torch's cast; values are finite here), GELU
// (exact erf form, erf to ~2e-7) then bf16, added in place to an fp32 residual stream, or stored fp32 (the last
// two never round y).
// K must be even (VNNI pairs); callers fall back to torch otherwise.

#include <ATen/native/CPUBlas.h>

namespace bf16gemm {

using vecmath::first;
using vecmath::to_bf16;

constexpr int64_t kPanelN = 64;  // output channels per panel: the widest B block the tile kernel takes
constexpr int64_t kTileM = 32;   // rows per tile (two AMX row tiles)

enum Epilogue : int64_t { kBf16 = 0, kGeluBf16 = 1, kAddF32 = 2, kF32 = 3 };

// 0.5 x (1 + erf(x / sqrt 2)); erf(|z|) = 1 - t (a1 + t (a2 + ... a5)) exp(-z^2), t = 1 / (1 + p |z|)
// (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7), the sign restored after.
inline __m512 gelu(__m512 x) {
  __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  __m512 az = _mm512_abs_ps(z);
  // t = 1 / d: the 14-bit reciprocal estimate and one Newton step (~1e-8 relative), cheaper than a division
  const __m512 d = _mm512_fmadd_ps(az, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f));
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
  __m512 q = _mm512_set1_ps(1.061405429f);
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-1.453152027f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(1.421413741f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(-0.284496736f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.254829592f));
  q = _mm512_mul_ps(q, t);
  __m512 erf_abs = _mm512_fnmadd_ps(q, vecmath::exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), az), az)),
                                    _mm512_set1_ps(1.0f));
  __m512 erf = _mm512_mask_sub_ps(erf_abs, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ),
                                  _mm512_setzero_ps(), erf_abs);
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(erf, _mm512_set1_ps(1.0f)));
}

// W (N, K) bf16 -> packed (P, K / 2, 64, 2) bf16, P = ceil(N / 64), channels past N zero
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: weight must be 2-D bf16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "pack: K must be even, got ", k);
  const int64_t panels = (n + kPanelN - 1) / kPanelN;
  auto wt = torch::zeros({k, panels * kPanelN}, w.options());  // (K, N padded), row-major: the packer's input
  wt.narrow(1, 0, n).copy_(w.t());
  auto out = torch::empty({panels, k / 2, kPanelN, 2}, w.options());
  const auto* src = wt.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  for (int64_t p = 0; p < panels; ++p)
    at::native::cpublas::pack(k, kPanelN, panels * kPanelN, kPanelN, at::kBFloat16, at::kBFloat16,
                              src + p * kPanelN, dst + p * kPanelN * k);
  return out;
}

// One finished tile: acc (rows, 64) fp32 + bias -> out at `at` (element offset of the tile's first value),
// row stride `ld`, `cols` valid columns, in the epilogue's form.
inline void finish_tile(const float* acc, int64_t rows, int64_t cols, const float* bias, int64_t epilogue, void* out,
                        int64_t at, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mask = first(cols - c);
      __m512 v = _mm512_load_ps(acc + r * kPanelN + c);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
      const int64_t i = at + r * ld + c;
      if (epilogue == kAddF32) {
        float* o = static_cast<float*>(out) + i;
        _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o)));
      } else if (epilogue == kF32) {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + i, mask, v);
      } else {
        if (epilogue == kGeluBf16) v = gelu(v);
        _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(out) + i, mask, to_bf16(v));
      }
    }
  }
}

// The tiles of `groups` independent row groups (g: `rows` rows at a + g * group_stride, row stride lda, K long)
// times every panel, over the thread pool, panel-major; each group's output rows follow the previous group's.
void run_tiles(const at::BFloat16* a, int64_t groups, int64_t group_stride, int64_t rows, int64_t lda, int64_t k,
               const at::BFloat16* w, int64_t panels, int64_t n, const float* bias, int64_t epilogue, void* out) {
  const int64_t row_tiles = (rows + kTileM - 1) / kTileM, per_panel = groups * row_tiles;
  at::parallel_for(0, panels * per_panel, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kTileM * kPanelN];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / per_panel, g = (i % per_panel) / row_tiles, m0 = (i % row_tiles) * kTileM;
      const int64_t m = std::min(kTileM, rows - m0), n0 = p * kPanelN;
      at::native::cpublas::brgemm(m, kPanelN, k, lda, kPanelN, kPanelN, false, a + g * group_stride + m0 * lda,
                                  w + p * kPanelN * k, acc, true);
      finish_tile(acc, m, std::min(kPanelN, n - n0), bias ? bias + n0 : nullptr, epilogue, out,
                  (g * rows + m0) * n + n0, n);
    }
    at::native::cpublas::brgemm_release();
  });
}

// x (M, K) bf16 contiguous; packed from `pack` (n true output channels); bias (n,) fp32 or empty.
// kBf16 / kGeluBf16: returns y (M, n) bf16. kAddF32: residual (M, n) fp32 contiguous += x W^T + bias; returns it.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, const torch::Tensor& bias,
                     int64_t epilogue, torch::Tensor residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: x must be (M, K) bf16");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k && panels * kPanelN >= n, "linear: packed weight does not match x");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == at::kFloat), "linear: bad bias");
  torch::Tensor y;
  if (epilogue == kAddF32) {
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.numel() == m * n,
                "linear: residual must be (M, N) fp32 contiguous");
    y = residual;
  } else {
    y = torch::empty({m, n}, x.options());
  }
  run_tiles(x.data_ptr<at::BFloat16>(), 1, 0, m, k, k, packed.data_ptr<at::BFloat16>(), panels, n,
            bias.numel() ? bias.data_ptr<float>() : nullptr, epilogue, y.data_ptr());
  return y;
}

// Causal conv of `taps` taps as one GEMM, no im2col: x (B, C, n) fp32 laid out time-major (stride(1) == 1),
// left (B, C, taps - 1) fp32 (the context before x, any strides). Both are rounded to bf16 into one time-major
// buffer (B, taps - 1 + n, C); output row t's K = taps * C inputs are then the buffer's rows t .. t + taps - 1,
// which lie side by side: the kernel reads them in place (row stride C, K = taps * C). The weight is packed from
// (C_out, taps * C) with tap j's channels at [j * C, (j + 1) * C). Returns y (B, n, C_out) fp32 (+ bias).
torch::Tensor conv(const torch::Tensor& x, const torch::Tensor& left, const torch::Tensor& packed, int64_t n_out,
                   const torch::Tensor& bias, int64_t taps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "conv: x must be (B, C, n) fp32, time-major");
  const int64_t b = x.size(0), c = x.size(1), n = x.size(2), ctx = taps - 1, k = taps * c, panels = packed.size(0);
  TORCH_CHECK(left.dim() == 3 && left.scalar_type() == at::kFloat && left.size(0) == b && left.size(1) == c &&
              left.size(2) == ctx, "conv: left context must be (B, C, taps - 1) fp32");
  TORCH_CHECK(packed.size(1) * 2 == k && panels * kPanelN >= n_out, "conv: packed weight does not match x");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n_out && bias.scalar_type() == at::kFloat), "conv: bad bias");
  const int64_t len = ctx + n;
  auto buf = torch::empty({b, len, c}, x.options().dtype(at::kBFloat16));
  auto* bp = buf.data_ptr<at::BFloat16>();
  const float* xp = x.data_ptr<float>();
  const float* lp = left.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t t = 0; t < ctx; ++t)
      for (int64_t j = 0; j < c; ++j)
        bp[(i * len + t) * c + j] = at::BFloat16(lp[i * left.stride(0) + j * left.stride(1) + t * left.stride(2)]);
    for (int64_t t = 0; t < n; ++t) {
      const float* row = xp + i * x.stride(0) + t * x.stride(2);
      at::BFloat16* dst = bp + (i * len + ctx + t) * c;
      for (int64_t j = 0; j < c; j += 16) {
        const __mmask16 mask = first(c - j);
        _mm256_mask_storeu_epi16(dst + j, mask, to_bf16(_mm512_maskz_loadu_ps(mask, row + j)));
      }
    }
  }
  auto y = torch::empty({b, n, n_out}, x.options());
  run_tiles(bp, b, len * c, n, c, k, packed.data_ptr<at::BFloat16>(), panels, n_out,
            bias.numel() ? bias.data_ptr<float>() : nullptr, kF32, y.data_ptr());
  return y;
}

bool usable() { return at::native::cpublas::could_pack(at::kBFloat16); }

void bind(pybind11::module& m) {
  m.def("bf16_pack", &pack, "W (N, K) bf16 -> panels for bf16_linear");
  m.def("bf16_linear", &linear, "x @ W^T + bias with a fused epilogue (bf16 out, GELU + bf16 out, or += fp32)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_conv", &conv, "causal conv as one GEMM over a time-major bf16 copy of its input",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_usable", &usable, "whether the bf16 tile kernel runs here (AMX)");
}

}  // namespace bf16gemm
