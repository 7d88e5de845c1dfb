// fp32 attention for the token2wav estimator: out = softmax(q k^T * scale, keys past each query's limit hidden) v,
// with each query's log-sum-exp; the fp32 counterpart of bf16_attention.cpp (same masks as limits, same outputs),
// for CPUs without bf16 arithmetic. AVX2 + FMA code, in both source sets.
//
// Why not torch's fused CPU attention: at the estimator's sizes its per-call set-up and its small GEMM calls
// keep it well under the CPU's FMA rate, and under a mask it works on every key. Here both products run in
// register-blocked FMA loops (6 rows x 16 columns of accumulators, the b row loaded once per 6 broadcasts), and
// keys past a tile's limits are skipped.
//
// Per (batch row, head), on one thread: k^T repacked once into panels of 16 keys ([E][16] each, zero past the
// last visible key) and v into rows of Ep = E rounded up to 16 (zero past the last key and past E), then per
// tile of 64 queries: scores = q k^T (fp32), softmax in fp32 (exp to ~1e-7 relative), p v in fp32, scaled by
// 1 / sum. A query that sees no key gets zeros and log-sum-exp -1e10 (finite, as the -1e10 additive mask gives).

#include <cstring>

namespace fp32attn {

constexpr int64_t kPanel = 16;  // keys per k^T panel = columns per product block
constexpr int64_t kQueryTile = 64;  // queries per tile
constexpr int kRows = 6;  // rows per product block: 12 accumulators + 2 b vectors + 1 broadcast of 16 registers

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One stretch of a row's keys and values, as in bf16_attention.cpp: fp32, or bf16 (a cache's dtype), widened to
// fp32 as it is packed, so a cached stretch is read where it lies instead of first upcast into a copy.
struct Segment {
  const void* k;
  const void* v;
  int64_t kb, kh, kl, vb, vh, vl;
  int64_t batches, len;
  bool bf16;
};

// n values from src (fp32, or bf16 when `bf16`) to dst as fp32.
inline void widen(const void* src, bool bf16, int64_t n, float* dst) {
  if (!bf16) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

struct Problem {
  const float* q;
  int64_t qb, qh, qi;
  std::vector<Segment> segments;
  const int32_t* limits;
  int64_t lim_row;
  float* out;
  int64_t ob, oh, oi;
  float* lse;
  int64_t B, H, n, E, L;
  float scale;
};

// c[r][0, 16) = sum over k < K of a[r][k] * b[k][0, 16) for rows r < MR: a at row stride lda, b at row stride ldb,
// c at row stride ldc (overwritten).
template <int MR>
inline void fma_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) acc0[r] = _mm256_setzero_ps(), acc1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(c + r * ldc, acc0[r]), _mm256_storeu_ps(c + r * ldc + 8, acc1[r]);
}

// c (m rows x 16, stride ldc) = a (m rows of K, stride lda) . b (K rows of 16, stride ldb)
inline void fma_rows(int64_t m, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c,
                     int64_t ldc) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) fma_block<kRows>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc);
  switch (m - r) {
    case 5: fma_block<5>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc); break;
    case 4: fma_block<4>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc); break;
    case 3: fma_block<3>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc); break;
    case 2: fma_block<2>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc); break;
    case 1: fma_block<1>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc); break;
    default: break;
  }
}

