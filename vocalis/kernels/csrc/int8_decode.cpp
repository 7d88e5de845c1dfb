// The decoder stack's decode step for a few single-query rows in one native call (see int8_decode.py), over
// int8 weights (the VNNI panels of int8_gemv.cpp) or fp32 weights (their (out, in) rows): one `DecodeStack`
// template, its weight kind an operand class (Int8Operand / F32Operand) that owns the GEMV of one panel.
//
// Compiled in one translation unit after int8_gemv.cpp (int8_gemv.py joins the two sources), whose panel kernels,
// row quantizer and `int8_linear` it uses; this file also holds the extension's Python module.
//
// Why: at batch 1 the torch path spends ~7 ms of a ~25 ms step outside the weight GEMVs, in ~20 small ops per
// layer (dispatch, allocation, waking the thread pool per op). Here the whole stack runs inside one OpenMP
// parallel region; each layer is 5 phases whose work items (64-channel panels, or two for one row; (row, kv head)
// pairs for attention) the threads claim one at a time, each phase ending when all its items are done:
//   norm1 (+ quantize; each thread its own copy) -> q/k/v panels (+bias)
//   per (row, kv head): rotary, K/V into the paged cache, attention of its query heads over the row's context
//   (quantize attention out) -> o_proj panels, added into x
//   norm2 (+ quantize) -> gate/up panel pairs (gate p with up p + I/64) -> SiLU(gate) * up
//   (quantize act) -> down_proj panels, added into x
// and, in forward_logits, after the last layer: final norm (+ quantize) -> speech-head panels -> logits
// The math is the torch path's (RMSNorm, half-split rotary, softmax attention over the row's context slots;
// int8: per-row int8 activations, exact int32 sums; fp32: fp32 dot products); only fp32 rounding order differs
// (vector exp, summation order).
//
// Legend: M rows, D hidden, H query heads, Hkv key/value heads, G = H / Hkv, Dh head width, I intermediate,
// L layers, S cache slots, Lmax gathered context length, C = ctx_len[m] (real context of row m, incl. itself).
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <memory>

namespace {

constexpr int kMaxFusedRows = kMaxTile;  // one row tile: every row's accumulators stay in registers

using decodemath::rms_norm_row;

// One packed int8 weight (see int8_gemv.cpp): raw pointers into tensors the stack keeps alive.
struct PackedRef {
  const int8_t* w = nullptr;
  const float* scale = nullptr;
  const int32_t* corr = nullptr;
  const float* bias = nullptr;  // null: none
  int64_t panels = 0, groups = 0, n = 0;

  int64_t in_width() const { return groups * 4; }  // K padded to whole groups of 4
  int64_t panel_bytes() const { return groups * kPanel * 4; }
  const int8_t* panel(int64_t p) const { return w + p * panel_bytes(); }

  // v (M, 64) = (acc - corr) * sx * sw (+ bias) for panel p
  void dequant(int64_t p, const int32_t* acc, int m_rows, const float* sx, float* v) const {
    const int64_t c = p * kPanel;
    decodemath::dequant_panel(acc, corr + c, scale + c, bias ? bias + c : nullptr, m_rows, sx, v);
  }
};

// acc (M, 64) int32 = sums of panel p over all k for rows xq (M, Kp)
inline void panel_sums(const PackedRef& w, int64_t p, const XQ* xq, int m_rows, int32_t* acc) {
  std::fill(acc, acc + m_rows * kPanel, 0);
  kBlocks[m_rows](w.panel(p), xq, w.groups * 4, 0, w.groups, acc);
}

// One fp32 or bf16 weight (N, K) in the usual (out, in) row-major layout: panel p is rows [64 p, 64 p + 64), one
// contiguous run of 64 K values, so it streams from memory as an int8 panel does (and o_proj and down_proj are
// read from the modules' own storage). W: float, or uint16_t holding bf16 (half the bytes per panel).
template <typename W>
struct DenseRef {
  const W* w = nullptr;
  const float* bias = nullptr;  // (N,) or null
  int64_t panels = 0, k = 0, n = 0;

