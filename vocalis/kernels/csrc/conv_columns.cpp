// A stride-1 conv's GEMM input (im2col) built from its left context and its new frames in one copy: ISA-free C++,
// in both source sets. The layout is precision/conv_gemm.py's: output frame i's taps side by side, tap j's channels
// at [j * C, (j + 1) * C).
//
// Why: the estimator's causal convs get their left context from a cache, so torch builds the columns as a
// concatenation of (context, frames) and then of k shifted views, two copies with a layout transpose between; here
// each tap row is copied once from wherever its frame lies (one memcpy per tap where frames are stored time-major).

#include <cstring>

namespace convcols {

// One frame's C channels, `stride` elements apart, to dst (contiguous).
inline void frame(const char* src, int64_t stride, int64_t C, int64_t size, char* dst) {
  if (stride == 1) {
    std::memcpy(dst, src, C * size);
    return;
  }
  for (int64_t c = 0; c < C; ++c) std::memcpy(dst + c * size, src + c * stride * size, size);
}

// left (B, C, ctx), x (B, C, n): one dtype, any strides -> (B, ctx + n - k + 1, k * C) contiguous, output frame i
// holding frames i .. i + k - 1 of (left, x) side by side.
torch::Tensor columns(const torch::Tensor& left, const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(left.dim() == 3 && x.dim() == 3 && left.size(0) == x.size(0) && left.size(1) == x.size(1) &&
              left.scalar_type() == x.scalar_type() && x.device().is_cpu() && left.device().is_cpu(),
              "conv columns: left (B, C, ctx) and x (B, C, n) of one dtype on the CPU");
  const int64_t B = x.size(0), C = x.size(1), ctx = left.size(2), n = x.size(2), out_n = ctx + n - k + 1;
  TORCH_CHECK(k >= 1 && out_n >= 0, "conv columns: fewer frames than taps");
  torch::Tensor out = torch::empty({B, out_n, k * C}, x.options());
  const int64_t size = x.element_size();
  const char* lp = static_cast<const char*>(left.data_ptr());
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, B * out_n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / out_n, i = r % out_n;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t f = i + j;  // frame of (left, x)
        char* dst = op + (r * k + j) * C * size;
        if (f < ctx)
          frame(lp + (b * left.stride(0) + f * left.stride(2)) * size, left.stride(1), C, size, dst);
        else
          frame(xp + (b * x.stride(0) + (f - ctx) * x.stride(2)) * size, x.stride(1), C, size, dst);
      }
    }
  });
  return out;
}

void bind(pybind11::module& m) {
  m.def("conv_columns", &columns, "a stride-1 conv's GEMM input from its left context and new frames",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace convcols
