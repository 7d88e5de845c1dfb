// bf16 attention for the token2wav estimator: out = softmax(q k^T * scale, keys past each query's limit hidden) v,
// with each query's log-sum-exp. Its two products run on oneDNN's tile kernel (torch's `cpublas::brgemm`) on AMX
// CPUs, or on our own AVX512-BF16 dot-product loops (`vdpbf16ps`) on CPUs with that and no tiles, where the
// brgemm call and torch's fp32 fused attention both run well below the CPU's bf16 rate.
//
// Why not torch's fused CPU attention: at the estimator's sizes (a first chunk: 2 x 8 heads, 100 queries over
// 200 keys of 64) a call costs ~0.3 ms alone and ~0.47 ms in a token2wav step, several times its arithmetic;
// part is fixed set-up per call, part is working on every key for every query under an additive mask. The masks
// here are all "query i sees keys [0, limit_i)" (block-causal and padding), so they come as limits: hidden keys
// are skipped a whole tile at a time and weighted exactly 0 inside one.
//
// Per (batch row, head), on one thread: k^T and v repacked once into the kernel's pair-interleaved (VNNI) layout
// (zero past the last visible key), then per tile of 32 queries: scores = q k^T (fp32, one kernel call per 64
// keys), softmax in fp32 (exp to ~1e-7 relative), the unnormalized weights rounded to bf16, p v in fp32, scaled by
// 1 / sum and rounded to bf16. A query that sees no key gets zeros and log-sum-exp -1e10 (finite, as the -1e10
// additive mask gives: such rows are padding, and a NaN there would reach real rows through 0 * NaN).

#include <cstring>

namespace bf16attn {

constexpr int64_t kKeyPanel = 64;  // keys per score tile (the widest B block of the tile kernel)
constexpr int64_t kQueryTile = 64;  // queries per tile (the tile kernel takes any row count)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

using vecmath::first;

// One stretch of a row's keys and values: rows [0, len) of k/v (batches, H, len, E) at the given strides (in
// elements; row strides even), batch row b reading batch b % batches (a prefix shared by request pairs).
struct Segment {
  const at::BFloat16* k;
  const at::BFloat16* v;
  int64_t kb, kh, kl, vb, vh, vl;
  int64_t batches, len;
};

Segment segment_of(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) % 2 == 0,
              "attention: keys/values must be equal-shaped 4-D bf16, last dim contiguous, even row strides");
  return {k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), k.stride(0), k.stride(1), k.stride(2),
          v.stride(0), v.stride(1), v.stride(2), k.size(0), k.size(2)};
}

// Where the attention reads and writes: q (B, H, n, E) at strides qb/qh/qi; out at strides ob/oh/oi; lse
// (B, H, n) fp32 or null; limits (1 or B rows of n) or null.
struct Problem {
  const at::BFloat16* q;
  int64_t qb, qh, qi;
  std::vector<Segment> segments;
  const int32_t* limits;
  int64_t lim_row;
  at::BFloat16* out;
  int64_t ob, oh, oi;
  float* lse;
  int64_t B, H, n, E, L;
  float scale;
};

// k^T as the kernel's B operand: per panel of 64 keys, [E / 2][64] 32-bit pairs (k[l][2j], k[l][2j + 1]).
// Rows [0, need) come from the segments, gathered up to 16 at a time (never across a panel), rows [need,
// padded) are zero.
inline void pack_keys(const Problem& pr, int64_t b, int64_t h, int64_t need, int64_t padded, uint32_t* out) {
  const int64_t half = pr.E / 2;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t l = 0;
  for (const Segment& sg : pr.segments) {
    const auto* base = reinterpret_cast<const int32_t*>(sg.k + (b % sg.batches) * sg.kb + h * sg.kh);
    const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(sg.kl / 2)));
    for (int64_t r = 0; r < sg.len && l < need;) {
      const int64_t run = std::min({int64_t(16), sg.len - r, need - l, kKeyPanel - l % kKeyPanel});
      const __mmask16 m = first(run);
      uint32_t* dst = out + (l / kKeyPanel) * half * kKeyPanel + l % kKeyPanel;
      const int32_t* src = base + r * (sg.kl / 2);
      for (int64_t j = 0; j < half; ++j)
        _mm512_mask_storeu_epi32(dst + j * kKeyPanel, m,
                                 _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, rows, src + j, 4));
      r += run;
      l += run;
    }
  }
  for (; l < padded;) {
    const int64_t run = std::min(int64_t(16), kKeyPanel - l % kKeyPanel);
    uint32_t* dst = out + (l / kKeyPanel) * half * kKeyPanel + l % kKeyPanel;
    for (int64_t j = 0; j < half; ++j) _mm512_mask_storeu_epi32(dst + j * kKeyPanel, first(run), _mm512_setzero_si512());
    l += run;
  }
}