// k^T in panels of 16 keys ([E][16] each) and v as rows of Ep floats, keys [0, need) from the segments, the rest
// up to `padded` zero (a zero weight times a stale NaN would still be NaN).
inline void pack(const Problem& pr, int64_t b, int64_t h, int64_t need, int64_t padded, int64_t Ep, float* kt,
                 float* vt) {
  const int64_t E = pr.E;
  float krow[128];
  int64_t l = 0;
  for (const Segment& sg : pr.segments) {
    const int64_t width = sg.bf16 ? 2 : 4;  // bytes per element; strides are in elements
    const char* kbase = static_cast<const char*>(sg.k) + ((b % sg.batches) * sg.kb + h * sg.kh) * width;
    const char* vbase = static_cast<const char*>(sg.v) + ((b % sg.batches) * sg.vb + h * sg.vh) * width;
    for (int64_t r = 0; r < sg.len && l < need; ++r, ++l) {
      widen(kbase + r * sg.kl * width, sg.bf16, E, krow);
      float* panel = kt + (l / kPanel) * E * kPanel + l % kPanel;
      for (int64_t e = 0; e < E; ++e) panel[e * kPanel] = krow[e];
      widen(vbase + r * sg.vl * width, sg.bf16, E, vt + l * Ep);
      std::fill(vt + l * Ep + E, vt + (l + 1) * Ep, 0.0f);
    }
  }
  for (; l < padded; ++l) {
    float* panel = kt + (l / kPanel) * E * kPanel + l % kPanel;
    for (int64_t e = 0; e < E; ++e) panel[e * kPanel] = 0.0f;
    std::fill(vt + l * Ep, vt + (l + 1) * Ep, 0.0f);
  }
}

void run(const Problem& pr) {
  const int64_t B = pr.B, H = pr.H, n = pr.n, E = pr.E, L = pr.L;
  const int64_t Ep = round_up(E, 16);
  const int64_t Lk = round_up(std::max<int64_t>(L, 1), kPanel);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch, kept between calls (grown, never shrunk)
    thread_local std::vector<float> kt, vt, s, acc, sums;
    if (static_cast<int64_t>(kt.size()) < Lk * E) kt.resize(Lk * E);
    if (static_cast<int64_t>(vt.size()) < Lk * Ep) vt.resize(Lk * Ep);
    if (static_cast<int64_t>(s.size()) < kQueryTile * Lk) s.resize(kQueryTile * Lk);
    if (static_cast<int64_t>(acc.size()) < kQueryTile * Ep) acc.resize(kQueryTile * Ep), sums.resize(kQueryTile);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qb = pr.q + b * pr.qb + h * pr.qh;
      const int32_t* lim = pr.limits ? pr.limits + b * pr.lim_row : nullptr;
      auto limit = [&](int64_t i) -> int64_t {
        return lim ? std::min<int64_t>(std::max<int32_t>(lim[i], 0), L) : L;
      };
      int64_t need = 0;  // keys any query of this row sees
      for (int64_t i = 0; i < n; ++i) need = std::max(need, limit(i));
      pack(pr, b, h, need, round_up(need, kPanel), Ep, kt.data(), vt.data());
      for (int64_t i0 = 0; i0 < n; i0 += kQueryTile) {
        const int64_t mq = std::min(kQueryTile, n - i0);
        int64_t tile_need = 0;
        for (int64_t r = 0; r < mq; ++r) tile_need = std::max(tile_need, limit(i0 + r));
        const int64_t lt = round_up(tile_need, kPanel);  // the tile's score columns (and p v's K)
        for (int64_t p = 0; p < lt / kPanel; ++p)
          fma_rows(mq, qb + i0 * pr.qi, pr.qi, kt.data() + p * E * kPanel, kPanel, E, s.data() + p * kPanel, lt);
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t lim_r = limit(i0 + r);
          float* row = s.data() + r * lt;  // scores in, unnormalized weights out
          if (lim_r == 0) {
            std::fill(row, row + lt, 0.0f);
            sums[r] = 0.0f;
            if (pr.lse) pr.lse[(b * H + h) * n + i0 + r] = -1.0e10f;
            continue;
          }
          float mx = -INFINITY;
          int64_t l = 0;
          __m256 vmax = _mm256_set1_ps(-INFINITY);
          for (; l + 8 <= lim_r; l += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + l));
          mx = vecmath::hmax(vmax);
          for (; l < lim_r; ++l) mx = std::max(mx, row[l]);
          mx *= pr.scale;
          const __m256 vscale = _mm256_set1_ps(pr.scale), vmx = _mm256_set1_ps(mx);
          const __m256i vlim = _mm256_set1_epi32(static_cast<int32_t>(lim_r));
          __m256 vsum = _mm256_setzero_ps();
          for (l = 0; l < lt; l += 8) {
            const __m256 visible = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(vlim, _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(l)))));
            const __m256 e = _mm256_and_ps(visible, vecmath::exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(row + l), vscale, vmx)));
            vsum = _mm256_add_ps(vsum, e);
            _mm256_storeu_ps(row + l, e);
          }
          sums[r] = vecmath::hsum(vsum);
          if (pr.lse) pr.lse[(b * H + h) * n + i0 + r] = mx + std::log(sums[r]);
        }
        for (int64_t e0 = 0; e0 < Ep; e0 += 16)
          fma_rows(mq, s.data(), lt, vt.data() + e0, Ep, lt, acc.data() + e0, Ep);
        for (int64_t r = 0; r < mq; ++r) {
          float* dst = pr.out + b * pr.ob + h * pr.oh + (i0 + r) * pr.oi;
          const float inv = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;
          const __m256 vinv = _mm256_set1_ps(inv);
          int64_t e = 0;
          for (; e + 8 <= E; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * Ep + e), vinv));
          for (; e < E; ++e) dst[e] = acc[r * Ep + e] * inv;
        }
      }
    }
  });
}

