"""CosyVoice 3 (Fun-CosyVoice3-0.5B) modules: `CosyVoice3LM`, the DiT flow, the causal HiFT.

Parameter names equal the official `llm.pt` / `flow.pt` / `hift.pt` keys, so the released files load strictly.
The modules hold maths only: decoding loops, streaming schedules and caches belong to their callers.
"""
