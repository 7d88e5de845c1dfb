// The extension's Python module: the int8 GEMV, the fused decode stacks of the three weight kinds
// (int8_decode.cpp) and the estimator's kernels: bf16 ones in the avx512 set, fp32 attention in both.
// Last in every source set (kernels/build.py).
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
  fp32attn::bind(m);  // the estimator's fp32 attention (fp32_attention_avx2.cpp, AVX2 code in both sets)
  convcols::bind(m);  // a causal conv's GEMM input from its cached context (conv_columns.cpp, ISA-free)
  fp32pw::bind(m);  // and its conv blocks' LayerNorm + Mish (fp32_pointwise_avx2.cpp, likewise)
  // ATen's parallel_for sets a thread's intra-op thread count from the process default on its first call in that
  // thread, and the once-per-thread flag is an inline function's thread_local: this module holds its own copy. A
  // thread that set its own count (kernels.threads.CoreWorkers: 1) had it reset by this module's first parallel
  // op; such a thread calls this first, then sets its count.
  m.def("init_threads", [] { at::internal::lazy_init_num_threads(); },
        "run this module's copy of ATen's per-thread intra-op set-up in the calling thread now");
#ifdef __AVX512F__  // which source set this module was built from (build.py)
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
}