// v as the kernel's B operand: [L / 2][Ep] 32-bit pairs (v[2i][e], v[2i + 1][e]), Ep = E rounded up to 16;
// keys from `need` and values from E zero.
inline void pack_values(const Problem& pr, int64_t b, int64_t h, int64_t need, int64_t padded, int64_t Ep,
                        uint32_t* out) {
  thread_local std::vector<const at::BFloat16*> rows;  // every key row's values, in order (kept between calls)
  rows.clear();
  for (const Segment& sg : pr.segments) {
    const at::BFloat16* base = sg.v + (b % sg.batches) * sg.vb + h * sg.vh;
    for (int64_t r = 0; r < sg.len && static_cast<int64_t>(rows.size()) < need; ++r) rows.push_back(base + r * sg.vl);
  }
  for (int64_t l = 0; l < padded; l += 2) {
    for (int64_t e = 0; e < Ep; e += 16) {
      const __mmask16 m = first(pr.E - e);
      const __m256i a = _mm256_maskz_loadu_epi16(l < need ? m : __mmask16(0), l < need ? rows[l] + e : nullptr);
      const __m256i c = _mm256_maskz_loadu_epi16(l + 1 < need ? m : __mmask16(0), l + 1 < need ? rows[l + 1] + e : nullptr);
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
      _mm512_storeu_si512(out + (l / 2) * Ep + e, pair);
    }
  }
}

// The two products on AVX512-BF16 (`vdpbf16ps`: 16 fp32 lanes, each += the dot product of one bf16 pair of
// each operand), reading the operands in the layouts the tile kernel takes: the A row's pair (2 bf16 as one
// 32-bit lane) broadcast against 16 B columns' pairs. Blocks of up to kDotRows rows x 4 x 16 columns, all
// accumulators in registers.
constexpr int kDotRows = 6;

#define VOCALIS_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline int32_t pair_at(const at::BFloat16* p) {  // two adjacent bf16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// c[r][0, 16 NC) = sum over pairs j < pairs of a[r][2j, 2j + 2] . b[j][...] for rows r < MR: a (MR rows at
// stride lda, bf16), b (pairs rows of ldb 32-bit pairs), c (fp32, stride ldc), overwritten.
template <int MR, int NC>
VOCALIS_BF16_DOT void dot_block(const at::BFloat16* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs,
                                float* c, int64_t ldc) {
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh bv[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + k * ldb + 16 * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair_at(a + r * lda + 2 * k));
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

template <int NC>
void dot_rows(int64_t m, const at::BFloat16* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs, float* c,
              int64_t ldc) {
  int64_t r = 0;
  for (; r + kDotRows <= m; r += kDotRows)
    dot_block<kDotRows, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc);
  switch (m - r) {
    case 5: dot_block<5, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc); break;
    case 4: dot_block<4, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc); break;
    case 3: dot_block<3, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc); break;
    case 2: dot_block<2, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc); break;
    case 1: dot_block<1, NC>(a + r * lda, lda, b, ldb, pairs, c + r * ldc, ldc); break;
    default: break;
  }
}

// c (m x cols, stride ldc) = a (m rows of 2 * pairs bf16, stride lda) . b ([pairs][ldb] 32-bit pairs); cols a
// multiple of 16
void dot_product(int64_t m, int64_t cols, const at::BFloat16* a, int64_t lda, const uint32_t* b, int64_t ldb,
                 int64_t pairs, float* c, int64_t ldc) {
  for (int64_t j = 0; j < cols; j += 64) {
    switch (std::min<int64_t>(cols - j, 64) / 16) {
      case 4: dot_rows<4>(m, a, lda, b + j, ldb, pairs, c + j, ldc); break;
      case 3: dot_rows<3>(m, a, lda, b + j, ldb, pairs, c + j, ldc); break;
      case 2: dot_rows<2>(m, a, lda, b + j, ldb, pairs, c + j, ldc); break;
      default: dot_rows<1>(m, a, lda, b + j, ldb, pairs, c + j, ldc); break;
    }
  }
}

