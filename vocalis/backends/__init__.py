"""Who runs what, in which precision: the choice (`choice`: resolve, apply to a loaded model, report as `Runtime`)
and the runtimes it can hand parts of the model to (ONNX Runtime, TensorRT, vLLM)."""
