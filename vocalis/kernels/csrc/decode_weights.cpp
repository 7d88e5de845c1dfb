// The weights of the fused decode step (int8_decode.cpp), per kind: raw references into the tensors the stack
// keeps alive (PackedRef: int8 VNNI panels of int8_gemv*.cpp; DenseRef: fp32 or bf16 (out, in) rows), the GEMV
// of one panel over them, and the binding of a layer's and the speech head's tensors to them.
//
// Legend: M rows, D hidden, I intermediate, N outputs, K inputs, Kp K padded to whole groups of 4.
namespace {

// Rows of a fused step: tiles of up to kMaxTile rows (a tile's accumulators stay in registers); the weights a tile
// reads (a block of an int8 panel, one fp32/bf16 weight row) are still in L1 for the next tile, so a step of 16
// rows streams its weights from memory once, as a step of one does.
constexpr int kMaxFusedRows = 16;

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
  const int64_t kp = w.groups * 4;
  if (m_rows <= kMaxTile) {
    kBlocks[m_rows](w.panel(p), xq, kp, 0, w.groups, acc);
    return;
  }
  for (int64_t g0 = 0; g0 < w.groups; g0 += kChunkGroups) {  // a block of the panel, then every row tile over it
    const int64_t g1 = std::min<int64_t>(w.groups, g0 + kChunkGroups);
    for (int m0 = 0; m0 < m_rows; m0 += kMaxTile)
      kBlocks[std::min(kMaxTile, m_rows - m0)](w.panel(p), xq + m0 * kp, kp, g0, g1, acc + m0 * kPanel);
  }
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

// out[m * 64] = x row m . w's row, for mt (1..kMaxTile) rows: the row count as a template argument, by recursion
template <typename W, int MT = 1>
void dense_row_tile(int mt, const W* w, int64_t k, const float* x, int64_t ldx, float* out) {
  if constexpr (MT < kMaxTile) {
    if (mt > MT) return dense_row_tile<W, MT + 1>(mt, w, k, x, ldx, out);
  }
  decodemath::dense_row<W, MT>(w, k, x, ldx, out);
}

// v (M, 64) = x (M, ldx) . panel p of w (+ bias) for m_rows (1..kMaxFusedRows) rows; channels past N give 0. Per
// weight row the rows go in tiles of up to kMaxTile, so the row is read from memory once and from L1 by later tiles.
template <typename W>
void dense_panel_rows(int m_rows, const DenseRef<W>& w, int64_t p, const float* x, int64_t ldx, float* v) {
  const int64_t c0 = p * kPanel, nc = std::min<int64_t>(kPanel, w.n - c0);
  const W* wp = w.w + c0 * w.k;
  for (int64_t c = 0; c < nc; ++c)
    for (int m0 = 0; m0 < m_rows; m0 += kMaxTile)
      dense_row_tile<W>(std::min(kMaxTile, m_rows - m0), wp + c * w.k, w.k, x + m0 * ldx, ldx, v + m0 * kPanel + c);
  for (int m = 0; m < m_rows; ++m) {
    for (int64_t c = nc; c < kPanel; ++c) v[m * kPanel + c] = 0.f;
    if (w.bias)
      for (int64_t c = 0; c < nc; ++c) v[m * kPanel + c] += w.bias[c0 + c];
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