// The attention of one problem over the thread pool, one (batch row, head) per work item; `dot`: the products on
// the AVX512-BF16 loops above instead of the tile kernel.
void run(const Problem& pr, bool dot) {
  const int64_t B = pr.B, H = pr.H, n = pr.n, E = pr.E, L = pr.L;
  const int64_t Ep = (E + 15) / 16 * 16;  // the value panel's width
  const int64_t Lk = round_up(std::max<int64_t>(L, 1), kKeyPanel);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch, kept between calls (grown, never shrunk): no allocation or zeroing per call
    thread_local std::vector<at::BFloat16> kt, vt, pw;
    thread_local std::vector<float> s, acc, sums;
    if (static_cast<int64_t>(kt.size()) < Lk * 64) kt.resize(Lk * 64), vt.resize(Lk * 64);
    if (static_cast<int64_t>(pw.size()) < kQueryTile * Lk) pw.resize(kQueryTile * Lk), s.resize(kQueryTile * Lk);
    if (acc.empty()) acc.resize(kQueryTile * 64), sums.resize(kQueryTile);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const at::BFloat16* qb = pr.q + b * pr.qb + h * pr.qh;
      const int32_t* lim = pr.limits ? pr.limits + b * pr.lim_row : nullptr;
      auto limit = [&](int64_t i) -> int64_t {
        return lim ? std::min<int64_t>(std::max<int32_t>(lim[i], 0), L) : L;
      };
      int64_t need = 0;  // keys any query of this row sees
      for (int64_t i = 0; i < n; ++i) need = std::max(need, limit(i));
      const int64_t need_k = round_up(need, kKeyPanel);
      pack_keys(pr, b, h, need, need_k, reinterpret_cast<uint32_t*>(kt.data()));
      pack_values(pr, b, h, need, need_k, Ep, reinterpret_cast<uint32_t*>(vt.data()));
      for (int64_t i0 = 0; i0 < n; i0 += kQueryTile) {
        const int64_t mq = std::min(kQueryTile, n - i0);
        int64_t tile_need = 0;
        for (int64_t r = 0; r < mq; ++r) tile_need = std::max(tile_need, limit(i0 + r));
        const int64_t lt = std::max<int64_t>(round_up(tile_need, kKeyPanel), kKeyPanel);
        if (tile_need > 0) {
          for (int64_t p = 0; p < lt / kKeyPanel; ++p) {
            if (dot)
              dot_product(mq, kKeyPanel, qb + i0 * pr.qi, pr.qi,
                          reinterpret_cast<const uint32_t*>(kt.data() + p * kKeyPanel * E), kKeyPanel, E / 2,
                          s.data() + p * kKeyPanel, lt);
            else
              at::native::cpublas::brgemm(mq, kKeyPanel, E, pr.qi, kKeyPanel, lt, false, qb + i0 * pr.qi,
                                          kt.data() + p * kKeyPanel * E, s.data() + p * kKeyPanel, true);
          }
        }
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t lim_r = tile_need > 0 ? limit(i0 + r) : 0;
          float* srow = s.data() + r * lt;
          auto* prow = reinterpret_cast<uint16_t*>(pw.data() + r * lt);
          if (lim_r == 0) {
            std::fill(prow, prow + lt, uint16_t(0));
            sums[r] = 0.0f;
            if (pr.lse) pr.lse[(b * H + h) * n + i0 + r] = -1.0e10f;
            continue;
          }
          __m512 vmax = _mm512_set1_ps(-INFINITY);
          for (int64_t l = 0; l < lim_r; l += 16) {
            const __mmask16 m = first(lim_r - l);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, srow + l));
          }
          const float mx = _mm512_reduce_max_ps(vmax) * pr.scale;
          const __m512 vscale = _mm512_set1_ps(pr.scale), vmx = _mm512_set1_ps(mx);
          __m512 vsum = _mm512_setzero_ps(), vexact = _mm512_setzero_ps();
          for (int64_t l = round_up(lim_r, 16); l < lt; l += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + l), _mm256_setzero_si256());
          for (int64_t l = 0; l < lim_r; l += 16) {
            const __mmask16 m = first(lim_r - l);
            __m512 e = vecmath::exp_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, srow + l), vscale, vmx));
            e = _mm512_maskz_mov_ps(m, e);
            vexact = _mm512_add_ps(vexact, e);
            // the weights are rounded for p v: normalize by the sum of the rounded ones
            const __m256i eb = vecmath::to_bf16(e);
            vsum = _mm512_add_ps(vsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + l), eb);
          }
          sums[r] = _mm512_reduce_add_ps(vsum);
          if (pr.lse) pr.lse[(b * H + h) * n + i0 + r] = mx + std::log(_mm512_reduce_add_ps(vexact));
        }
        if (tile_need > 0) {
          if (dot)
            dot_product(mq, Ep, pw.data(), lt, reinterpret_cast<const uint32_t*>(vt.data()), Ep, lt / 2, acc.data(),
                        Ep);
          else
            at::native::cpublas::brgemm(mq, Ep, lt, lt, Ep, Ep, false, pw.data(), vt.data(), acc.data(), true);
        }
        for (int64_t r = 0; r < mq; ++r) {
          at::BFloat16* dst = pr.out + b * pr.ob + h * pr.oh + (i0 + r) * pr.oi;
          const __m512 inv = _mm512_set1_ps(sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f);
          for (int64_t e = 0; e < E; e += 16) {
            const __m512 o = sums[r] > 0.0f ? _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * Ep + e), inv)
                                            : _mm512_setzero_ps();
            _mm256_mask_storeu_epi16(dst + e, first(E - e), vecmath::to_bf16(o));
          }
        }
      }
    }
    if (!dot) at::native::cpublas::brgemm_release();
  });
}

