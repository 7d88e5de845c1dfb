// Int8 GEMM for a few rows (LLM decode): y = dequant(quant_u8(x) . w_s8) + bias, with AVX-512 VNNI.
//
// Weights (packed once in Python, see int8_gemv.py): symmetric per-output-channel int8, laid out in panels of
// 64 output channels: w[panel][k4][lane4][16][4] = W[panel*64 + lane4*16 + j][k4*4 + t]  (int8)
// so one panel streams from memory as one contiguous run (one prefetch stream per thread) and each 64-byte
// vector holds 16 channels x 4 consecutive k, the operand shape of VPDPBUSD (u8 x s8, sums of 4 -> s32).
//
// Activations: per row, symmetric int8 with scale amax/127, stored offset by +128 as u8 (VPDPBUSD wants an
// unsigned left operand); the offset's contribution, 128 * sum_k W[n,k], is precomputed per channel (`corr`)
// and subtracted. Accumulation is exact int32 (|acc| <= 255*127*K, < 2^31 for K < 66,000).
// y[m,n] = float(acc[m,n] - corr[n]) * (sx[m] * sw[n]) + bias[n]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPanel = 64;       // output channels per panel (4 vectors of 16)
// tuning knobs, defaults measured best on the 2-core EPYC (prefetch 32 groups = 8 KiB ahead: 5 % over 16)
#ifndef VOCALIS_CHUNK_GROUPS
#define VOCALIS_CHUNK_GROUPS 128
#endif
#ifndef VOCALIS_PREFETCH
#define VOCALIS_PREFETCH 32
#endif
constexpr int kChunkGroups = VOCALIS_CHUNK_GROUPS;  // k4 groups per cache block: 128 * 4 k * 64 ch = 32 KiB
using XQ = uint8_t;  // a quantized activation as the kernel reads it: int8 + 128 (int8_gemv_avx2.cpp: int16)

// Quantize rows of x (M, K) fp32 into u8 (M, Kp) with +128 offset (padding = 128, i.e. zero); scales (M,).
void quantize_rows(const float* x, int64_t m_rows, int64_t k, int64_t kp, uint8_t* xq, float* sx) {
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * k;
    __m512 vmax = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    // all-zero row: any scale gives zeros; 1 keeps the division finite
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = amax > 0.f ? 127.f / amax : 1.f;
    sx[m] = scale;
    uint8_t* out = xq + m * kp;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i v128 = _mm512_set1_epi32(128);
    i = 0;
    for (; i + 16 <= k; i += 16) {
      // cvtps rounds to nearest even (default MXCSR), as torch.round does
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, v128)));
    }
    for (; i < k; ++i) out[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(row[i] * inv)) + 128);
    for (; i < kp; ++i) out[i] = 128;
  }
}

// One panel x MT rows over k4 groups [g0, g1): acc (MT, 64) int32 in and out (kept in registers inside).
template <int MT>
inline void panel_block(const int8_t* w, const uint8_t* xq, int64_t kp, int64_t g0, int64_t g1, int32_t* acc) {
  // every loop over rows and vectors fully unrolled, so GCC keeps a[][] in registers (left as loops, it
  // stored the accumulators to the stack on every k step: 1.5x slower at 16 rows)
  __m512i a[MT][4];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[m][j] = _mm512_loadu_si512(acc + m * kPanel + j * 16);
  const int8_t* wp = w + g0 * (kPanel * 4);
  for (int64_t g = g0; g < g1; ++g, wp += kPanel * 4) {
    if (VOCALIS_PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(wp + VOCALIS_PREFETCH * kPanel * 4), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wp);
    const __m512i w1 = _mm512_loadu_si512(wp + 64);
    const __m512i w2 = _mm512_loadu_si512(wp + 128);
    const __m512i w3 = _mm512_loadu_si512(wp + 192);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * kp + g * 4));
      a[m][0] = _mm512_dpbusd_epi32(a[m][0], xb, w0);
      a[m][1] = _mm512_dpbusd_epi32(a[m][1], xb, w1);
      a[m][2] = _mm512_dpbusd_epi32(a[m][2], xb, w2);
      a[m][3] = _mm512_dpbusd_epi32(a[m][3], xb, w3);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(acc + m * kPanel + j * 16, a[m][j]);
}

#ifndef VOCALIS_PAIR
#define VOCALIS_PAIR 1
#endif
// One row, two panels (a, b) over all k4 groups: acc (2, 64) out.
inline void single_row_pair(const int8_t* wa, const int8_t* wb, const uint8_t* xq, int64_t groups, int32_t* acc) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t g = 0; g < groups; ++g, wa += kPanel * 4, wb += kPanel * 4) {
    if (VOCALIS_PREFETCH) {
      _mm_prefetch(reinterpret_cast<const char*>(wa + VOCALIS_PREFETCH * kPanel * 4), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + VOCALIS_PREFETCH * kPanel * 4), _MM_HINT_T0);
    }
    const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + g * 4));
    a0 = _mm512_dpbusd_epi32(a0, xb, _mm512_loadu_si512(wa));
    a1 = _mm512_dpbusd_epi32(a1, xb, _mm512_loadu_si512(wa + 64));
    a2 = _mm512_dpbusd_epi32(a2, xb, _mm512_loadu_si512(wa + 128));
    a3 = _mm512_dpbusd_epi32(a3, xb, _mm512_loadu_si512(wa + 192));
    b0 = _mm512_dpbusd_epi32(b0, xb, _mm512_loadu_si512(wb));
    b1 = _mm512_dpbusd_epi32(b1, xb, _mm512_loadu_si512(wb + 64));
    b2 = _mm512_dpbusd_epi32(b2, xb, _mm512_loadu_si512(wb + 128));
    b3 = _mm512_dpbusd_epi32(b3, xb, _mm512_loadu_si512(wb + 192));
  }
  _mm512_storeu_si512(acc, a0);
  _mm512_storeu_si512(acc + 16, a1);
  _mm512_storeu_si512(acc + 32, a2);
  _mm512_storeu_si512(acc + 48, a3);
  _mm512_storeu_si512(acc + 64, b0);
  _mm512_storeu_si512(acc + 80, b1);
  _mm512_storeu_si512(acc + 96, b2);
  _mm512_storeu_si512(acc + 112, b3);
}