// q (B, H, n, E) fp32, last dim contiguous; keys/values: the concatenation along dim 2 of the segments (k_i,
// v_i), each (B or a divisor of B, H, L_i, E) fp32 or bf16 (k_i and v_i alike), last dim contiguous; E at most 128. limits: int32 (1 or B,
// n), keys [0, limit) visible to each query (clamped to L), or empty (all visible). Returns out fp32, (B, H, n,
// E) when heads_first else (B, n, H, E), and lse fp32 (B, H, n).
std::vector<torch::Tensor> attention(const torch::Tensor& q, const std::vector<torch::Tensor>& ks,
                                     const std::vector<torch::Tensor>& vs, const torch::Tensor& limits, double scale,
                                     bool heads_first) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, "attention: q (B, H, n, E) fp32");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), E = q.size(3);
  TORCH_CHECK(E >= 1 && E <= 128, "attention: head size must be at most 128, got ", E);
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size(), "attention: one value tensor per key tensor");
  Problem pr{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), {}, nullptr, 0, nullptr, 0, 0, 0,
             nullptr, B, H, n, E, 0, static_cast<float>(scale)};
  for (size_t i = 0; i < ks.size(); ++i) {
    const torch::Tensor &k = ks[i], &v = vs[i];
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() &&
                (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) && k.stride(3) == 1 &&
                v.stride(3) == 1, "attention: keys/values must be equal-shaped 4-D fp32 or bf16, last dim contiguous");
    TORCH_CHECK(B % k.size(0) == 0 && k.size(1) == H && k.size(3) == E, "attention: key shapes");
    pr.segments.push_back({k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                           v.stride(1), v.stride(2), k.size(0), k.size(2), k.scalar_type() == at::kBFloat16});
    pr.L += k.size(2);
  }
  if (limits.numel() != 0) {
    TORCH_CHECK(limits.scalar_type() == at::kInt && limits.dim() == 2 && limits.size(1) == n &&
                (limits.size(0) == 1 || limits.size(0) == B) && limits.is_contiguous(), "attention: limits");
    pr.limits = limits.data_ptr<int32_t>();
    pr.lim_row = limits.size(0) == 1 ? 0 : n;
  }
  auto out = heads_first ? torch::empty({B, H, n, E}, q.options()) : torch::empty({B, n, H, E}, q.options());
  auto lse = torch::empty({B, H, n}, q.options());
  pr.out = out.data_ptr<float>();
  pr.ob = n * H * E;
  pr.oh = heads_first ? n * E : E;
  pr.oi = heads_first ? E : H * E;
  pr.lse = lse.data_ptr<float>();
  run(pr);
  return {out, lse};
}

void bind(pybind11::module& m) {
  m.def("fp32_attention", &attention, "fp32 attention with per-query key limits -> (out, log-sum-exp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace fp32attn