// Checks limits (int32 (1 or B, n) contiguous, or empty) and returns (pointer or null, row stride).
std::pair<const int32_t*, int64_t> limits_of(const torch::Tensor& limits, int64_t B, int64_t n) {
  if (limits.numel() == 0) return {nullptr, 0};
  TORCH_CHECK(limits.scalar_type() == at::kInt && limits.dim() == 2 && limits.size(1) == n &&
              (limits.size(0) == 1 || limits.size(0) == B) && limits.is_contiguous(), "attention: limits");
  return {limits.data_ptr<int32_t>(), limits.size(0) == 1 ? 0 : n};
}

// q (B, H, n, E) bf16, last dim contiguous, any other strides; keys/values: the concatenation along dim 2 of
// the segments (k_i, v_i), each (B or a divisor of B, H, L_i, E); E even, at most 64.
// limits: int32 (1 or B, n), keys [0, limit) visible to each query (clamped to L), or empty (all visible).
// Returns out bf16, (B, H, n, E) when heads_first else (B, n, H, E), and lse fp32 (B, H, n).
std::vector<torch::Tensor> attention(const torch::Tensor& q, const std::vector<torch::Tensor>& ks,
                                     const std::vector<torch::Tensor>& vs, const torch::Tensor& limits, double scale,
                                     bool heads_first, bool dot) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.stride(3) == 1, "attention: q (B, H, n, E) bf16");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), E = q.size(3);
  TORCH_CHECK(E % 2 == 0 && E <= 64, "attention: head size must be even and <= 64, got ", E);
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size(), "attention: one value tensor per key tensor");
  Problem pr{q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), q.stride(2), {}, nullptr, 0, nullptr, 0, 0, 0,
             nullptr, B, H, n, E, 0, static_cast<float>(scale)};
  for (size_t i = 0; i < ks.size(); ++i) {
    Segment sg = segment_of(ks[i], vs[i]);
    TORCH_CHECK(B % sg.batches == 0 && ks[i].size(1) == H && ks[i].size(3) == E, "attention: key shapes");
    pr.L += sg.len;
    pr.segments.push_back(sg);
  }
  std::tie(pr.limits, pr.lim_row) = limits_of(limits, B, n);
  auto out = heads_first ? torch::empty({B, H, n, E}, q.options()) : torch::empty({B, n, H, E}, q.options());
  auto lse = torch::empty({B, H, n}, q.options().dtype(at::kFloat));
  pr.out = out.data_ptr<at::BFloat16>();
  pr.ob = n * H * E;
  pr.oh = heads_first ? n * E : E;
  pr.oi = heads_first ? E : H * E;
  pr.lse = lse.data_ptr<float>();
  run(pr, dot);
  return {out, lse};
}

void bind(pybind11::module& m) {
  m.def("bf16_attention", &attention, "bf16 attention with per-query key limits -> (out, log-sum-exp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace bf16attn