  int64_t in_width() const { return k; }
};
using F32Ref = DenseRef<float>;
using BF16Ref = DenseRef<uint16_t>;

// v (M, 64) = x (M, ldx) . panel p of w (+ bias); channels past N give 0
template <typename W, int MT>
void dense_panel(const DenseRef<W>& w, int64_t p, const float* x, int64_t ldx, float* v) {
  const int64_t c0 = p * kPanel, nc = std::min<int64_t>(kPanel, w.n - c0);
  const W* wp = w.w + c0 * w.k;
  for (int64_t c = 0; c < nc; ++c) decodemath::dense_row<W, MT>(wp + c * w.k, w.k, x, ldx, v + c);
  for (int m = 0; m < MT; ++m) {
    for (int64_t c = nc; c < kPanel; ++c) v[m * kPanel + c] = 0.f;
    if (w.bias)
      for (int64_t c = 0; c < nc; ++c) v[m * kPanel + c] += w.bias[c0 + c];
  }
}

// dense_panel for m_rows (1..kMaxTile) rows: the row count as a template argument, found by recursion
template <typename W, int MT = 1>
void dense_panel_rows(int m_rows, const DenseRef<W>& w, int64_t p, const float* x, int64_t ldx, float* v) {
  if constexpr (MT < kMaxTile) {
    if (m_rows > MT) return dense_panel_rows<W, MT + 1>(m_rows, w, p, x, ldx, v);
  }
  dense_panel<W, MT>(w, p, x, ldx, v);
}

// A thread's operand for the GEMVs of one phase, one class per weight kind. set() prepares the phase's input
// rows once per thread (int8: quantized into the thread's own buffer; fp32: read in place), gemv() runs panels
// [p0, p1) calling fn(p, v (M, 64) fp32 outputs), pair() two panels into va and vb (gate and up).
struct Int8Operand {
  using Ref = PackedRef;
  static constexpr bool kTwoPanelItems = true;  // one row: items of two panels (two memory streams in flight)
  static constexpr int64_t kGraceNs = 200000;

  std::vector<XQ> xq;  // the quantized rows in the kernel's form (int8_gemv*.cpp)
  std::vector<float> sx;
  std::vector<int32_t> acc;

  Int8Operand(int64_t m_rows, int64_t k_max) : xq(m_rows * k_max), sx(m_rows), acc(2 * kMaxFusedRows * kPanel) {}

  void set(const float* x, int m_rows, int64_t k, const Ref& w) {
    quantize_rows(x, m_rows, k, w.groups * 4, xq.data(), sx.data());
  }

  template <typename Fn>
  void gemv(const Ref& w, int64_t p0, int64_t p1, int m_rows, float* v, Fn&& fn) {
    int64_t p = p0;
    if (m_rows == 1)
      for (; p + 1 < p1; p += 2) {
        single_row_pair(w.panel(p), w.panel(p + 1), xq.data(), w.groups, acc.data());
        w.dequant(p, acc.data(), 1, sx.data(), v);
        w.dequant(p + 1, acc.data() + kPanel, 1, sx.data(), v + kPanel);
        fn(p, v);
        fn(p + 1, v + kPanel);
      }
    for (; p < p1; ++p) {
      panel_sums(w, p, xq.data(), m_rows, acc.data());
      w.dequant(p, acc.data(), m_rows, sx.data(), v);
      fn(p, v);
    }
  }

  void pair(const Ref& w, int64_t pa, int64_t pb, int m_rows, float* va, float* vb) {
    if (m_rows == 1) {
      single_row_pair(w.panel(pa), w.panel(pb), xq.data(), w.groups, acc.data());
      w.dequant(pa, acc.data(), 1, sx.data(), va);
      w.dequant(pb, acc.data() + kPanel, 1, sx.data(), vb);
    } else {
      panel_sums(w, pa, xq.data(), m_rows, acc.data());
      w.dequant(pa, acc.data(), m_rows, sx.data(), va);
      panel_sums(w, pb, xq.data(), m_rows, acc.data());
      w.dequant(pb, acc.data(), m_rows, sx.data(), vb);
    }
  }
};

// fp32 weights: the rows read in place. bf16 weights: the rows rounded to bf16 first (into the thread's buffer,
// kept as floats), as the per-op path's CastLinear rounds its input: the same products, fp32 sums.
template <typename W>
struct DenseOperand {
  using Ref = DenseRef<W>;
  static constexpr bool kTwoPanelItems = false;  // a panel is 2-4x the bytes of an int8 one already
  static constexpr int64_t kGraceNs = sizeof(W) == 4 ? 400000 : 300000;

  const float* x = nullptr;
  int64_t ld = 0;
  std::vector<float> rounded;

  DenseOperand(int64_t m_rows, int64_t k_max) : rounded(sizeof(W) == 2 ? m_rows * k_max : 0) {}

  void set(const float* rows, int m_rows, int64_t k, const Ref&) {
    x = rows;
    ld = k;
    if constexpr (sizeof(W) == 2) {
      decodemath::round_rows_bf16(rows, m_rows, k, rounded.data());
      x = rounded.data();
    }
  }

