"""/v1/audio/voices: create, list, get, delete; persisted on disk; names confined to the folder; no leftovers."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_support import decode_audio, quick_tts, serve
from tiny_assets import write_voice_like_wav


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)

@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 2.0).read_bytes()


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*"))


def test_voice_lifecycle_survives_restart(tts, tmp_path: Path, clip: bytes) -> None:
    voices = tmp_path / "voices"
    with serve(tts, voices_dir=voices) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/audio/voices", data={"name": "me", "text": "hello there"},
                   files={"audio": ("me.wav", clip, "audio/wav")})
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["name"] == "me" and info["kind"] == "saved" and "zero_shot" in info["modes"]
        assert info["prompt_seconds"] > 1.5
        r = c.post("/v1/audio/voices", json={"name": "me-xl", "audio": base64.b64encode(clip).decode()})
        assert r.status_code == 201 and r.json()["modes"][0] == "cross_lingual"  # no transcript
        assert files_in(voices) == ["me-xl.safetensors", "me.safetensors"]
        listed = c.get("/v1/audio/voices").json()
        assert [v["name"] for v in listed["data"]] == ["default", "me", "me-xl"]
        assert listed["aliases"]["alloy"] == "default"
        first = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "me", "seed": 1, "response_format": "wav"})
        assert first.status_code == 200
        assert c.post("/v1/audio/speech", json={"input": "Hi.", "voice": {"id": "me"}, "response_format": "pcm"}
                      ).status_code == 200
        assert c.get("/v1/audio/voices/me").json()["prompt_text"] == "hello there"
    # a new server over the same folder has the voice, and speaks the same with it
    with serve(tts, voices_dir=voices) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        assert [v["name"] for v in c.get("/v1/audio/voices").json()["data"]] == ["default", "me", "me-xl"]
        again = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "me", "seed": 1, "response_format": "wav"})
        np.testing.assert_allclose(decode_audio("wav", again.content), decode_audio("wav", first.content), atol=1e-4)
        assert c.delete("/v1/audio/voices/me").json()["deleted"] is True
        assert c.get("/v1/audio/voices/me").status_code == 404
        assert c.delete("/v1/audio/voices/me").status_code == 404
        assert files_in(voices) == ["me-xl.safetensors"]


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "with space", "x" * 65, "..", "a..b", "-dash", "é"])
def test_bad_names_rejected_and_nothing_written(tts, tmp_path: Path, clip: bytes, name: str) -> None:
    voices = tmp_path / "inner" / "voices"
    with serve(tts, voices_dir=voices) as srv:
        r = httpx.post(srv.url + "/v1/audio/voices", data={"name": name, "text": "hi"},
                       files={"audio": ("v.wav", clip)}, timeout=60)
        assert r.status_code == 400 and "invalid voice name" in r.json()["error"]["message"]
    assert files_in(tmp_path) == ["inner", "voices"]


def test_voice_errors_leave_no_state(tts, tmp_path: Path, clip: bytes) -> None:
    voices = tmp_path / "voices"
    with serve(tts, voices_dir=voices) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        def create(name: str, data: bytes, **extra: str) -> httpx.Response:
            return c.post("/v1/audio/voices", data={"name": name, **extra}, files={"audio": ("v.wav", data)})

        assert create("noise", b"garbage bytes").status_code == 415
        short = write_voice_like_wav(tmp_path / "short.wav", 0.2).read_bytes()
        r = create("short", short)
        assert r.status_code == 400 and "too short" in r.json()["error"]["message"]
        assert create("short", clip).status_code == 201  # the failed attempt did not keep the name
        assert create("short", clip).status_code == 409
        assert create("default", clip).status_code == 409  # built-in
        assert c.delete("/v1/audio/voices/default").status_code == 409
        assert c.post("/v1/audio/voices", data={"text": "x"}, files={"audio": ("v.wav", clip)}).status_code == 400
        assert c.post("/v1/audio/voices", data={"name": "nofile"}).status_code == 400
        b64 = base64.b64encode(clip).decode()
        r = c.post("/v1/audio/voices", json={"name": "x", "audio": b64, "color": "red"})
        assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
        assert c.delete("/v1/audio/voices/..%2F..%2Fetc").status_code in (400, 404)
        assert c.get("/v1/audio/voices/nobody").status_code == 404
        assert srv.backend.queue_depth == 0 and srv.backend.active == 0
    assert files_in(voices) == ["short.safetensors"]


def test_corrupt_voice_file_is_skipped(tts, tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "broken.safetensors").write_bytes(b"not a safetensors file")
    with serve(tts, voices_dir=voices) as srv:
        names = [v["name"] for v in httpx.get(srv.url + "/v1/audio/voices", timeout=30).json()["data"]]
    assert names == ["default"]


def test_openai_names_map_deterministically() -> None:
    import torch

    from vocalis.frontend.voice import Voice
    from vocalis.serve.voices import OPENAI_VOICES, VoiceNotFound, VoiceStore

    def v(name: str) -> Voice:
        return Voice(name, "", (), (), torch.zeros(0, 80), torch.zeros(192))

    store = VoiceStore({"b": v("b"), "a": v("a"), "c": v("c")}, aliases={"shimmer": "c"})
    assert [store.alias_target(n) for n in OPENAI_VOICES[:5]] == ["a", "b", "c", "a", "b"]
    assert store.resolve("ALLOY").name == "a" and store.resolve("shimmer").name == "c"
    assert store.resolve(None) is None
    with pytest.raises(VoiceNotFound, match="known voices: a, b, c"):
        store.resolve("zed")
    with pytest.raises(VoiceNotFound, match="no built-in voice"):
        VoiceStore({}).resolve("alloy")


def test_stores_sharing_a_folder_follow_each_other(tmp_path: Path) -> None:
    """Ray replicas each hold a VoiceStore over one folder: a change made through one shows in the others."""
    import torch

    from vocalis.frontend.voice import Voice
    from vocalis.serve.voices import VoiceNotFound, VoiceStore

    a, b = VoiceStore({}, tmp_path), VoiceStore({}, tmp_path)
    voice = Voice("shared", "hi", (1, 2), (3, 4), torch.zeros(4, 80), torch.ones(192))
    a.add(voice)
    a.reserve("shared2")  # a pending name is not visible elsewhere
    a.release("shared2")
    assert b.resolve("shared").prompt_speech_ids == (3, 4)
    assert [e.name for e in b.entries()] == ["shared"]
    b.delete("shared")
    with pytest.raises(VoiceNotFound):
        a.resolve("shared")
    assert a.entries() == []


def _small_voice(name: str, seed: int = 0):
    import torch

    from vocalis.frontend.voice import Voice

    g = torch.Generator().manual_seed(seed)
    return Voice(name, "hi there", (1, 2), tuple(range(10)), torch.randn(20, 80, generator=g),
                 torch.randn(192, generator=g))


def test_saved_voices_are_capped(tts, tmp_path: Path, clip: bytes) -> None:
    with serve(tts, voices_dir=tmp_path / "voices", max_saved_voices=2) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        def create(name: str) -> httpx.Response:
            return c.post("/v1/audio/voices", data={"name": name}, files={"audio": ("v.wav", clip)})

        assert create("one").status_code == 201 and create("two").status_code == 201
        r = create("three")
        assert r.status_code == 409 and "at most 2 saved voices" in r.json()["error"]["message"]
        assert c.delete("/v1/audio/voices/one").status_code == 200
        assert create("three").status_code == 201
    assert files_in(tmp_path / "voices") == ["three.safetensors", "two.safetensors"]


def test_voice_folder_indexed_once_and_loaded_lazily(tts, tmp_path: Path) -> None:
    """5,000 voices used to be loaded and rescanned on every request; now the folder is read once (headers only),
    a voice's tensors when it is used, and the folder again only when another process changed it."""
    voices = tmp_path / "voices"
    voices.mkdir()
    for i in range(300):
        _small_voice(f"v{i:03d}", i).save(voices / f"v{i:03d}.safetensors")
    with serve(tts, voices_dir=voices) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        store = srv.app.state.ctx.voices
        reads: list[str] = []
        original = store._reindex

        def counting() -> None:
            reads.append("reindex")
            original()

        store._reindex = counting
        assert store._loaded == {}  # nothing loaded at start
        listed = c.get("/v1/audio/voices").json()["data"]
        assert len(listed) == 301 and listed[1]["prompt_text"] == "hi there" and listed[1]["prompt_seconds"] == 0.4
        for i in (5, 7, 5):
            r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": f"v{i:03d}", "response_format": "pcm"})
            assert r.status_code == 200
            assert c.get(f"/v1/audio/voices/v{i:03d}").status_code == 200
        assert sorted(store._loaded) == ["v005", "v007"] and reads == []
        # another process adds and removes voices: seen at the next request, with one re-index
        _small_voice("outside", 9).save(voices / "outside.safetensors")
        (voices / "v000.safetensors").unlink()
        names = [v["name"] for v in c.get("/v1/audio/voices").json()["data"]]
        assert "outside" in names and "v000" not in names and reads == ["reindex"]
        assert c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "outside",
                                                "response_format": "pcm"}).status_code == 200
        assert reads == ["reindex"]
