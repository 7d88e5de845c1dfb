"""The fast engine: paged-KV LLM engine with continuous batching, batched token2wav, async front.

Seams (nano-vllm shaped): `request` is data; `block_manager` and `scheduler` are pure Python policy;
`model_runner` holds tensors and no policy; `sampler` works on per-row tensors; `llm_engine` ties them into
`step()`; `async_engine` owns the single loop thread that interleaves LLM steps with token2wav steps.
Nothing is imported here, so importing a submodule stays cheap.
"""
