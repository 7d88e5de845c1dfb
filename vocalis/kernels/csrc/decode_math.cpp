// The vector pieces of the fused decode step (int8_decode.cpp), AVX-512: RMSNorm of a row, an int8 panel's
// scale-out, the dense (fp32 / bf16) panel GEMV, bf16 rounding of input rows, and attention's and SiLU's loops.
// decode_math_avx2.cpp defines the same functions for AVX2 + FMA; int8_decode.cpp and decode_{weights,operands}.cpp
// hold what is not ISA-bound.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace decodemath {

using vecmath::exp_ps;

// y = x * rsqrt(mean(x^2) + eps) * w over one row of d (multiple of 16 or not)
inline void rms_norm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = _mm512_reduce_add_ps(acc);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (i = 0; i + 16 <= d; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)),
                                          _mm512_loadu_ps(w + i)));
  for (; i < d; ++i) y[i] = x[i] * inv * w[i];
}

// v (M, 64) = (acc - corr) * sx * sw (+ bias) for one panel: acc (M, 64) int32 sums, corr / scale / bias the
// panel's 64 channels (bias may be null)
inline void dequant_panel(const int32_t* acc, const int32_t* corr, const float* scale, const float* bias,
                          int m_rows, const float* sx, float* v) {
  for (int m = 0; m < m_rows; ++m)
    for (int j = 0; j < 4; ++j) {
      const __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(acc + m * 64 + j * 16),
                                         _mm512_loadu_si512(corr + j * 16));
      __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(a),
                               _mm512_mul_ps(_mm512_set1_ps(sx[m]), _mm512_loadu_ps(scale + j * 16)));
      if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + j * 16));
      _mm512_storeu_ps(v + m * 64 + j * 16, y);
    }
}

#ifndef VOCALIS_F32_PREFETCH
#define VOCALIS_F32_PREFETCH 8192  // bytes ahead (the int8 kernel's distance)
#endif

// 16 weights as fp32 (bf16: the 16 bits are the top half of an fp32)
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}
inline __m512 load16(__mmask16 t, const float* w) { return _mm512_maskz_loadu_ps(t, w); }
inline __m512 load16(__mmask16 t, const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(t, w)), 16));
}

// out[m * 64] = x[m] . w for one channel row w (K,) and MT rows of x (MT, ldx). The panel is read channel
// after channel, so the weights stream as one sequential run (one prefetch stream per thread, as the int8
// kernel's); each weight vector is loaded once and used by every row; 4 accumulators per row break the FMA
// latency chain; the K % 16 tail is masked.
template <typename W, int MT>
inline void dense_row(const W* w, int64_t k, const float* x, int64_t ldx, float* out) {
  constexpr int64_t ahead = VOCALIS_F32_PREFETCH / sizeof(W);
  __m512 a[MT][4];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) a[m][u] = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 64 <= k; e += 64) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + e + u * 16 + ahead), _MM_HINT_T0);
      const __m512 b = load16(w + e + u * 16);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) a[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + e + u * 16), b, a[m][u]);
    }
  }
  for (; e + 16 <= k; e += 16) {
    const __m512 b = load16(w + e);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + e), b, a[m][0]);
  }
  if (e < k) {
    const __mmask16 t = static_cast<__mmask16>((1u << (k - e)) - 1);
    const __m512 b = load16(t, w + e);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) a[m][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(t, x + m * ldx + e), b, a[m][1]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
    out[m * 64] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3])));
}

// out (M, K) = rows (M, K) rounded to bf16 (kept as fp32), as CastLinear rounds its input
inline void round_rows_bf16(const float* rows, int m_rows, int64_t k, float* out) {
  for (int m = 0; m < m_rows; ++m)
    for (int64_t e = 0; e < k; e += 16) {
      const __mmask16 t = vecmath::first(k - e);
      const __m256i b = vecmath::to_bf16(_mm512_maskz_loadu_ps(t, rows + m * k + e));
      _mm512_mask_storeu_ps(out + m * k + e, t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
}

// a . b over n (a multiple of 16) values
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < n; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
  return _mm512_reduce_add_ps(acc);
}

// s[i] = e^(s[i] - mx) for i < c (softmax numerators in place); returns their sum
inline float exp_shifted(float* s, int64_t c, float mx) {
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= c; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < c) {
    const __mmask16 k = static_cast<__mmask16>((1u << (c - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vmx));
    _mm512_mask_storeu_ps(s + i, k, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(vsum);
}

// y += p * x over n (a multiple of 16) values
inline void axpy(float p, const float* x, float* y, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t e = 0; e < n; e += 16)
    _mm512_storeu_ps(y + e, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + e), _mm512_loadu_ps(y + e)));
}

// out = SiLU(g) * u over n (a multiple of 16) values
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(silu, _mm512_loadu_ps(u + j)));
  }
}

}  // namespace decodemath