using BlockFn = void (*)(const int8_t*, const uint8_t*, int64_t, int64_t, int64_t, int32_t*);
// 6 rows x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 registers (measured at 16 rows: tiles of 6
// ran 4-6 % faster than tiles of 4; 64-group cache blocks no better than 128)
constexpr int kMaxTile = 6;
const BlockFn kBlocks[kMaxTile + 1] = {nullptr, panel_block<1>, panel_block<2>, panel_block<3>,
                                       panel_block<4>, panel_block<5>, panel_block<6>};

}  // namespace

// x (M, K) fp32; w int8 (P, K4, 64, 4) packed; scale (P*64,) fp32; corr (P*64,) int32; bias (P*64,) fp32 or
// empty; n real output channels (<= P*64). Returns (M, n) fp32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor corr,
                          torch::Tensor bias, int64_t n, int64_t grain_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be 2-D float32");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kChar && w.size(2) == kPanel && w.size(3) == 4,
              "w must be packed int8 (P, K4, 64, 4)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && corr.is_contiguous(), "packed tensors contiguous");
  x = x.contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), panels = w.size(0), groups = w.size(1), kp = groups * 4;
  TORCH_CHECK(k <= kp && kp - k < 4, "x has ", k, " columns, the weight ", kp);
  TORCH_CHECK(n <= panels * kPanel && scale.numel() == panels * kPanel && corr.numel() == panels * kPanel,
              "scale/corr size");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.is_contiguous() && bias.scalar_type() == torch::kFloat &&
                            bias.numel() == panels * kPanel), "bias size");
  auto y = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return y;

  std::vector<uint8_t> xq(m_rows * kp);
  std::vector<float> sx(m_rows);
  quantize_rows(x.data_ptr<float>(), m_rows, k, kp, xq.data(), sx.data());

  const int8_t* wd = w.data_ptr<int8_t>();
  const float* sd = scale.data_ptr<float>();
  const int32_t* cd = corr.data_ptr<int32_t>();
  const float* bd = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const uint8_t* xqd = xq.data();
  const float* sxd = sx.data();

  const int64_t panel_bytes = groups * kPanel * 4;
  const int64_t grain = std::max<int64_t>(1, (grain_bytes + panel_bytes - 1) / panel_bytes);
  // y for panel p from its int32 sums acc (M, 64)
  auto finish = [&](int64_t p, const int32_t* acc) {
    const int64_t c0 = p * kPanel;
    for (int64_t m = 0; m < m_rows; ++m) {
      const __m512 vsx = _mm512_set1_ps(sxd[m]);
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + j * 16;
        if (c >= n) break;
        const __mmask16 mask = c + 16 <= n ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (n - c)) - 1);
        const __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(acc + m * kPanel + j * 16),
                                           _mm512_loadu_si512(cd + c));
        const __m512 s = _mm512_mul_ps(vsx, _mm512_loadu_ps(sd + c));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), s);
        if (bd) v = _mm512_add_ps(v, _mm512_loadu_ps(bd + c));
        _mm512_mask_storeu_ps(yd + m * n + c, mask, v);
      }
    }
  };
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    std::vector<int32_t> acc(std::max<int64_t>(m_rows, 2) * kPanel);
    int64_t p = p0;
    if (m_rows == 1 && VOCALIS_PAIR) {
      // one row: two panels at a time, two memory streams in flight
      for (; p + 1 < p1; p += 2) {
        const int8_t* wa = wd + p * panel_bytes;
        single_row_pair(wa, wa + panel_bytes, xqd, groups, acc.data());
        finish(p, acc.data());
        finish(p + 1, acc.data() + kPanel);
      }
    }
    for (; p < p1; ++p) {
      const int8_t* wpanel = wd + p * panel_bytes;
      std::fill(acc.begin(), acc.end(), 0);
      // k blocks outermost so a block of the panel is read from memory once and reused, from L1, by every
      // row tile (decode batches of up to 16 rows take 3 tiles)
      for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
        const int64_t g1 = std::min(groups, g0 + kChunkGroups);
        for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxTile) {
          const int mt = static_cast<int>(std::min<int64_t>(kMaxTile, m_rows - m0));
          kBlocks[mt](wpanel, xqd + m0 * kp, kp, g0, g1, acc.data() + m0 * kPanel);
        }
      }
      finish(p, acc.data());
    }
  });
  return y;
}