  template <typename Fn>
  void gemv(const Ref& w, int64_t p0, int64_t p1, int m_rows, float* v, Fn&& fn) {
    for (int64_t p = p0; p < p1; ++p) {
      dense_panel_rows<W>(m_rows, w, p, x, ld, v);
      fn(p, v);
    }
  }

  void pair(const Ref& w, int64_t pa, int64_t pb, int m_rows, float* va, float* vb) {
    dense_panel_rows<W>(m_rows, w, pa, x, ld, va);
    dense_panel_rows<W>(m_rows, w, pb, x, ld, vb);
  }
};
using F32Operand = DenseOperand<float>;
using BF16Operand = DenseOperand<uint16_t>;

// Work of one phase, claimed item by item: a thread takes the next unclaimed item until none is left, then
// waits until every item is done. Why not a static split and a barrier: on a shared machine a thread may lose
// its core for a whole time slice (ms), and everyone else would wait for it. Here the others take its unclaimed
// items, and an item claimed but not finished within a grace time is computed again by a waiting thread: every
// item is idempotent (it writes the same values to buffers no other item and no later phase writes: each layer
// has its own buffers, see DecodeStack::forward), so a late duplicate write is harmless.
// default grace (Op::kGraceNs): ~3x the longest item at ~10 GB/s (int8: two 311 KB down_proj panels, 200 us;
// fp32: one 1.24 MB down_proj panel, 400 us; 0.5B shapes)

struct Phase {
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
  std::atomic<uint8_t>* item_done = nullptr;  // (n_items,) flags
};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

// prep() runs once, before this thread's first item (quantizing this phase's input into the thread's own
// buffer; skipped by a thread that gets no item)
template <typename Prep, typename Work>
void run_phase(Phase& ph, int64_t n_items, int64_t grace_ns, Prep&& prep, Work&& work) {
  bool prepared = false;
  auto run = [&](int64_t i) {
    if (!prepared) {
      prep();
      prepared = true;
    }
    work(i);
    if (ph.item_done[i].exchange(1, std::memory_order_acq_rel) == 0) ph.done.fetch_add(1, std::memory_order_release);
  };
  for (;;) {
    const int64_t i = ph.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_items) break;
    run(i);
  }
  const int64_t t0 = now_ns();
  for (int spins = 0; ph.done.load(std::memory_order_acquire) < n_items;) {
    _mm_pause();
    if (++spins % 256) continue;
    if (now_ns() - t0 < grace_ns) continue;
    for (int64_t i = 0; i < n_items; ++i)  // an owner is stalled (off its core): finish its items here
      if (!ph.item_done[i].load(std::memory_order_acquire)) run(i);
  }
}

template <typename Ref>
struct Layer {
  torch::Tensor norm1, norm2;  // (D,)
  std::vector<torch::Tensor> keep;  // the weight tensors the refs point into
  Ref qkv, o, gate_up, down;
};

PackedRef packed_ref(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& corr,
                     const torch::Tensor& bias, int64_t n) {
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kChar && w.size(2) == kPanel && w.size(3) == 4 &&
              w.is_contiguous(), "w must be packed int8 (P, K4, 64, 4), contiguous");
  const int64_t panels = w.size(0);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == panels * kPanel &&
              corr.scalar_type() == torch::kInt && corr.is_contiguous() && corr.numel() == panels * kPanel,
              "scale/corr must be contiguous (P*64,)");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat && bias.is_contiguous() &&
                            bias.numel() == panels * kPanel), "bias must be contiguous (P*64,) fp32");
  PackedRef r;
  r.w = w.data_ptr<int8_t>();
  r.scale = scale.data_ptr<float>();
  r.corr = corr.data_ptr<int32_t>();
  r.bias = has_bias ? bias.data_ptr<float>() : nullptr;
  r.panels = panels;
  r.groups = w.size(1);
  r.n = n;
  return r;
}

template <typename W>
DenseRef<W> dense_ref(const torch::Tensor& w, const torch::Tensor& bias, int64_t n) {
  const auto dtype = sizeof(W) == 4 ? torch::kFloat : torch::kBFloat16;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous() && w.size(0) == n,
              "dense weight must be contiguous (N, K) ", sizeof(W) == 4 ? "fp32" : "bf16", ", N = ", n);
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat && bias.is_contiguous() && bias.numel() == n),
              "bias must be contiguous (N,) fp32");
  DenseRef<W> r;
  r.w = static_cast<const W*>(w.data_ptr());
  r.bias = has_bias ? bias.data_ptr<float>() : nullptr;
  r.panels = (n + kPanel - 1) / kPanel;
  r.k = w.size(1);
  r.n = n;
  return r;
}

