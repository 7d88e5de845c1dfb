// Int8 GEMM for a few rows (LLM decode) with AVX2: y = dequant(quant(x) . w_s8) + bias, int32 sums exact.
//
// The same math as the VNNI kernel (int8_gemv.cpp): symmetric per-output-channel int8 weights, per-row symmetric
// int8 activations (scale amax/127, round half to even), exact int32 sums, y = acc * sx * sw + bias; the results
// are the VNNI kernel's to fp32 rounding of the scale-out. Only the products differ: AVX2 has no u8 x s8 -> s32
// dot product, and VPMADDUBSW's u8 x s8 pair sums saturate int16 (255 * 127 * 2 > 32767). So both operands are
// widened to int16 and multiplied by VPMADDWD (s16 x s16 pair sums into s32: exact), the activations once per call
// (stored as int16, no +128 offset, so `corr` is unused), the weights as they stream in (VPMOVSXBW from memory).
//
// Weights: panels of 64 output channels as in int8_gemv.cpp (one contiguous run per panel, 256 bytes per group of
// 4 k), ordered inside a group for VPMADDWD: byte cb*32 + h*16 + c*2 + t = W[panel*64 + cb*8 + c][g*4 + h*2 + t]
// (cb 8 blocks of 8 channels, h the k pair). One 32-byte load is 8 channels x 4 k; its low half, widened, times
// the broadcast pair (x0, x1) and its high half times (x2, x3) add into one accumulator of 8 channels' int32 sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPanel = 64;  // output channels per panel (8 vectors of 8)
#ifndef VOCALIS_CHUNK_GROUPS
#define VOCALIS_CHUNK_GROUPS 64  // k4 groups per cache block: 64 * 256 B = 16 KiB (half of Zen 3's L1)
#endif
#ifndef VOCALIS_PREFETCH
#define VOCALIS_PREFETCH 32  // groups ahead (8 KiB), as the VNNI kernel
#endif
constexpr int kChunkGroups = VOCALIS_CHUNK_GROUPS;
using XQ = int16_t;  // a quantized activation as the kernel reads it (int8 value widened; pairs load as one int32)

// Quantize rows of x (M, K) fp32 into int16 (M, Kp) (padding 0); scales (M,).
void quantize_rows(const float* x, int64_t m_rows, int64_t k, int64_t kp, XQ* xq, float* sx) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* row = x + m * k;
    __m256 vmax = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(row + i), abs_mask));
    float amax = vecmath::hmax(vmax);
    for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    // all-zero row: any scale gives zeros; 1 keeps the division finite
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = amax > 0.f ? 127.f / amax : 1.f;
    sx[m] = scale;
    XQ* out = xq + m * kp;
    const __m256 vinv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 16 <= k; i += 16) {
      // cvtps rounds to nearest even (default MXCSR), as torch.round does
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i + 8), vinv));
      // packs works per 128-bit lane: [q0 lo, q1 lo, q0 hi, q1 hi] -> reorder the 64-bit quarters
      const __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), q);
    }
    for (; i < k; ++i) out[i] = static_cast<XQ>(std::nearbyint(row[i] * inv));
    for (; i < kp; ++i) out[i] = 0;
  }
}

inline __m256i pair(const XQ* xq, int64_t at) {  // (x[at], x[at + 1]) broadcast as int16 pairs
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + at));
}

inline __m256i widen(const int8_t* p) {  // 16 int8 weights -> int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One row over a whole panel (all k4 groups): acc (64,) int32 out, 8 accumulators of 8 channels.
inline void single_row(const int8_t* w, const XQ* xq, int64_t groups, int32_t* acc) {
  __m256i a[8];
#pragma GCC unroll 8
  for (int cb = 0; cb < 8; ++cb) a[cb] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g, w += kPanel * 4) {
    if (VOCALIS_PREFETCH) {
      _mm_prefetch(reinterpret_cast<const char*>(w + VOCALIS_PREFETCH * kPanel * 4), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + VOCALIS_PREFETCH * kPanel * 4 + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + VOCALIS_PREFETCH * kPanel * 4 + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + VOCALIS_PREFETCH * kPanel * 4 + 192), _MM_HINT_T0);
    }
    const __m256i x01 = pair(xq, g * 4), x23 = pair(xq, g * 4 + 2);
#pragma GCC unroll 8
    for (int cb = 0; cb < 8; ++cb)
      a[cb] = _mm256_add_epi32(a[cb], _mm256_add_epi32(_mm256_madd_epi16(widen(w + cb * 32), x01),
                                                       _mm256_madd_epi16(widen(w + cb * 32 + 16), x23)));
  }
#pragma GCC unroll 8
  for (int cb = 0; cb < 8; ++cb) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + cb * 8), a[cb]);
}

