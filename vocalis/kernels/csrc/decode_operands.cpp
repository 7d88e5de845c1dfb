// The operands of the fused decode step's GEMVs (int8_decode.cpp), one class per weight kind (decode_weights.cpp):
// what a thread prepares of a phase's input rows, and how it runs that phase's panels.
namespace {

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

}  // namespace