// The weights of one layer from its tensors, per kind. int8, 15 tensors: norm1 (D,), qkv w/scale/corr/bias (bias
// may be empty), o w/scale/corr, norm2 (D,), gate_up w/scale/corr (gate panels first, then up), down w/scale/corr.
// fp32, 7 tensors: norm1, qkv (Dq + 2 Dkv, D), qkv bias (Dq + 2 Dkv,) (may be empty), o (D, Dq), norm2,
// gate_up (2 I, D) (gate rows first, then up), down (D, I).
constexpr int tensors_per_layer(const Layer<PackedRef>*) { return 15; }
template <typename W>
constexpr int tensors_per_layer(const Layer<DenseRef<W>>*) { return 7; }

void bind_layer(Layer<PackedRef>& l, const torch::Tensor* t, int64_t d, int64_t qkv_n, int64_t i) {
  l.norm1 = t[0];
  l.norm2 = t[8];
  l.qkv = packed_ref(t[1], t[2], t[3], t[4], qkv_n);
  l.o = packed_ref(t[5], t[6], t[7], torch::Tensor(), d);
  l.gate_up = packed_ref(t[9], t[10], t[11], torch::Tensor(), 2 * i);
  l.down = packed_ref(t[12], t[13], t[14], torch::Tensor(), d);
}

template <typename W>
void bind_layer(Layer<DenseRef<W>>& l, const torch::Tensor* t, int64_t d, int64_t qkv_n, int64_t i) {
  l.norm1 = t[0];
  l.norm2 = t[4];
  l.qkv = dense_ref<W>(t[1], t[2], qkv_n);
  l.o = dense_ref<W>(t[3], torch::Tensor(), d);
  l.gate_up = dense_ref<W>(t[5], torch::Tensor(), 2 * i);
  l.down = dense_ref<W>(t[6], torch::Tensor(), d);
  TORCH_CHECK(l.qkv.k == d && l.gate_up.k == d, "q/k/v and gate/up take D inputs");  // rows read exactly K
}

// The speech head from its tensors: int8 w, scale, corr, bias (bias may be empty); fp32 w (N, D), bias (N,).
template <typename Ref>
Ref bind_head(const std::vector<torch::Tensor>& t, int64_t n);

template <>
PackedRef bind_head<PackedRef>(const std::vector<torch::Tensor>& t, int64_t n) {
  TORCH_CHECK(t.size() == 4, "int8 head: w, scale, corr, bias");
  return packed_ref(t[0], t[1], t[2], t[3], n);
}

template <>
F32Ref bind_head<F32Ref>(const std::vector<torch::Tensor>& t, int64_t n) {
  TORCH_CHECK(t.size() == 2, "fp32 head: w, bias");
  return dense_ref<float>(t[0], t[1], n);
}

template <>
BF16Ref bind_head<BF16Ref>(const std::vector<torch::Tensor>& t, int64_t n) {
  TORCH_CHECK(t.size() == 2, "bf16 head: w, bias");
  return dense_ref<uint16_t>(t[0], t[1], n);
}

}  // namespace

// The decoder stack of one LLM for decode steps of 1..kMaxFusedRows single-query rows; Op: the weight kind
// (Int8Operand: int8 VNNI panels, F32Operand: fp32 (out, in) rows).
template <typename Op>
class DecodeStack {
 public:
  using Ref = typename Op::Ref;
  static constexpr int kTensors = tensors_per_layer(static_cast<const Layer<Ref>*>(nullptr));

