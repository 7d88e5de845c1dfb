"""The async engine loop that serves every entry point (`async_engine`): one thread interleaving batched LLM and
token2wav steps, its policies (`step_grouping`, `admission`, `rate`), the handles callers iterate (`handle`), the
bi-stream text reader (`text_pump`) and the blocking face over it (`sync`)."""
