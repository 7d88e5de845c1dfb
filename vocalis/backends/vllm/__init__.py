"""The vLLM backend for the LLM: export, the worker process, and the engine that talks to it."""
