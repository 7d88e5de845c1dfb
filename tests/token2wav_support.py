"""One request through a CosyVoice 2 token2wav engine, for tests that compare engines' audio."""

from __future__ import annotations

import numpy as np
import torch

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.cv2.engine import Token2WavEngine


def audio_of(engine: Token2WavEngine, prompt: FlowPrompt, tokens: list[int], seed: int) -> np.ndarray:
    """A streaming request fed every token at once and stepped alone to its end -> its audio (N,) float32."""
    state = engine.new_stream("a", prompt, streaming=True, generator=torch.Generator().manual_seed(seed))
    state.add_tokens(tokens)
    state.end_input()
    chunks = []
    while not state.finished:
        chunks += [c.samples for c in engine.step([state])]
    return np.concatenate(chunks)