  // layers: per layer the kind's tensors (see bind_layer)
  DecodeStack(std::vector<torch::Tensor> layers, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t intermediate, double eps)
      : d_(hidden), h_(num_heads), hkv_(num_kv_heads), dh_(head_dim), i_(intermediate), eps_(eps) {
    TORCH_CHECK(layers.size() % kTensors == 0 && !layers.empty(), kTensors, " tensors per layer");
    TORCH_CHECK(h_ % hkv_ == 0 && dh_ % 16 == 0 && dh_ <= 512, "heads must group, head_dim a multiple of 16");
    const int64_t q_dim = h_ * dh_, kv_dim = hkv_ * dh_;
    TORCH_CHECK(q_dim % kPanel == 0 && kv_dim % kPanel == 0 && i_ % kPanel == 0,
                "q, k and gate must be whole 64-channel panels");
    for (size_t b = 0; b < layers.size(); b += kTensors) {
      const torch::Tensor* t = layers.data() + b;
      Layer<Ref> l;
      bind_layer(l, t, d_, q_dim + 2 * kv_dim, i_);
      for (const auto& n : {l.norm1, l.norm2})
        TORCH_CHECK(n.scalar_type() == torch::kFloat && n.is_contiguous() && n.numel() == d_, "norm weight (D,)");
      TORCH_CHECK(l.qkv.in_width() - d_ < 4 && l.gate_up.in_width() - d_ < 4 && d_ <= l.qkv.in_width() &&
                  d_ <= l.gate_up.in_width(), "q/k/v and gate/up take D inputs");
      TORCH_CHECK(l.o.in_width() == q_dim && l.down.in_width() == i_, "o takes H*Dh inputs, down I");
      TORCH_CHECK(l.gate_up.panels == 2 * (i_ / kPanel), "gate/up: I/64 gate panels then I/64 up panels");
      TORCH_CHECK(l.o.panels * kPanel >= d_ && l.down.panels * kPanel >= d_, "o/down give D outputs");
      l.keep.assign(t, t + kTensors);
      layers_.push_back(std::move(l));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t max_rows() const { return kMaxFusedRows; }
  // how long a waiting thread lets another finish a claimed item before computing it too (0: at once; tests)
  void set_grace_ns(int64_t ns) { grace_ns_ = ns; }

  // The final RMSNorm (norm (D,), eps) and the speech head (N outputs; tensors: see bind_head), which
  // forward_logits runs as one more phase of the same parallel region (why: run on their own they cost a
  // thread-pool wake, a torch RMSNorm and a GEMV call per step, ~0.5 ms of a ~14 ms int8 batch-1 step).
  void set_head(torch::Tensor norm, std::vector<torch::Tensor> head, int64_t n, double eps) {
    TORCH_CHECK(norm.scalar_type() == torch::kFloat && norm.is_contiguous() && norm.numel() == d_, "norm (D,)");
    head_ = bind_head<Ref>(head, n);
    TORCH_CHECK(head_.in_width() - d_ < 4 && d_ <= head_.in_width(), "the head takes D inputs");
    head_norm_ = norm;
    head_eps_ = eps;
    head_keep_ = std::move(head);
    has_head_ = true;
  }
  bool has_head() const { return has_head_; }

  // as forward, then the final norm and the head: (M, N) fp32 logits of every row
  torch::Tensor forward_logits(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache,
                               torch::Tensor v_cache, torch::Tensor write_slots, torch::Tensor gather_slots,
                               torch::Tensor ctx_len) {
    TORCH_CHECK(has_head_, "set_head first");
    torch::Tensor logits = torch::empty({x.size(0), head_.n}, x.options());
    run(x, cos, sin_signed, k_cache, v_cache, write_slots, gather_slots, ctx_len, &logits);
    return logits;
  }

  // x (M, D) fp32, updated in place and returned: the hidden states after the last layer (before the final
  // norm). cos / sin_signed (M, Dh): rotary tables of each row's position (sin's first half negated, as
  // model_runner._rope); k_cache / v_cache (L, S, Hkv, Dh) fp32: each row's new K/V is written at
  // write_slots[m]; gather_slots (M, Lmax) int64: row m's context slots in position order, of which the first
  // ctx_len[m] are real (the last being its own new position).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor write_slots, torch::Tensor gather_slots,
                        torch::Tensor ctx_len) {
    run(x, cos, sin_signed, k_cache, v_cache, write_slots, gather_slots, ctx_len, nullptr);
    return x;
  }

 private:
  // forward's work; logits (M, N) non-null: also the final norm and the head
  void run(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed, torch::Tensor& k_cache,
           torch::Tensor& v_cache, const torch::Tensor& write_slots, const torch::Tensor& gather_slots,
           const torch::Tensor& ctx_len, torch::Tensor* logits) {
    const int64_t m_rows = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == d_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
                "x must be contiguous (M, D) fp32");
    TORCH_CHECK(m_rows >= 1 && m_rows <= kMaxFusedRows, "1..", kMaxFusedRows, " rows");
    const int64_t n_layers = num_layers();
    for (const auto* c : {&k_cache, &v_cache})
      TORCH_CHECK(c->dim() == 4 && c->size(0) == n_layers && c->size(2) == hkv_ && c->size(3) == dh_ &&
                  c->scalar_type() == torch::kFloat && c->is_contiguous(), "cache must be (L, S, Hkv, Dh) fp32");
    for (const auto* r : {&cos, &sin_signed})
      TORCH_CHECK(r->scalar_type() == torch::kFloat && r->numel() == m_rows * dh_ && r->is_contiguous(),
                  "rotary tables (M, Dh) fp32");
    TORCH_CHECK(write_slots.scalar_type() == torch::kLong && write_slots.numel() == m_rows &&
                ctx_len.scalar_type() == torch::kLong && ctx_len.numel() == m_rows &&
                gather_slots.scalar_type() == torch::kLong && gather_slots.dim() == 2 &&
                gather_slots.size(0) == m_rows && gather_slots.is_contiguous() && write_slots.is_contiguous() &&
                ctx_len.is_contiguous(), "slots: int64 (M,), (M, Lmax), (M,)");
    const int64_t slots = k_cache.size(1), lmax = gather_slots.size(1);
    const int64_t* ws = write_slots.data_ptr<int64_t>();
    const int64_t* gs = gather_slots.data_ptr<int64_t>();
    const int64_t* cl = ctx_len.data_ptr<int64_t>();
    for (int64_t m = 0; m < m_rows; ++m) {
      TORCH_CHECK(cl[m] >= 1 && cl[m] <= lmax && ws[m] >= 0 && ws[m] < slots, "row ", m, ": bad context/slot");
      TORCH_CHECK(gs[m * lmax + cl[m] - 1] == ws[m], "row ", m, ": its last context slot must be its new one");
      for (int64_t t = 0; t < cl[m]; ++t) TORCH_CHECK(gs[m * lmax + t] >= 0 && gs[m * lmax + t] < slots, "slot");
    }

    const int mr = static_cast<int>(m_rows);
    const int64_t q_dim = h_ * dh_, kv_dim = hkv_ * dh_, g_heads = h_ / hkv_;
    const int64_t qkv_width = layers_[0].qkv.panels * kPanel;
    const Layer<Ref>& l0 = layers_[0];
    const int64_t k_max = std::max({l0.qkv.in_width(), l0.o.in_width(), l0.down.in_width(), head_.in_width()});
    // shared between threads
    // shared, one set per layer: an item may be finished twice (see run_phase), and a late duplicate must never
    // overwrite a later layer's values. Layer li reads xs[2 li], writes xs[2 li + 1] (after o_proj) and
    // xs[2 li + 2] (its output); x is xs[0].
    std::vector<float> qkv(n_layers * m_rows * qkv_width), attn(n_layers * m_rows * q_dim),
        act(n_layers * m_rows * i_), xs((2 * n_layers + 1) * m_rows * d_);
    std::copy(x.data_ptr<float>(), x.data_ptr<float>() + m_rows * d_, xs.data());
    const float* cosd = cos.data_ptr<float>();
    const float* sind = sin_signed.data_ptr<float>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(dh_));
    const int nt_want = std::max(1, at::get_num_threads());

