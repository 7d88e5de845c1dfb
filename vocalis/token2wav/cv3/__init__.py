"""CosyVoice 3's token2wav: the DiT flow over block-causal attention caches and the causal HiFT vocoder on a
window of the mel (`engine.CV3Token2WavEngine`), on the official call schedule (`schedule`)."""

from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.token2wav.cv3.engine import CV3Token2WavEngine
from vocalis.token2wav.cv3.state import CV3StreamState
from vocalis.token2wav.protocol import Token2WavFamily

FAMILY = Token2WavFamily("CosyVoice 3", CausalMaskedDiffWithDiT, CausalHiFTGenerator, CV3Token2WavEngine)

__all__ = ["FAMILY", "CV3StreamState", "CV3Token2WavEngine"]
