// A conv block's LayerNorm over channels followed by Mish, in one pass, for the token2wav estimator's torch path
// (CPUs without the bf16 block kernels). AVX2 + FMA code, in both source sets.
//
// Why: at the estimator's sizes (a first chunk: 2 x 100 frames of 256 channels) torch runs this as four passes
// (LayerNorm, softplus, tanh, product) of a few tens of microseconds each, a visible share of a step once the GEMMs
// run in int8. Here each value is read three times from L1 and written once.
//
// Math: LayerNorm with the mean and the variance of each frame's channels in two passes, eps inside the square
// root, then the affine; Mish(y) = y * tanh(softplus(y)) = y * m / (m + 2), m = e^y (e^y + 2), and y itself past
// 20 (where softplus is y and tanh 1 in fp32).

namespace fp32pw {

inline __m256 mish(__m256 y) {
  const __m256 e = vecmath::exp_ps(_mm256_min_ps(y, _mm256_set1_ps(20.f)));
  const __m256 m = _mm256_mul_ps(e, _mm256_add_ps(e, _mm256_set1_ps(2.f)));
  const __m256 r = _mm256_div_ps(m, _mm256_add_ps(m, _mm256_set1_ps(2.f)));
  const __m256 big = _mm256_cmp_ps(y, _mm256_set1_ps(20.f), _CMP_GT_OQ);
  return _mm256_mul_ps(y, _mm256_blendv_ps(r, _mm256_set1_ps(1.f), big));
}

// lanes [0, n) of 8 set, for the masked loads and stores of a tail
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Frames with their C channels contiguous (time-major), `rows` of them from x to out.
void norm_mish_rows(const float* x, float* out, int64_t rows, int64_t C, const float* w, const float* b,
                    float eps) {
  const int64_t full = C / 8 * 8;
  const __m256i m = tail_mask(C - full);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * C;
    float* o = out + r * C;
    __m256 s = _mm256_setzero_ps();
    for (int64_t c = 0; c < full; c += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + c));
    if (full < C) s = _mm256_add_ps(s, _mm256_maskload_ps(xr + full, m));
    const __m256 mean = _mm256_set1_ps(vecmath::hsum(s) / C);
    __m256 q = _mm256_setzero_ps();
    for (int64_t c = 0; c < full; c += 8) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + c), mean);
      q = _mm256_fmadd_ps(d, d, q);
    }
    if (full < C) {
      const __m256 d = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + full, m), mean), _mm256_castsi256_ps(m));
      q = _mm256_fmadd_ps(d, d, q);
    }
    const __m256 rstd = _mm256_set1_ps(1.f / std::sqrt(vecmath::hsum(q) / C + eps));
    for (int64_t c = 0; c < full; c += 8) {
      const __m256 n = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + c), mean), rstd);
      _mm256_storeu_ps(o + c, mish(_mm256_fmadd_ps(n, _mm256_loadu_ps(w + c), _mm256_loadu_ps(b + c))));
    }
    if (full < C) {
      const __m256 n = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + full, m), mean), rstd);
      _mm256_maskstore_ps(o + full, m, mish(_mm256_fmadd_ps(n, _mm256_maskload_ps(w + full, m),
                                                            _mm256_maskload_ps(b + full, m))));
    }
  }
}

// Frames t0 .. t0 + n (n <= 8) of one (C, T) channel-major batch row: 8 frames per vector, channels T apart.
void norm_mish_columns(const float* x, float* out, int64_t C, int64_t T, int64_t n, const float* w, const float* b,
                       float eps) {
  const __m256i m = tail_mask(n);
  const __m256 inv_c = _mm256_set1_ps(1.f / C);
  __m256 s = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) s = _mm256_add_ps(s, _mm256_maskload_ps(x + c * T, m));
  const __m256 mean = _mm256_mul_ps(s, inv_c);
  __m256 q = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const __m256 d = _mm256_sub_ps(_mm256_maskload_ps(x + c * T, m), mean);
    q = _mm256_fmadd_ps(d, d, q);
  }
  const __m256 rstd = _mm256_div_ps(_mm256_set1_ps(1.f),
                                    _mm256_sqrt_ps(_mm256_fmadd_ps(q, inv_c, _mm256_set1_ps(eps))));
  for (int64_t c = 0; c < C; ++c) {
    const __m256 n8 = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(x + c * T, m), mean), rstd);
    _mm256_maskstore_ps(out + c * T, m, mish(_mm256_fmadd_ps(n8, _mm256_set1_ps(w[c]), _mm256_set1_ps(b[c]))));
  }
}

// x (B, C, T) fp32, stored channel-major (contiguous) or time-major (its transpose(1, 2) contiguous): LayerNorm over
// C of every frame (weight, bias (C,), eps), then Mish -> a new tensor of x's shape and layout.
torch::Tensor norm_mish(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "norm_mish: x (B, C, T) fp32");
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat && weight.is_contiguous() &&
              bias.is_contiguous() && weight.numel() == C && bias.numel() == C, "norm_mish: weight, bias (C,) fp32");
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (x.transpose(1, 2).is_contiguous()) {
    torch::Tensor out = torch::empty({B, T, C}, x.options());
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
      norm_mish_rows(xp + begin * C, op + begin * C, end - begin, C, w, b, e);
    });
    return out.transpose(1, 2);
  }
  TORCH_CHECK(x.is_contiguous(), "norm_mish: x must be stored channel-major or time-major");
  torch::Tensor out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = (T + 7) / 8;
  at::parallel_for(0, B * tiles, 2, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / tiles, t0 = i % tiles * 8;
      norm_mish_columns(xp + r * C * T + t0, op + r * C * T + t0, C, T, std::min<int64_t>(8, T - t0), w, b, e);
    }
  });
  return out;
}

void bind(pybind11::module& m) {
  m.def("fp32_norm_mish", &norm_mish, "LayerNorm over the channels of (B, C, T) then Mish, in x's layout",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace fp32pw