    // one pair of counters per (layer, phase): 5 phases per layer, then the head's
    std::unique_ptr<Phase[]> phases(new Phase[n_layers * 5 + 1]);
    int64_t n_flags = 0;
    // GEMV work items: one panel, or (int8) two for one row (two streams)
    const int64_t per_item = Op::kTwoPanelItems && m_rows == 1 ? 2 : 1;
    auto items = [&](const Ref& w) { return (w.panels + per_item - 1) / per_item; };
    for (const Layer<Ref>& l : layers_)
      n_flags += items(l.qkv) + m_rows * hkv_ + items(l.o) + l.gate_up.panels / 2 + items(l.down);
    const int64_t head_items = logits != nullptr ? items(head_) : 0;
    n_flags += head_items;
    std::unique_ptr<std::atomic<uint8_t>[]> flags(new std::atomic<uint8_t>[n_flags]);
    for (int64_t i = 0; i < n_flags; ++i) flags[i].store(0, std::memory_order_relaxed);
    {
      int64_t at = 0;
      for (int64_t li = 0; li < n_layers; ++li) {
        const Layer<Ref>& l = layers_[li];
        const int64_t counts[5] = {items(l.qkv), m_rows * hkv_, items(l.o), l.gate_up.panels / 2, items(l.down)};
        for (int k = 0; k < 5; ++k) {
          phases[li * 5 + k].item_done = flags.get() + at;
          at += counts[k];
        }
      }
      phases[n_layers * 5].item_done = flags.get() + at;
    }
    float* logits_d = logits != nullptr ? logits->data_ptr<float>() : nullptr;

#pragma omp parallel num_threads(nt_want)
    {
      // this thread's own buffers
      std::vector<float> h(m_rows * d_), v(2 * kMaxFusedRows * kPanel);
      Op op(m_rows, k_max);
      std::vector<float> qh(g_heads * dh_), scores(g_heads * lmax), oacc(g_heads * dh_), inv_sum(g_heads);

      auto norm_in = [&](const float* xin, const float* w, const Ref& ref, double eps) {  // h = norm(x) -> operand
        for (int64_t m = 0; m < m_rows; ++m)
          rms_norm_row(xin + m * d_, w, d_, static_cast<float>(eps), &h[m * d_]);
        op.set(h.data(), mr, d_, ref);
      };
      // residual: xout[:, panel p] = xin[:, panel p] + v, for the real columns
      auto residual = [&](const float* xin, float* xout) {
        return [=](int64_t p, const float* vp) {
          const int64_t c0 = p * kPanel, c1 = std::min(d_, c0 + kPanel);
          for (int64_t m = 0; m < m_rows; ++m)
            for (int64_t c = c0; c < c1; ++c) xout[m * d_ + c] = xin[m * d_ + c] + vp[m * kPanel + c - c0];
        };
      };
      auto gemv_item = [&](const Ref& w, int64_t i, auto&& fn) {
        op.gemv(w, i * per_item, std::min(w.panels, (i + 1) * per_item), mr, v.data(), fn);
      };

      for (int64_t li = 0; li < n_layers; ++li) {
        const Layer<Ref>& l = layers_[li];
        float* kcl = kc + li * slots * kv_dim;
        float* vcl = vc + li * slots * kv_dim;
        Phase* ph = &phases[li * 5];
        const float* x_in = &xs[2 * li * m_rows * d_];
        float* x_mid = &xs[(2 * li + 1) * m_rows * d_];
        float* x_out = &xs[(2 * li + 2) * m_rows * d_];
        float* qkv_l = &qkv[li * m_rows * qkv_width];
        float* attn_l = &attn[li * m_rows * q_dim];
        float* act_l = &act[li * m_rows * i_];

        // ---- q, k, v (+ bias)
        run_phase(ph[0], items(l.qkv), grace_ns_,
                  [&] { norm_in(x_in, l.norm1.template data_ptr<float>(), l.qkv, eps_); },
                  [&](int64_t i) {
                    gemv_item(l.qkv, i, [&](int64_t p, const float* vp) {
                      for (int64_t m = 0; m < m_rows; ++m)
                        std::copy(vp + m * kPanel, vp + (m + 1) * kPanel, &qkv_l[m * qkv_width + p * kPanel]);
                    });
                  });
        // ---- rotary, cache write, attention: one item per (row, kv head)
        run_phase(ph[1], m_rows * hkv_, grace_ns_, [] {}, [&](int64_t item) {
          const int64_t m = item / hkv_, j = item % hkv_, half = dh_ / 2;
          const float* row = &qkv_l[m * qkv_width];
          const float* cm = cosd + m * dh_;
          const float* sm = sind + m * dh_;
          auto rope = [&](const float* src, float* dst, float mul) {
            for (int64_t e = 0; e < dh_; ++e)
              dst[e] = (src[e] * cm[e] + src[e < half ? e + half : e - half] * sm[e]) * mul;
          };
          rope(row + q_dim + j * dh_, kcl + (ws[m] * hkv_ + j) * dh_, 1.f);
          std::copy(row + q_dim + kv_dim + j * dh_, row + q_dim + kv_dim + (j + 1) * dh_,
                    vcl + (ws[m] * hkv_ + j) * dh_);
          for (int64_t g = 0; g < g_heads; ++g) rope(row + (j * g_heads + g) * dh_, &qh[g * dh_], scale);
          const int64_t c = cl[m];
          const int64_t* slot = gs + m * lmax;
          for (int64_t s = 0; s < c; ++s) {  // scores (G, C)
            const float* kt = kcl + (slot[s] * hkv_ + j) * dh_;
            for (int64_t g = 0; g < g_heads; ++g) scores[g * c + s] = decodemath::dot(&qh[g * dh_], kt, dh_);
          }
          for (int64_t g = 0; g < g_heads; ++g) {  // softmax numerators in place, 1 / their sum
            float* sg = &scores[g * c];
            float mx = -INFINITY;
            for (int64_t s = 0; s < c; ++s) mx = std::max(mx, sg[s]);
            inv_sum[g] = 1.f / decodemath::exp_shifted(sg, c, mx);
          }
          std::fill(oacc.begin(), oacc.end(), 0.f);
          for (int64_t s = 0; s < c; ++s) {  // o (G, Dh) = p @ V
            const float* vt = vcl + (slot[s] * hkv_ + j) * dh_;
            for (int64_t g = 0; g < g_heads; ++g) decodemath::axpy(scores[g * c + s], vt, &oacc[g * dh_], dh_);
          }
          for (int64_t g = 0; g < g_heads; ++g)
            for (int64_t e = 0; e < dh_; ++e)
              attn_l[m * q_dim + (j * g_heads + g) * dh_ + e] = oacc[g * dh_ + e] * inv_sum[g];
        });
        // ---- o_proj + residual
        run_phase(ph[2], items(l.o), grace_ns_,
                  [&] { op.set(attn_l, mr, q_dim, l.o); },
                  [&](int64_t i) { gemv_item(l.o, i, residual(x_in, x_mid)); });
        // ---- gate/up (pairs: gate panel p with up panel p + I/64), SiLU(gate) * up
        const int64_t pairs = l.gate_up.panels / 2;
        run_phase(ph[3], pairs, grace_ns_,
                  [&] { norm_in(x_mid, l.norm2.template data_ptr<float>(), l.gate_up, eps_); },
                  [&](int64_t p) {
                    float* vg = v.data();
                    float* vu = v.data() + kMaxFusedRows * kPanel;
                    op.pair(l.gate_up, p, p + pairs, mr, vg, vu);
                    for (int64_t m = 0; m < m_rows; ++m)
                      decodemath::silu_mul(vg + m * kPanel, vu + m * kPanel, &act_l[m * i_ + p * kPanel], kPanel);
                  });
        // ---- down_proj + residual
        run_phase(ph[4], items(l.down), grace_ns_,
                  [&] { op.set(act_l, mr, i_, l.down); },
                  [&](int64_t i) { gemv_item(l.down, i, residual(x_mid, x_out)); });
      }
      // ---- final norm + head: logits[:, panel p], the real columns
      if (logits_d != nullptr)
        run_phase(phases[n_layers * 5], head_items, grace_ns_,
                  [&] { norm_in(&xs[2 * n_layers * m_rows * d_], head_norm_.data_ptr<float>(), head_, head_eps_); },
                  [&](int64_t i) {
                    gemv_item(head_, i, [&](int64_t p, const float* vp) {
                      const int64_t c0 = p * kPanel, c1 = std::min(head_.n, c0 + kPanel);
                      for (int64_t m = 0; m < m_rows; ++m)
                        std::copy(vp + m * kPanel, vp + m * kPanel + (c1 - c0), logits_d + m * head_.n + c0);
                    });
                  });
    }
    std::copy(xs.end() - m_rows * d_, xs.end(), x.data_ptr<float>());
  }

  int64_t d_, h_, hkv_, dh_, i_;
  double eps_;
  int64_t grace_ns_ = Op::kGraceNs;
  std::vector<Layer<Ref>> layers_;
  bool has_head_ = false;
  Ref head_{};
  torch::Tensor head_norm_;
  double head_eps_ = 0;
  std::vector<torch::Tensor> head_keep_;  // the tensors head_ points into
};

