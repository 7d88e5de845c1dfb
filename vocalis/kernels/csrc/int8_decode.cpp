// The decoder stack's decode step for a few single-query rows in one native call (see engine/decode_stack.py), over
// int8 weights (the VNNI panels of int8_gemv.cpp) or fp32 weights (their (out, in) rows): one `DecodeStack`
// template, its weight kind an operand class (Int8Operand / F32Operand) that owns the GEMV of one panel.
//
// Compiled in one translation unit (kernels/build.py joins a source set in order) after int8_gemv*.cpp and
// decode_math*.cpp, whose panel kernels, row quantizer and vector pieces it uses, decode_weights.cpp (the weight
// kinds and their binding) and decode_operands.cpp (a phase's GEMV per kind); module.cpp, after it, binds it.
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

using decodemath::rms_norm_row;

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
