"""Word timestamps (`frontend.word_times`) and the trailing-silence trim (`audio_trim`), issue 55.

The built-in model's word times are its labels' phone durations, checked against labels made from known segment
times; forced alignment (pocketsphinx) against festival's own segment times for its speech; the built-in model
says every word of a sentence it used to drop into silence; a stream's trimmed tail is the whole utterance's.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from system_deps import need_festival, require

from vocalis.audio_trim import TailTrimmer, TrimConfig, trim_chunks
from vocalis.corpus.alignment import FRAME_RATE, Segment, frame_labels, read_segments
from vocalis.errors import InputError
from vocalis.frontend.phones import PAUSE, words
from vocalis.frontend.request import AudioChunk
from vocalis.frontend.word_times import LabelAligner, PocketsphinxAligner, WordTime, WordTimer, load_aligner

SR = 24000
DROPPED = "Client eighteen is here today."  # the built-in model paused after "Client" until its length bound


def _segments(text: str, phone_s: float, pause_s: float) -> tuple[list[Segment], list[tuple[str, float, float]]]:
    """Segments of `text` with every phone `phone_s` long and a pause after each punctuated word; the words' times."""
    segs, t, times = [Segment(pause_s, PAUSE)], pause_s, []
    for w in words(text):
        start = t
        for p in w.phones:
            t = round(t + phone_s, 3)
            segs.append(Segment(t, p))
        times.append((w.text, start, t))
        if w.punctuation:
            t = round(t + pause_s, 3)
            segs.append(Segment(t, PAUSE))
    return segs, times


