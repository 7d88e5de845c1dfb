"""A model directory that reads phones (`config.text_frontend = "phones"`, the built-in model's design): the
loader gives it the phone frontend, `TTS` speaks with it on the engine, and a `default` voice holding true
phone-state labels needs no speech tokenizer. The BPE default is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vocalis import config as cfg
from vocalis.errors import InputError
from vocalis.frontend import phones
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice
from vocalis.model_dir import BUNDLED_TOKENIZER, load_model, random_model, save_vocalis
from vocalis.tts import TTS

PROMPT_TEXT = "Hello there."


def _phone_model_dir(path: Path) -> tuple[Path, Voice]:
    """A random `tiny-phones` directory whose `default` voice has a transcript and true labels (no ONNX files)."""
    model = random_model("tiny-phones")
    labels = [phones.label_id(u, inside) for u in ("pau", "hh", "ax0", "l", "ow1", "pau") for inside in (False, True)]
    gen = torch.Generator().manual_seed(0)
    voice = Voice("default", PROMPT_TEXT, tuple(phones.text_ids(PROMPT_TEXT)), tuple(labels),
                  torch.randn(2 * len(labels), model.config.flow.output_size, generator=gen),
                  torch.randn(model.config.spk_embed_dim, generator=gen))
    model.voices = {"default": voice}
    save_vocalis(model, path, tokenizer_src=BUNDLED_TOKENIZER)
    return path, voice


def test_phone_vocabularies_agree_with_the_frontend() -> None:
    assert (cfg.PHONE_TEXT_IDS, cfg.PHONE_LABELS) == (phones.NUM_TEXT_IDS, phones.NUM_LABELS)
    c = cfg.PRESETS["builtin-phones"]
    assert c.text_frontend == "phones" and c.llm.qwen.vocab_size == phones.NUM_TEXT_IDS
    assert c.llm.speech_token_size == c.flow.vocab_size == phones.NUM_LABELS
    assert c.hift == cfg.PRESETS["builtin"].hift  # the L1 vocoder fits both
    with pytest.raises(ValueError, match="text_frontend"):
        cfg.ModelConfig(text_frontend="chars")


def test_model_dir_round_trips_its_text_frontend(tmp_path: Path) -> None:
    path, voice = _phone_model_dir(tmp_path / "phones")
    meta = json.loads((path / "vocalis.json").read_text())
    assert meta["config"]["text_frontend"] == "phones"
    assert not any((path / "tokenizer").iterdir())  # no BPE files beside a phone model
    loaded = load_model(path)
    assert loaded.config == cfg.PRESETS["tiny-phones"]
    assert isinstance(loaded.tokenizer, PhoneTokenizer) and len(loaded.tokenizer) == phones.NUM_TEXT_IDS
    assert loaded.voices["default"].prompt_speech_ids == voice.prompt_speech_ids
    assert loaded.speech_tokenizer is None

    # the BPE default: written, read back, and a vocalis.json from before the field existed
    save_vocalis(random_model("tiny"), tmp_path / "bpe", tokenizer_src=BUNDLED_TOKENIZER)
    meta = json.loads((tmp_path / "bpe" / "vocalis.json").read_text())
    assert meta["config"]["text_frontend"] == "bpe"
    del meta["config"]["text_frontend"]
    (tmp_path / "bpe" / "vocalis.json").write_text(json.dumps(meta))
    old = load_model(tmp_path / "bpe")
    assert old.config.text_frontend == "bpe" and isinstance(old.tokenizer, TextTokenizer)


def test_tts_reads_phones_on_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, voice = _phone_model_dir(tmp_path / "phones")
    with TTS.load(path) as tts:
        engine = tts.engine.llm
        seen: list[tuple[list[int], list[int], list[int]]] = []
        make_request = engine.make_request

        def record(text_ids, prompt_text_ids=(), prompt_speech_ids=(), *args, **kwargs):
            seen.append((list(text_ids), list(prompt_text_ids), list(prompt_speech_ids)))
            return make_request(text_ids, prompt_text_ids, prompt_speech_ids, *args, **kwargs)

        monkeypatch.setattr(engine, "make_request", record)
        wav = tts.synthesize("Hello 42.", seed=0)
        assert wav.ndim == 1 and wav.size > 0 and np.isfinite(wav).all()
        # the normaliser writes the digits out before the phone frontend reads them
        assert seen == [(phones.text_ids("Hello forty two."), phones.text_ids(PROMPT_TEXT),
                         list(voice.prompt_speech_ids))]
        assert phones.text_ids("Hello forty two.")[-1] == phones.TEXT_IDS["."]
        with pytest.raises(InputError, match="reads phones"):
            tts.synthesize("Hello.", instruct="Speak slowly.")


def test_a_phone_model_dir_tokenizes_prompts_with_its_labeller(tmp_path: Path) -> None:
    """`labeller.safetensors` + `.json` beside a phone model are its speech tokenizer (prompt audio -> 25 Hz labels),
    kept by `save_vocalis`; a labeller over another label set is refused at load."""
    from vocalis.errors import ModelLoadError
    from vocalis.frontend.speech_tokenizer import LabellerSpeechTokenizer
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config, save_labeller

    path, _ = _phone_model_dir(tmp_path / "phones")
    torch.manual_seed(0)
    labeller = FrameLabeller(labeller_config("tiny", phones.NUM_LABELS)).eval()
    save_labeller(labeller, path)
    loaded = load_model(path)
    assert isinstance(loaded.speech_tokenizer, LabellerSpeechTokenizer)
    wav = 0.1 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 200).astype(np.float32)
    ids = loaded.speech_tokenizer.tokenize(wav)
    from vocalis.frontend.audio import whisper_log_mel

    assert ids == labeller.tokenize_mels([whisper_log_mel(wav)])[0] and len(ids) == 25
    save_vocalis(loaded, tmp_path / "copy", tokenizer_src=BUNDLED_TOKENIZER, frontend_src=path)
    assert load_model(tmp_path / "copy").speech_tokenizer.tokenize(wav) == ids

    save_labeller(FrameLabeller(labeller_config("tiny", phones.NUM_LABELS + 1)), path)
    with pytest.raises(ModelLoadError, match="codebook"):
        load_model(path)


def test_a_phone_model_clones_a_recording_without_a_speaker_encoder(tmp_path: Path) -> None:
    """Its flow trained with zero x-vectors (`speaker_embedding="zeros"`): a prompt recording's voice is its mel
    and labels, so no CAM++ is needed; a model that reads x-vectors still refuses without its encoder."""
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config, save_labeller

    path, _ = _phone_model_dir(tmp_path / "phones")
    torch.manual_seed(0)
    save_labeller(FrameLabeller(labeller_config("tiny", phones.NUM_LABELS)).eval(), path)
    t = np.arange(24000 * 2) / 24000
    wav = (0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    import soundfile as sf

    sf.write(tmp_path / "me.wav", wav, 24000)
    with TTS.load(path) as tts:
        assert tts.model.speaker_encoder is None and tts.model.config.speaker_embedding == "zeros"
        voice = tts.frontend.make_voice(str(tmp_path / "me.wav"), PROMPT_TEXT)
        assert not voice.embedding.any() and voice.embedding.shape == (tts.model.config.flow.spk_embed_dim,)
        assert len(voice.prompt_speech_ids) == 50 and voice.prompt_mel.shape[0] == 100  # 2 s at 25 Hz / 50 Hz
        for text in (PROMPT_TEXT, None):  # zero-shot and cross-lingual
            out = tts.synthesize("Hello.", prompt_wav=str(tmp_path / "me.wav"), prompt_text=text, seed=0)
            assert out.ndim == 1 and out.size > 0 and np.isfinite(out).all()
    bpe = random_model("tiny")
    save_vocalis(bpe, tmp_path / "bpe", tokenizer_src=BUNDLED_TOKENIZER)
    with TTS.load(tmp_path / "bpe") as tts, pytest.raises(InputError, match="no speaker encoder"):
        tts.frontend.make_voice(str(tmp_path / "me.wav"), PROMPT_TEXT)


def test_the_phone_frontend_reads_accents_and_transliterates_other_scripts() -> None:
    """Other scripts are read in Latin letters, with a note per word, never refused (an English answer with one
    foreign word in it is still spoken)."""
    tok = PhoneTokenizer()
    assert tok.encode("Grüße aus Köln, café.") == phones.text_ids("Grusse aus Koln, cafe.")
    assert tok.warnings("Grüße aus Köln, café.") == ()
    assert tok.encode("你好, world.") == phones.text_ids("ni hao, world.")
    assert tok.encode("Привет.") == phones.text_ids("privet.")
    assert tok.encode("We can改善it.") == phones.text_ids("We can gai shan it.")
    assert tok.warnings("你好, world. Привет.") == ("'你好' read as 'ni hao': this model reads English only",
                                                  "'Привет' read as 'privet': this model reads English only")


def test_the_phone_frontend_leaves_control_tags_out_and_keeps_their_words() -> None:
    """CosyVoice's tags are sounds and stress the phone set has no symbol for: not read as words ("laughter"), and
    the words a tag marks are still said."""
    tok = PhoneTokenizer()
    text = "Well [laughter] that is <strong>great</strong> [breath] now."
    assert tok.encode(text) == phones.text_ids("Well that is great now.")
    assert tok.warnings(text) == ("'[laughter]' left out: this model has no control tags",
                                  "'<strong>' left out: this model has no control tags",
                                  "'</strong>' left out: this model has no control tags",
                                  "'[breath]' left out: this model has no control tags")
    assert tok.encode("See [1] and [sic].") == phones.text_ids("See [1] and [sic].")  # not control tags


def test_the_phone_model_lets_a_label_run_for_a_phone() -> None:
    """A label repeats for every 40 ms frame of its phone: the phone model's sampling keeps drawing it after five
    in a row, where the released RAS (BPE-paced codec ids) excludes it and draws another."""
    from vocalis.reference.sampling import make_sampler

    scores = torch.full((cfg.PHONE_LABELS,), -10.0)
    scores[5], scores[7] = 5.0, 0.0
    history = [3, 3, 5, 5, 5, 5, 5]
    phone = make_sampler(cfg.PRESETS["builtin-phones"].sampling, torch.Generator().manual_seed(0))
    released = make_sampler(cfg.PRESETS["builtin"].sampling, torch.Generator().manual_seed(0))
    assert [phone(scores, history) for _ in range(20)] == [5] * 20
    assert 5 not in [released(scores, history) for _ in range(20)]
