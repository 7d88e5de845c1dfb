"""The LLM's KV pool as an entry point loads it: sized by the requests it admits, not by the fixed budget."""

from __future__ import annotations

from vocalis.engine.config import EngineConfig
from vocalis.engine.model_runner import kv_bytes_per_block
from vocalis.model_options import KV_POSITIONS_PER_STREAM, ModelOptions


def test_builtin_model_pool_holds_its_streams_and_serves() -> None:
    tts = ModelOptions(max_streams=4).load(None)
    cfg = tts.engine_config
    per_block = kv_bytes_per_block(tts.model.llm, cfg.block_size)
    assert cfg.max_num_seqs == 4
    assert cfg.kv_cache_bytes == 4 * KV_POSITIONS_PER_STREAM * per_block // cfg.block_size
    assert cfg.kv_cache_bytes < EngineConfig().kv_cache_bytes  # a small model's pool is its streams' need
    with tts:
        llm = tts.engine.llm
        assert llm.block_manager.num_blocks * cfg.block_size == 4 * KV_POSITIONS_PER_STREAM
        assert len(tts.synthesize("Good morning, how are you?", seed=0)) > 0


def test_without_a_cap_the_fixed_budget_stays() -> None:
    assert ModelOptions(max_streams=0).load(None).engine_config is None  # the engine's own defaults
