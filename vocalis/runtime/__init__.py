"""What runs a loaded model: backend and precision choice (`backends`), the async engine loop that serves every
entry point (`async_engine`), and the exported ONNX / TensorRT parts."""
