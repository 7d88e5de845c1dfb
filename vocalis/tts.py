"""`TTS`: the public façade. Load a model, pick or make a voice, get audio whole or streamed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from vocalis.config import PROMPT_SAMPLE_RATE_16K, MAX_PROMPT_SECONDS
from vocalis.runtime.backends import Runtime, apply_backend, resolve
from vocalis.errors import InputError
from vocalis.frontend import audio as audio_fe
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.reference.synthesizer import AudioSource, Synthesizer
from vocalis.model_dir import LoadedModel, load_model
from vocalis.frontend.voice import Voice, check_voice_name


class TTS:
    """Speech from text with a CosyVoice 2-architecture model.

    >>> tts = TTS.load()                      # built-in model; or TTS.load("path/to/CosyVoice2-0.5B")
    >>> wav = tts.synthesize("Hello there.")   # (N,) float32 at tts.sample_rate
    >>> for chunk in tts.stream("Hello there.", prompt_wav="me.wav", prompt_text="what I said"):
    ...     play(chunk.samples)
    """

    def __init__(self, model: LoadedModel):
        self.model = model
        self.synth = Synthesizer(model)
        self._voices: dict[str, Voice] = dict(model.voices)

    @classmethod
    def load(cls, path: str | Path | None = None, device: str | torch.device = "cpu", *, backend: str = "torch",
             precision: str = "fp32") -> TTS:
        """A model directory (official CosyVoice2 or Vocalis layout), or None for the built-in model.

        backend: torch | onnx | tensorrt | compile | vllm | auto; precision: fp32 | bf16 | fp16 | int8 | auto
        (see `vocalis.runtime.backends`; an unavailable choice raises InputError saying what to install).
        """
        dev = torch.device(device)
        resolve(backend, precision, dev)  # fail fast, before loading
        model = load_model(path).to(dev)
        apply_backend(model, backend, precision, dev)
        return cls(model)

    @property
    def runtime(self) -> Runtime | None:
        """The backend and precision in use (`apply_backend` records them on the model; None: nothing applied)."""
        return self.model.runtime

    @property
    def sample_rate(self) -> int:
        return self.synth.sample_rate

    @property
    def voices(self) -> list[str]:
        return sorted(self._voices)

    def voice(self, name: str) -> Voice:
        try:
            return self._voices[name]
        except KeyError:
            known = ", ".join(self.voices) or "none"
            raise InputError(f"unknown voice {name!r} (known voices: {known})") from None

    def add_voice(self, name: str, prompt_wav: AudioSource, prompt_text: str = "", language: str = "auto") -> Voice:
        """Make a reusable voice from a recording (and its transcript, for zero-shot cloning)."""
        voice = self.synth.make_voice(prompt_wav, prompt_text, check_voice_name(name), language)
        self._voices[name] = voice
        return voice

    # ---- synthesis -----------------------------------------------------------------------------------
    def _request(
        self,
        text: str | Iterable[str],
        voice: str | Voice | None,
        prompt_wav: AudioSource | None,
        prompt_text: str | None,
        instruct: str | None,
        speed: float,
        seed: int | None,
        language: str,
        text_frontend: bool,
    ) -> SynthesisRequest:
        if prompt_wav is not None and voice is not None:
            raise InputError("give either a voice or a prompt recording, not both")
        if prompt_wav is not None:
            chosen = self.synth.make_voice(prompt_wav, prompt_text or "", language=language)
        elif isinstance(voice, Voice):
            chosen = voice
        elif voice is not None:
            chosen = self.voice(voice)
        elif self._voices:
            chosen = self._voices[self.voices[0]]
        else:
            raise InputError("this model has no built-in voices: pass voice=... or prompt_wav=...")
        if instruct:
            mode = Mode.INSTRUCT
        elif not chosen.has_prompt_speech:
            mode = Mode.SFT
        elif chosen.prompt_text_ids:
            mode = Mode.ZERO_SHOT
        else:
            mode = Mode.CROSS_LINGUAL
        return SynthesisRequest(chosen, mode, text, instruct or "", (), speed, seed, language, text_frontend)

    def stream(
        self,
        text: str | Iterable[str],
        *,
        voice: str | Voice | None = None,
        prompt_wav: AudioSource | None = None,
        prompt_text: str | None = None,
        instruct: str | None = None,
        speed: float = 1.0,
        seed: int | None = None,
        language: str = "auto",
        text_frontend: bool = True,
    ) -> Iterator[AudioChunk]:
        """Audio chunks as they are made. `text` may be an iterable of pieces still being written."""
        request = self._request(text, voice, prompt_wav, prompt_text, instruct, speed, seed, language, text_frontend)
        return self.synth.run(request, stream=True)

    def synthesize(
        self,
        text: str,
        *,
        voice: str | Voice | None = None,
        prompt_wav: AudioSource | None = None,
        prompt_text: str | None = None,
        instruct: str | None = None,
        speed: float = 1.0,
        seed: int | None = None,
        language: str = "auto",
        text_frontend: bool = True,
    ) -> np.ndarray:
        """The whole utterance: (N,) float32 at `sample_rate`."""
        request = self._request(text, voice, prompt_wav, prompt_text, instruct, speed, seed, language, text_frontend)
        return np.concatenate([c.samples for c in self.synth.run(request, stream=False)])

    def convert_voice(
        self,
        source_wav: AudioSource,
        *,
        voice: str | Voice | None = None,
        prompt_wav: AudioSource | None = None,
        speed: float = 1.0,
        seed: int | None = None,
        stream: bool = False,
    ) -> Iterator[AudioChunk]:
        """Voice conversion: say what `source_wav` says in the target voice (no LLM)."""
        target = self._request("-", voice, prompt_wav, None, None, speed, seed, "auto", False).voice
        source = audio_fe.load_wav(source_wav, PROMPT_SAMPLE_RATE_16K, max_seconds=MAX_PROMPT_SECONDS)
        request = SynthesisRequest(target, Mode.VC, "", "", self.synth.speech_tokens(source), speed, seed)
        return self.synth.run(request, stream=stream)
