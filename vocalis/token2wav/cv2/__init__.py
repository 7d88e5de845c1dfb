"""CosyVoice 2's token2wav: the chunk-causal conformer + U-Net flow run incrementally over per-request caches, and
the HiFT vocoder with its seam caches (`engine.Token2WavEngine`)."""

from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.token2wav.cv2.engine import Token2WavEngine
from vocalis.token2wav.cv2.state import StreamState
from vocalis.token2wav.protocol import Token2WavFamily

FAMILY = Token2WavFamily("CosyVoice 2", CausalMaskedDiffWithXvec, HiFTGenerator, Token2WavEngine)

__all__ = ["FAMILY", "StreamState", "Token2WavEngine"]