// One row, two panels (a, b): acc (2, 64) out (the VNNI kernel's entry point for two memory streams; here the
// 8 accumulators of one panel already fill half the 16 registers, so the panels run one after the other).
inline void single_row_pair(const int8_t* wa, const int8_t* wb, const XQ* xq, int64_t groups, int32_t* acc) {
  single_row(wa, xq, groups, acc);
  single_row(wb, xq, groups, acc + kPanel);
}

// One panel x MT rows over k4 groups [g0, g1): acc (MT, 64) int32 in and out. A quarter of the panel (16
// channels: 2 accumulators per row) at a time, so MT rows' accumulators, the 4 widened weight vectors and the
// pair broadcasts fit the 16 registers; a quarter is one 64-byte line of each group, so the 4 passes read each
// line once.
template <int MT>
inline void panel_block(const int8_t* w, const XQ* xq, int64_t kp, int64_t g0, int64_t g1, int32_t* acc) {
  for (int q = 0; q < 4; ++q) {
    __m256i a[MT][2];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j)
        a[m][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + m * kPanel + q * 16 + j * 8));
    const int8_t* wp = w + g0 * (kPanel * 4) + q * 64;
    for (int64_t g = g0; g < g1; ++g, wp += kPanel * 4) {
      if (VOCALIS_PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(wp + VOCALIS_PREFETCH * kPanel * 4), _MM_HINT_T0);
      const __m256i w0 = widen(wp), w1 = widen(wp + 16), w2 = widen(wp + 32), w3 = widen(wp + 48);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m256i x01 = pair(xq + m * kp, g * 4), x23 = pair(xq + m * kp, g * 4 + 2);
        a[m][0] = _mm256_add_epi32(a[m][0], _mm256_add_epi32(_mm256_madd_epi16(w0, x01), _mm256_madd_epi16(w1, x23)));
        a[m][1] = _mm256_add_epi32(a[m][1], _mm256_add_epi32(_mm256_madd_epi16(w2, x01), _mm256_madd_epi16(w3, x23)));
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + m * kPanel + q * 16 + j * 8), a[m][j]);
  }
}

using BlockFn = void (*)(const int8_t*, const XQ*, int64_t, int64_t, int64_t, int32_t*);
constexpr int kMaxTile = 4;  // 4 rows x 2 accumulators + 4 weight vectors + 2 broadcasts = 14 of 16 registers
const BlockFn kBlocks[kMaxTile + 1] = {nullptr, panel_block<1>, panel_block<2>, panel_block<3>, panel_block<4>};

}  // namespace

// x (M, K) fp32; w int8 (P, K4, 64, 4) packed (this file's order); scale (P*64,) fp32; corr (P*64,) int32 (unused
// here: the activations carry no offset); bias (P*64,) fp32 or empty; n real output channels (<= P*64).
// Returns (M, n) fp32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor corr,
                          torch::Tensor bias, int64_t n, int64_t grain_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be 2-D float32");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kChar && w.size(2) == kPanel && w.size(3) == 4,
              "w must be packed int8 (P, K4, 64, 4)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "packed tensors contiguous");
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

  std::vector<XQ> xq(m_rows * kp);
  std::vector<float> sx(m_rows);
  quantize_rows(x.data_ptr<float>(), m_rows, k, kp, xq.data(), sx.data());

  const int8_t* wd = w.data_ptr<int8_t>();
  const float* sd = scale.data_ptr<float>();
  const float* bd = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const XQ* xqd = xq.data();
  const float* sxd = sx.data();

  const int64_t panel_bytes = groups * kPanel * 4;
  const int64_t grain = std::max<int64_t>(1, (grain_bytes + panel_bytes - 1) / panel_bytes);
  // y for panel p from its int32 sums acc (M, 64)
  auto finish = [&](int64_t p, const int32_t* acc) {
    const int64_t c0 = p * kPanel;
    for (int64_t m = 0; m < m_rows; ++m) {
      const __m256 vsx = _mm256_set1_ps(sxd[m]);
      for (int j = 0; j < 8; ++j) {
        const int64_t c = c0 + j * 8;
        if (c >= n) break;
        const __m256 s = _mm256_mul_ps(vsx, _mm256_loadu_ps(sd + c));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(acc + m * kPanel + j * 8))), s);
        if (bd) v = _mm256_add_ps(v, _mm256_loadu_ps(bd + c));
        if (c + 8 <= n) {
          _mm256_storeu_ps(yd + m * n + c, v);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, v);
          std::copy(tmp, tmp + (n - c), yd + m * n + c);
        }
      }
    }
  };
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    std::vector<int32_t> acc(std::max<int64_t>(m_rows, 2) * kPanel);
    int64_t p = p0;
    if (m_rows == 1)
      for (; p < p1; ++p) {
        single_row(wd + p * panel_bytes, xqd, groups, acc.data());
        finish(p, acc.data());
      }
    for (; p < p1; ++p) {
      const int8_t* wpanel = wd + p * panel_bytes;
      std::fill(acc.begin(), acc.end(), 0);
      // k blocks outermost so a block of the panel is read from memory once and reused, from L1, by every
      // row tile
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
