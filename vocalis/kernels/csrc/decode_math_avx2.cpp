// The vector pieces of the fused decode step (int8_decode.cpp) for AVX2 + FMA: the functions of decode_math.cpp
// (AVX-512) with 8-wide vectors, the same math and the same summation shapes where registers allow.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace decodemath {

using vecmath::exp_ps;
using vecmath::hsum;

// y = x * rsqrt(mean(x^2) + eps) * w over one row of d (multiple of 8 or not)
inline void rms_norm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (i = 0; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)),
                                          _mm256_loadu_ps(w + i)));
  for (; i < d; ++i) y[i] = x[i] * inv * w[i];
}

// v (M, 64) = acc * sx * sw (+ bias) for one panel: acc (M, 64) int32 sums of int8_gemv_avx2.cpp (signed
// activations: no offset, so corr is not used), scale / bias the panel's 64 channels (bias may be null)
inline void dequant_panel(const int32_t* acc, const int32_t* /*corr*/, const float* scale, const float* bias,
                          int m_rows, const float* sx, float* v) {
  for (int m = 0; m < m_rows; ++m)
    for (int j = 0; j < 8; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + m * 64 + j * 8));
      __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(a),
                               _mm256_mul_ps(_mm256_set1_ps(sx[m]), _mm256_loadu_ps(scale + j * 8)));
      if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + j * 8));
      _mm256_storeu_ps(v + m * 64 + j * 8, y);
    }
}

#ifndef VOCALIS_F32_PREFETCH
#define VOCALIS_F32_PREFETCH 8192  // bytes ahead
#endif

// 8 weights as fp32 (bf16: the 16 bits are the top half of an fp32)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}
inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) {
  const uint32_t u = static_cast<uint32_t>(w) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// out[m * 64] = x[m] . w for one channel row w (K,) and MT rows of x (MT, ldx), read as decode_math.cpp's: the
// panel channel after channel (one sequential stream), each weight vector loaded once for every row; 2
// accumulators per row (MT <= 4 rows: 8 accumulators + 2 weight vectors of the 16 registers); the K % 16 tail
// in 8s, then scalar.
template <typename W, int MT>
inline void dense_row(const W* w, int64_t k, const float* x, int64_t ldx, float* out) {
  constexpr int64_t ahead = VOCALIS_F32_PREFETCH / sizeof(W);
  __m256 a[MT][2];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= k; e += 16) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + e + ahead), _MM_HINT_T0);
    const __m256 b0 = load8(w + e), b1 = load8(w + e + 8);
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + e), b0, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + e + 8), b1, a[m][1]);
    }
  }
  for (; e + 8 <= k; e += 8) {
    const __m256 b = load8(w + e);
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + e), b, a[m][0]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    float s = hsum(_mm256_add_ps(a[m][0], a[m][1]));
    for (int64_t t = e; t < k; ++t) s += x[m * ldx + t] * to_float(w[t]);
    out[m * 64] = s;
  }
}

// out (M, K) = rows (M, K) rounded to bf16 (kept as fp32), as CastLinear rounds its input
inline void round_rows_bf16(const float* rows, int m_rows, int64_t k, float* out) {
  for (int m = 0; m < m_rows; ++m) {
    int64_t e = 0;
    for (; e + 8 <= k; e += 8)
      _mm256_storeu_ps(out + m * k + e, vecmath::round_bf16(_mm256_loadu_ps(rows + m * k + e)));
    if (e < k) {
      alignas(32) float tmp[8] = {};
      std::copy(rows + m * k + e, rows + m * k + k, tmp);
      _mm256_store_ps(tmp, vecmath::round_bf16(_mm256_load_ps(tmp)));
      std::copy(tmp, tmp + (k - e), out + m * k + e);
    }
  }
}

// a . b over n (a multiple of 16) values
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t e = 0; e < n; e += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), _mm256_loadu_ps(b + e + 8), acc1);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

// s[i] = e^(s[i] - mx) for i < c (softmax numerators in place); returns their sum
inline float exp_shifted(float* s, int64_t c, float mx) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  if (i < c) {  // the tail through the same polynomial (AVX2 has no masked loads of floats this cheap)
    alignas(32) float tmp[8] = {};
    for (int64_t t = 0; i + t < c; ++t) tmp[t] = s[i + t] - mx;
    _mm256_store_ps(tmp, exp_ps(_mm256_load_ps(tmp)));
    for (int64_t t = 0; i + t < c; ++t) {
      s[i + t] = tmp[t];
      sum += tmp[t];
    }
  }
  return sum;
}

// y += p * x over n (a multiple of 16) values
inline void axpy(float p, const float* x, float* y, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t e = 0; e < n; e += 8)
    _mm256_storeu_ps(y + e, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + e), _mm256_loadu_ps(y + e)));
}

// out = SiLU(g) * u over n (a multiple of 16) values
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
  }
}

}  // namespace decodemath
