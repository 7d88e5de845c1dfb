"""Helpers of the CosyVoice 3 parity tests (the `cv3_dir` / `cv3_model` fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from vocalis.config import StreamConfig

ATOL = 1e-4  # fp32 against the official modules
ZS_PROMPT_TEXT_IDS = (9906, 1879, 13)  # the `zs` speaker's transcript ids (any ids: the fixture's table is full size)


def cv3_reference(cv3_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(cv3_dir / "reference" / f"{name}.pt", weights_only=True)


def max_diff(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference (printed, so `pytest -s` shows the margins); shapes must match exactly."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    print(f"[cv3 parity] {name}: max abs diff {diff:.3e}")
    return diff


def state_dict_shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}


def make_cv3_model_dir(directory: Path, cv3_dir: Path, long_spoken: bool = True, clone: bool = False) -> Path:
    """The compat_cv3 folder as a servable model directory: the bundled (small) Qwen tokenizer in
    `CosyVoice-BlankEN/` (the fixture has none) and a `spk2info.pt` with an sft speaker `default` (embedding only)
    and a zero-shot one `zs` (the ref_stream prompt). Large files are links.

    clone: also a tiny `speech_tokenizer_v3.onnx` (ids below the fixture's speech vocabulary) and `campplus.onnx`
    (`tiny_assets.write_frontend_onnx`; needs the onnx package), so voices can be made from audio.

    long_spoken: the speech head's 200 stop rows are zeroed, so with top-k sampling the random LLM rarely stops
    before max_len (20 speech ids per text id) and a short text spans several stream chunks; left as they are,
    a stop id comes within a few steps (200 of its 500 rows stop).
    """
    from vocalis.model_dir import BUNDLED_TOKENIZER

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("cosyvoice3.yaml", "flow.pt", "hift.pt", *(() if long_spoken else ("llm.pt",))):
        (directory / name).symlink_to(cv3_dir / name)
    if long_spoken:
        llm = torch.load(cv3_dir / "llm.pt", weights_only=True)
        speech_rows = llm["speech_embedding.weight"].shape[0] - 200
        llm["llm_decoder.weight"][speech_rows:] = 0.0
        torch.save(llm, directory / "llm.pt")
    qwen = directory / "CosyVoice-BlankEN"
    qwen.mkdir()
    for p in (cv3_dir / "CosyVoice-BlankEN").iterdir():
        (qwen / p.name).symlink_to(p)
    for p in BUNDLED_TOKENIZER.iterdir():
        shutil.copy(p, qwen / p.name)
    if clone:
        from tiny_assets import write_frontend_onnx

        speech_rows = torch.load(cv3_dir / "llm.pt", weights_only=True)["speech_embedding.weight"].shape[0] - 200
        write_frontend_onnx(directory, speech_vocab=speech_rows, tokenizer_file="speech_tokenizer_v3.onnx")
    ref = cv3_reference(cv3_dir, "ref_stream")
    torch.save({"default": {"embedding": ref["embedding"]},
                "zs": {"prompt_text": torch.tensor([ZS_PROMPT_TEXT_IDS]), "speech_token": ref["prompt_token"],
                       "speech_feat": ref["prompt_feat"], "embedding": ref["embedding"]}}, directory / "spk2info.pt")
    return directory


def reference_audio(tts, request, stream: bool, pieces: list[str] | None = None) -> list[np.ndarray]:
    """What the batch-1 reference path makes of `request` (tts: a `vocalis.tts.TTS` of a CV3 model), sampled as the
    engine samples: the model's RAS settings and length bounds, the LLM generator of `request.seed` shared by the
    sentences. Per sentence `reference.cv3.generate` -> silent-token filter -> `reference.cv3.stream_token2wav`;
    with `pieces` (the text as it arrived) one `reference.cv3.generate_bistream` over the ids of its sentences,
    read as the engine reads pieces (`Frontend.piece_reader`), instead.
    The chunks in order."""
    from vocalis.reference.cv3 import generate, generate_bistream, stream_token2wav
    from vocalis.token2wav.cv3.schedule import keep_token

    fe, model = tts.frontend, tts.model
    llm_gen, _ = fe.generators(request.seed)
    prompt = fe.flow_prompt(request)
    prompt_text, prompt_speech = fe.llm_prompt(request)
    if pieces is not None:
        reader = fe.piece_reader(request.language, request.text_frontend)  # a sentence at a time, as the engine
        piece_ids = [ids for p in pieces if p and (ids := reader.feed(p))]
        piece_ids += [ids] if (ids := reader.flush()) else []
        runs = [generate_bistream(model.llm, piece_ids, prompt_text, prompt_speech, model.config.sampling, llm_gen)]
    else:
        runs = [generate(model.llm, text_ids, prompt_text, prompt_speech, model.config.sampling, llm_gen)
                for text_ids in fe.segments(request)]
    chunks: list[np.ndarray] = []
    for ids in runs:  # lazily: each sentence draws from the shared generator after the previous one
        speech, run = [], 0
        for t in ids:
            keep, run = keep_token(t, run)
            if keep:
                speech.append(t)
        chunks += [c[0].numpy() for c in stream_token2wav(model.flow, model.hift, torch.tensor([speech]),
                                                           prompt.speech_ids, prompt.mel, prompt.embedding,
                                                           StreamConfig(), streaming=stream)]
    return chunks