template <typename Stack>
void bind_stack(pybind11::module_& m, const char* name) {
  pybind11::class_<Stack>(m, name)
      .def(pybind11::init<std::vector<torch::Tensor>, int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("num_layers", &Stack::num_layers)
      .def("max_rows", &Stack::max_rows)
      .def("set_grace_ns", &Stack::set_grace_ns)
      .def("set_head", &Stack::set_head)
      .def("has_head", &Stack::has_head)
      .def("forward", &Stack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_logits", &Stack::forward_logits, pybind11::call_guard<pybind11::gil_scoped_release>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // both release the GIL while they run (as torch's own ops do): a decode step holds no Python state, and the
  // token2wav thread can run Python meanwhile
  m.def("int8_linear", &int8_linear, "y = x @ dequant(w).T + bias through the int8 kernel (int8_gemv*.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  bind_stack<DecodeStack<Int8Operand>>(m, "DecodeStack");  // int8 weights
  bind_stack<DecodeStack<F32Operand>>(m, "F32DecodeStack");  // fp32 weights
  bind_stack<DecodeStack<BF16Operand>>(m, "BF16DecodeStack");  // bf16 weights
#ifdef __AVX512F__  // the estimator's bf16 kernels are AVX-512 only (the avx2 build has none)
  bf16gemm::bind(m);  // the estimator's bf16 GEMM (bf16_gemm.cpp)
  bf16attn::bind(m);  // and its bf16 attention (bf16_attention.cpp)
  bf16block::bind(m);  // and a whole transformer block of it (bf16_block.cpp)
#endif
#ifdef __AVX512F__  // which source set this module was built from (build.py)
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
}
