"""Who runs what, in which precision: the choice (`choice`: resolve, apply to a loaded model, report as `Runtime`)
and the runtimes it can hand parts of the model to (ONNX Runtime, TensorRT, vLLM)."""

# The names `backends.choice.resolve` takes; here, away from torch, so that argument parsing can check them.
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8")
BACKENDS = ("auto", "torch", "onnx", "tensorrt", "compile", "vllm")
