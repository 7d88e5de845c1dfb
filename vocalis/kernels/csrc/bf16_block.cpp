// One transformer block of the token2wav estimator in a single native call (AMX CPUs, bf16 compute):
//   x += out_proj(attention(LN1(x)));  x += ff2(GELU(ff1(LN3(x))))
// on the engine's incremental path: the new frames' queries attend over cached keys/values (a voice prefix, the
// request's own earlier frames) and their own, under per-query key limits; the new keys/values come back for
// the caches.
//
// Why: op by op, a block is ~20 Python-level tensor ops (norms, casts, views, copies of keys/values into one
// buffer, GEMMs, attention, adds); at a first chunk's size (200 rows) their dispatch and the second thread's
// waits between them cost about as much as the arithmetic. Here the same steps run back to back: the norms write
// bf16 GEMM inputs directly, the GEMMs (bf16_gemm.cpp) add into the fp32 residual stream in place, attention
// (bf16_attention.cpp) reads the cached keys where they lie.
//
// Math, as the op-by-op bf16 path: LayerNorm in fp32 (biased variance), rounded to bf16 for the GEMMs; q/k/v in
// bf16; attention as bf16_attention.cpp; the output projection and the second FF GEMM added to x in fp32 with
// their fp32 biases; the FF hidden bf16 after an exact-erf GELU.

#include <cstring>
#include <tuple>

namespace bf16block {

// LayerNorm of rows x (rows, D) fp32 -> out (rows, D) bf16, over the thread pool.
void layer_norm_bf16(const float* x, int64_t rows, int64_t d, const float* w, const float* b, float eps,
                     at::BFloat16* out) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * d;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(vecmath::first(d - j), row + j));
      const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(d);
      const __m512 vmean = _mm512_set1_ps(mean);
      __m512 sq = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 m = vecmath::first(d - j);
        const __m512 c = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, row + j), vmean);
        sq = _mm512_fmadd_ps(c, c, sq);
      }
      const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(d) + eps);
      const __m512 vrstd = _mm512_set1_ps(rstd);
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 m = vecmath::first(d - j);
        __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), vmean), vrstd);
        y = _mm512_fmadd_ps(y, _mm512_maskz_loadu_ps(m, w + j), _mm512_maskz_loadu_ps(m, b + j));
        _mm256_mask_storeu_epi16(out + r * d + j, m, vecmath::to_bf16(y));
      }
    }
  });
}

const float* f32(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "block: ", what,
              " must be fp32 contiguous with ", n, " values");
  return t.data_ptr<float>();
}

// a layer's bias: null where it has none (an empty tensor), as bf16_gemm's tiles take it
const float* bias_of(const torch::Tensor& t, int64_t n, const char* what) {
  return t.numel() == 0 ? nullptr : f32(t, n, what);
}