def test_label_times_are_the_phone_durations() -> None:
    text = "Hello, wonderful world. Seven rats ran."
    segs, times = _segments(text, phone_s=0.08, pause_s=0.2)
    labels = frame_labels(segs, round(segs[-1].end * FRAME_RATE))
    wav = np.zeros(len(labels) * SR // FRAME_RATE, np.float32)
    got = LabelAligner()(text, wav, SR, labels)
    assert [w.word for w in got] == [word for word, _, _ in times]
    assert [t for w in got for t in (w.start, w.end)] == pytest.approx([t for _, s, e in times for t in (s, e)])
    # at speed 2 the same labels last half as long
    half = LabelAligner()(text, wav[: len(wav) // 2], SR, labels)
    assert [t for w in half for t in (w.start, w.end)] == pytest.approx([t / 2 for _, s, e in times for t in (s, e)])


def test_timer_shifts_each_sentence_by_where_it_starts() -> None:
    first, second = "Hello there.", "Seven rats ran."
    chunks = []
    for i, text in enumerate((first, second)):
        segs, _ = _segments(text, 0.12, 0.2)
        labels = frame_labels(segs, round(segs[-1].end * FRAME_RATE))
        n = len(labels) * SR // FRAME_RATE
        chunks += [AudioChunk(np.zeros(n // 2, np.float32), SR, i, False),
                   AudioChunk(np.zeros(n - n // 2, np.float32), SR, i, i == 1, tuple(labels))]
    timer = WordTimer(LabelAligner(), [first, second])
    got = [w for c in chunks for w in timer.push(c)]
    offset = (len(chunks[0].samples) + len(chunks[1].samples)) / SR
    alone = LabelAligner()(second, np.zeros(len(chunks[2].samples) + len(chunks[3].samples), np.float32), SR,
                           chunks[3].speech_ids)
    assert [w.word for w in got] == ["Hello", "there", "Seven", "rats", "ran"]
    assert got[2:] == [WordTime(w.word, w.start + offset, w.end + offset) for w in alone]
    assert timer.words == got


def test_aligner_hook_is_loaded_by_import_path() -> None:
    assert load_aligner("auto") is None
    assert load_aligner("vocalis.frontend.word_times:LabelAligner") is LabelAligner
    for bad in ("nocolon", "no_such_module_xyz:make", "vocalis.frontend.word_times:nothing"):
        with pytest.raises(InputError):
            load_aligner(bad)


def test_forced_alignment_finds_festivals_word_starts(tmp_path: Path) -> None:
    """pocketsphinx aligns festival's speech (slt) within 50 ms of festival's own segment times."""
    need_festival("slt")
    require(_has_pocketsphinx(), "pocketsphinx (pip install 'vocalis[eval]')")
    import soundfile as sf

    from vocalis.corpus.phone_corpus import speak_batch

    text = "The quick brown fox jumps over the lazy dog, and then it sleeps in the afternoon."
    wav_path = tmp_path / "u.wav"
    assert speak_batch("slt", [(text, wav_path)]) is None
    wav, sr = sf.read(wav_path, dtype="float32")
    segs = read_segments(wav_path.with_suffix(".segs"))
    starts, prev, k = [], 0.0, 0  # festival's start of each word: where its first phone begins
    phones = [p for w in words(text) for p in w.phones]
    firsts = {sum(len(w.phones) for w in words(text)[:i]) for i in range(len(words(text)))}
    for seg in segs:
        if seg.unit != PAUSE:
            if k in firsts:
                starts.append(prev)
            k += 1
        prev = seg.end
    assert k == len(phones)
    got = PocketsphinxAligner()(text, wav, sr, ())
    assert [w.word for w in got] == [w.text.lower() for w in words(text)]
    assert np.abs(np.array([w.start for w in got]) - np.array(starts)).max() < 0.05
    assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(got))


def _has_pocketsphinx() -> bool:
    try:
        import pocketsphinx  # noqa: F401
    except ImportError:
        return False
    return True


def test_trim_is_the_same_however_the_audio_is_cut() -> None:
    rng = np.random.default_rng(0)
    speech = rng.uniform(-0.5, 0.5, SR).astype(np.float32)
    wav = np.concatenate([speech, np.full(SR // 2, 0.001, np.float32), speech[:100], rng.uniform(
        -0.005, 0.005, SR).astype(np.float32)])
    whole = next(trim_chunks([AudioChunk(wav, SR, 0, True)])).samples
    cuts = sorted(rng.choice(len(wav), 12, replace=False))
    pieces = np.split(wav, cuts)
    chunked = np.concatenate([c.samples for c in trim_chunks(
        AudioChunk(p, SR, 0, i == len(pieces) - 1) for i, p in enumerate(pieces))])
    np.testing.assert_array_equal(chunked, whole)
    keep = round(TrimConfig().keep_s * SR)
    last_loud = len(speech) + SR // 2 + 100
    assert len(whole) == last_loud + keep  # the quiet middle kept, the tail cut to keep_s
    np.testing.assert_array_equal(whole[: last_loud + keep - round(TrimConfig().fade_s * SR)],
                                  wav[: last_loud + keep - round(TrimConfig().fade_s * SR)])
    assert whole[-1] == 0.0  # faded to zero: no click
    assert len(TailTrimmer(SR).push(np.zeros(100, np.float32))) == 0  # silence is held, not sent


@pytest.fixture(scope="module")
def builtin():
    from vocalis.tts import TTS

    t = TTS.load()
    yield t
    t.close()


def test_builtin_says_every_word_and_times_it(builtin) -> None:
    """The sentence the built-in model ended in silence (item 9): every word said, in order, each word's span
    sounding, the sentence ended by the model (not its length bound) with no long silence."""
    wav, got = builtin.synthesize_timed(DROPPED, seed=1)
    assert [w.word.lower() for w in got] == ["client", "eighteen", "is", "here", "today"]
    for w in got:
        span = wav[round(w.start * SR): round(w.end * SR)]
        assert 0.05 < w.end - w.start and np.sqrt(np.mean(span**2)) > 0.01, w
    assert len(wav) / SR < 3.0 and got[-1].end > len(wav) / SR - 0.5
    assert [w for _, said in builtin.stream_timed(DROPPED, seed=1) for w in said] == got  # streamed: the same
    quiet = np.array([np.abs(wav[i:i + 960]).max() < 0.01 for i in range(0, len(wav) - 960, 960)])
    longest = max((len(r) for r in "".join("q" if q else "s" for q in quiet).split("s")), default=0)
    assert longest * 0.04 <= 0.5  # no silence longer than 0.5 s anywhere


def test_builtin_stream_tail_is_the_whole_utterances_tail() -> None:
    """Trimmed, a stream ends exactly as the whole-utterance path does: same length, same last 0.1 s, last sample
    zero, when its last chunk is the whole path's full-attention pass (`final_attention="full"`; the built-in
    model's default block-causal last chunk differs from it by the two attention modes' difference)."""
    from vocalis.token2wav.config import Token2WavConfig
    from vocalis.tts import TTS

    text = "The weather today is mild, with light winds."
    with TTS.load(token2wav=Token2WavConfig(final_attention="full")) as builtin:
        whole = np.concatenate([c.samples for c in trim_chunks(builtin.run(builtin.request(text, seed=2), stream=False))])
        streamed_chunks = list(trim_chunks(builtin.run(builtin.request(text, seed=2), stream=True)))
        raw = np.concatenate([c.samples for c in builtin.run(builtin.request(text, seed=2), stream=False)])
    assert len(streamed_chunks) > 1
    streamed = np.concatenate([c.samples for c in streamed_chunks])
    assert len(streamed) == len(whole)
    np.testing.assert_allclose(streamed[-SR // 10:], whole[-SR // 10:], atol=1e-4)
    assert streamed[-1] == whole[-1] == 0.0
    assert len(whole) <= len(raw) and np.abs(raw[-1]) > 0  # the raw end did not reach zero: the fade did


def test_server_sends_word_times_as_sse_events_and_json(builtin) -> None:
    """A real loopback server (built-in model, trimming on as `vocalis serve` has it): the JSON form's words and
    audio are the Python API's (trimmed), the SSE form's `speech.word` events the same words; SSML is a 400."""
    import base64
    import json

    import httpx
    from serve_support import decode_audio, serve

    wav, expected = builtin.synthesize_timed(DROPPED, seed=1)
    trimmed = next(trim_chunks([AudioChunk(wav, SR, 0, True)])).samples
    body = {"input": DROPPED, "seed": 1, "response_format": "pcm", "timestamps": True}
    with serve(builtin, trim_silence=True) as srv, httpx.Client(base_url=srv.url, timeout=600) as c:
        r = c.post("/v1/audio/speech", json={**body, "stream": False})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
        data = r.json()
        assert data["words"] == [w.as_dict() for w in expected] and data["sample_rate"] == SR
        np.testing.assert_allclose(decode_audio("pcm", base64.b64decode(data["audio"])), trimmed, atol=2e-4)
        r = c.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        said = [{k: e[k] for k in ("word", "start", "end")} for e in events if e["type"] == "speech.word"]
        assert said == data["words"] and events[-1]["type"] == "speech.audio.done"
        r = c.post("/v1/audio/speech", json={**body, "input": "<speak>Hi.</speak>", "input_format": "ssml"})
        assert r.status_code == 400 and "ssml" in r.json()["error"]["message"]