// x (B, n, D) fp32 contiguous, updated in place. Weights packed by bf16_gemm.pack: qkv (3 H E out, D in; no
// bias), out (D, H E), ff1 (F, D), ff2 (D, F); their biases fp32, or empty where a layer has none. cached_k/cached_v: the keys/values before the new frames, pieces
// (B or a divisor of B, H, L_i, E) in order (bf16_attention.cpp's segments), maybe none. limits: int32 (1 or B,
// n) keys visible per new frame, counting cached then new keys, or empty (all).
// Returns the new frames' keys and values, (B, H, n, E) bf16 each.
std::vector<torch::Tensor> block(torch::Tensor x, const torch::Tensor& ln1_w, const torch::Tensor& ln1_b, double eps1,
                                 const torch::Tensor& qkv, int64_t heads, int64_t head_dim, const torch::Tensor& out,
                                 const torch::Tensor& out_bias, const torch::Tensor& ln3_w, const torch::Tensor& ln3_b,
                                 double eps3, const torch::Tensor& ff1, const torch::Tensor& ff1_bias, int64_t inner,
                                 const torch::Tensor& ff2, const torch::Tensor& ff2_bias,
                                 const std::vector<torch::Tensor>& cached_k, const std::vector<torch::Tensor>& cached_v,
                                 const torch::Tensor& limits) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(), "block: x must be (B, n, D) fp32");
  const int64_t B = x.size(0), n = x.size(1), D = x.size(2), H = heads, E = head_dim, HE = H * E, rows = B * n;
  TORCH_CHECK(E % 2 == 0 && E <= 64 && D % 2 == 0 && inner % 2 == 0, "block: unsupported sizes");
  TORCH_CHECK(qkv.size(1) * 2 == D && qkv.size(0) * bf16gemm::kPanelN >= 3 * HE && out.size(1) * 2 == HE &&
              ff1.size(1) * 2 == D && ff2.size(1) * 2 == inner, "block: packed weights do not match the sizes");
  TORCH_CHECK(cached_k.size() == cached_v.size(), "block: one cached value tensor per cached key tensor");
  const auto bf16 = x.options().dtype(at::kBFloat16);
  float* xp = x.data_ptr<float>();
  auto a = torch::empty({rows, std::max(D, HE)}, bf16);  // the GEMMs' input rows, reused
  auto* ap = a.data_ptr<at::BFloat16>();
  auto proj = torch::empty({rows, 3 * HE}, bf16);  // (B, n, 3, H, E)
  auto* pp = proj.data_ptr<at::BFloat16>();
  auto k_new = torch::empty({B, H, n, E}, bf16), v_new = torch::empty({B, H, n, E}, bf16);

  layer_norm_bf16(xp, rows, D, f32(ln1_w, D, "norm1 weight"), f32(ln1_b, D, "norm1 bias"), static_cast<float>(eps1), ap);
  bf16gemm::run_tiles(ap, 1, 0, rows, D, D, qkv.data_ptr<at::BFloat16>(), qkv.size(0), 3 * HE, nullptr,
                      bf16gemm::kBf16, pp);
  // the new keys/values in the cache layout (B, H, n, E); attention reads them from there too
  auto* kn = k_new.data_ptr<at::BFloat16>();
  auto* vn = v_new.data_ptr<at::BFloat16>();
  at::parallel_for(0, B * H, 4, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t i = 0; i < n; ++i) {
        const at::BFloat16* src = pp + (b * n + i) * 3 * HE + h * E;
        std::memcpy(kn + (bh * n + i) * E, src + HE, E * sizeof(at::BFloat16));
        std::memcpy(vn + (bh * n + i) * E, src + 2 * HE, E * sizeof(at::BFloat16));
      }
    }
  });
  bf16attn::Problem pr{pp, n * 3 * HE, E, 3 * HE, {}, nullptr, 0, ap, n * HE, E, HE, nullptr, B, H, n, E, 0,
                       static_cast<float>(1.0 / std::sqrt(static_cast<double>(E)))};
  for (size_t i = 0; i < cached_k.size(); ++i) {
    bf16attn::Segment sg = bf16attn::segment_of(cached_k[i], cached_v[i]);
    TORCH_CHECK(B % sg.batches == 0 && cached_k[i].size(1) == H && cached_k[i].size(3) == E, "block: cached keys");
    pr.segments.push_back(sg);
    pr.L += sg.len;
  }
  pr.segments.push_back(bf16attn::segment_of(k_new, v_new));
  pr.L += n;
  std::tie(pr.limits, pr.lim_row) = bf16attn::limits_of(limits, B, n);
  bf16attn::run(pr, false);  // -> a (B, n, H, E) = (rows, H E) (AMX: the tile kernel)
  bf16gemm::run_tiles(ap, 1, 0, rows, HE, HE, out.data_ptr<at::BFloat16>(), out.size(0), D,
                      bias_of(out_bias, D, "output projection bias"), bf16gemm::kAddF32, xp);
  layer_norm_bf16(xp, rows, D, f32(ln3_w, D, "norm3 weight"), f32(ln3_b, D, "norm3 bias"), static_cast<float>(eps3), ap);
  auto hidden = torch::empty({rows, inner}, bf16);
  bf16gemm::run_tiles(ap, 1, 0, rows, D, D, ff1.data_ptr<at::BFloat16>(), ff1.size(0), inner,
                      bias_of(ff1_bias, inner, "ff1 bias"), bf16gemm::kGeluBf16, hidden.data_ptr());
  bf16gemm::run_tiles(hidden.data_ptr<at::BFloat16>(), 1, 0, rows, inner, inner, ff2.data_ptr<at::BFloat16>(),
                      ff2.size(0), D, bias_of(ff2_bias, D, "ff2 bias"), bf16gemm::kAddF32, xp);
  return {k_new, v_new};
}

void bind(pybind11::module& m) {
  m.def("bf16_block", &block, "one estimator transformer block, in place on x; returns the new keys and values",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace bf16block
