"""Models by hub id, against a loopback server that speaks the hub's file API and serves the compat folders.

Downloads go through huggingface_hub's own client into the usual cache layout; HF_ENDPOINT, HF_HUB_CACHE and
HF_HUB_OFFLINE are honoured when set after import; the folder is verified against the hub's file listing; offline,
the error names what is missing and how to fetch it. ModelScope ids go through the real `modelscope` client (an
optional extra) against a loopback server speaking ModelScope's file API (tests/modelscope_server.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from hub_server import loopback_hub
from modelscope_server import ModelScopeState, commit_of, loopback_modelscope

from vocalis.errors import ModelLoadError
from vocalis.hub import HF, MODELSCOPE, HubRef, is_hub_id, missing_files, parse_hub_id, resolve_model

CV2_ID, CV3_ID = "FunAudioLLM/CosyVoice2-0.5B", "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
MS_CV2, MS_CV3 = "iic/CosyVoice2-0.5B", "ms://" + CV3_ID  # the two ModelScope id forms (ms:// and the iic org)
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The compat folders as the two released repos (recorded references left out: they are test data)."""
    if not (SHARED / "compat" / "llm.pt").exists() or not (SHARED / "compat_cv3" / "llm.pt").exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"compatibility fixtures missing under {SHARED}: broken CI set-up")
        pytest.skip(f"compatibility fixtures missing under {SHARED}")
    root = tmp_path_factory.mktemp("repos")
    out = {}
    for repo_id, name in ((CV2_ID, "compat"), (CV3_ID, "compat_cv3")):
        out[repo_id] = root / name
        shutil.copytree(SHARED / name, out[repo_id], ignore=shutil.ignore_patterns("reference"))
    (out[CV3_ID] / "llm.rl.pt").write_bytes(b"optional checkpoint Vocalis does not fetch")
    return out


@pytest.fixture()
def hub(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A running loopback hub; HF_ENDPOINT points at it and HF_HUB_CACHE at a fresh cache."""
    with loopback_hub(repos) as (url, state):
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield state


@pytest.fixture()
def ms_hub(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A running loopback ModelScope hub serving the compat folders as iic/CosyVoice2-0.5B and the CosyVoice 3 repo;
    MODELSCOPE_ENDPOINT points at it, MODELSCOPE_CACHE at a fresh cache, MODELSCOPE_HOME (where the client keeps a
    session id) under tmp_path."""
    try:
        import modelscope_hub.config
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("modelscope is not installed: the dev extra lacks it")
        pytest.skip("modelscope (the vocalis[modelscope] extra) is not installed")
    with loopback_modelscope({MS_CV2: repos[CV2_ID], CV3_ID: repos[CV3_ID]}) as (url, state):
        monkeypatch.setenv("MODELSCOPE_ENDPOINT", url)
        monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
        monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))
        for name in ("MODELSCOPE_OFFLINE", "HF_HUB_OFFLINE", "MODELSCOPE_DOMAIN"):
            monkeypatch.delenv(name, raising=False)
        # The client keeps its first-read configuration process-wide; let this test's environment be read afresh.
        monkeypatch.setattr(modelscope_hub.config, "_default_config", None)
        yield state


def _same_files(folder: Path, repo: Path, skip: tuple[str, ...] = ()) -> None:
    served = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and p.name not in skip)
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert got == served
    for name in served:
        assert (folder / name).read_bytes() == (repo / name).read_bytes()


def test_parse_hub_id() -> None:
    assert parse_hub_id(CV2_ID) == HubRef(HF, CV2_ID)
    assert parse_hub_id("hf://" + CV3_ID + "@v1.0") == HubRef(HF, CV3_ID, "v1.0")
    assert parse_hub_id("iic/CosyVoice2-0.5B") == HubRef(MODELSCOPE, "iic/CosyVoice2-0.5B")
    assert parse_hub_id("ms://" + CV3_ID) == HubRef(MODELSCOPE, CV3_ID)
    for not_an_id in ("/abs/model", "./model", "a/b/c", "model", "../x", "org/"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_local_path_wins(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    assert not is_hub_id(folder) and resolve_model(folder) == folder


@pytest.mark.parametrize("repo_id", [CV2_ID, CV3_ID])
def test_download_once_then_cached(hub, repos: dict[str, Path], tmp_path: Path, repo_id: str) -> None:
    folder = resolve_model(repo_id)
    assert folder.is_relative_to(tmp_path / "hf-cache")  # HF_HUB_CACHE, the usual models--org--name layout
    assert f"models--{repo_id.replace('/', '--')}" in folder.parts
    _same_files(folder, repos[repo_id], skip=("llm.rl.pt",))  # the optional RL checkpoint is not fetched
    assert not any(g.endswith("llm.rl.pt") for g in hub.file_gets)
    fetched = len(hub.file_gets)
    assert resolve_model(repo_id) == folder
    assert len(hub.file_gets) == fetched  # nothing downloaded twice


def test_load_model_by_hub_id(hub) -> None:
    from vocalis.model_dir import load_model

    cv3 = load_model(CV3_ID)
    assert cv3.kind == "cosyvoice3" and f"models--{CV3_ID.replace('/', '--')}" in cv3.path.parts
    cv2 = load_model(CV2_ID)
    assert cv2.kind == "official"


def test_offline_uses_the_cache_without_network(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = resolve_model(CV3_ID)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(hub.requests)
    assert resolve_model(CV3_ID) == folder
    assert len(hub.requests) == seen


def test_offline_without_cache_says_what_and_how(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        resolve_model(CV2_ID)
    message = str(err.value)
    assert "offline" in message and "llm.pt" in message and f"vocalis download {CV2_ID}" in message
    assert not hub.requests


def test_offline_incomplete_cache_names_the_missing_files(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = resolve_model(CV3_ID)
    (folder / "flow.pt").unlink()  # e.g. an interrupted download
    (folder / "CosyVoice-BlankEN" / "generation_config.json").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        resolve_model(CV3_ID)
    message = str(err.value)
    assert "missing: CosyVoice-BlankEN/generation_config.json, flow.pt;" in message
    assert f"vocalis download {CV3_ID}" in message and "HF_HUB_OFFLINE" in message


def test_online_resume_completes_an_interrupted_download(hub) -> None:
    folder = resolve_model(CV2_ID)
    (folder / "hift.pt").unlink()
    assert resolve_model(CV2_ID) == folder and (folder / "hift.pt").is_file()


def test_listing_sizes_are_checked(tmp_path: Path) -> None:
    (tmp_path / "cosyvoice3.yaml").write_text("x")
    (tmp_path / "llm.pt").write_bytes(b"12")
    listing = {"cosyvoice3.yaml": 1, "llm.pt": 3, "extra.txt": 4}
    assert missing_files(tmp_path, listing) == [
        "extra.txt", "llm.pt (size 2, expected 3)", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json",
    ]
    assert missing_files(tmp_path / "nothing", None)[0].startswith("a model layout")


def test_unknown_repo(hub) -> None:
    with pytest.raises(ModelLoadError, match="no such repository"):
        resolve_model("FunAudioLLM/NoSuchModel")


def test_modelscope_id_needs_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails as when the extra is not installed
    with pytest.raises(ModelLoadError, match=r"vocalis\[modelscope\]"):
        resolve_model("iic/CosyVoice2-0.5B")


def _ms_folder(cache: Path, ref: str, revision: str = "master") -> Path:
    """The client's cache layout: models/ORG--NAME/snapshots/REVISION."""
    return cache / "models" / parse_hub_id(ref).repo_id.replace("/", "--") / "snapshots" / revision


@pytest.mark.parametrize("ref", [MS_CV2, MS_CV3])
def test_modelscope_download_once_then_cached(ms_hub: ModelScopeState, tmp_path: Path, ref: str) -> None:
    folder = resolve_model(ref)
    assert folder == _ms_folder(tmp_path / "ms-cache", ref)  # MODELSCOPE_CACHE
    # the RL checkpoint is not fetched
    _same_files(folder, ms_hub.repos[parse_hub_id(ref).repo_id], skip=("llm.rl.pt",))
    assert not any(g.endswith("llm.rl.pt") for g in ms_hub.file_gets)
    fetched, seen = len(ms_hub.file_gets), len(ms_hub.requests)
    assert resolve_model(ref) == folder
    assert len(ms_hub.file_gets) == fetched  # nothing downloaded twice: the cache is checked against the listing
    assert [r.split("?")[0] for r in ms_hub.requests[seen:]] == [
        f"GET /api/v1/models/{parse_hub_id(ref).repo_id}/repo/files"]


def test_modelscope_refetches_only_a_missing_or_changed_file(ms_hub: ModelScopeState) -> None:
    folder = resolve_model(MS_CV2)
    (folder / "hift.pt").unlink()
    llm = (folder / "llm.pt").read_bytes()
    (folder / "llm.pt").write_bytes(bytes([llm[0] ^ 1]) + llm[1:])  # same size, other bytes: the sha256 differs
    fetched = len(ms_hub.file_gets)
    assert resolve_model(MS_CV2) == folder
    assert sorted(ms_hub.file_gets[fetched:]) == [f"{MS_CV2}/hift.pt", f"{MS_CV2}/llm.pt"]
    assert (folder / "llm.pt").read_bytes() == llm and (folder / "hift.pt").is_file()


def test_modelscope_revision(ms_hub: ModelScopeState, tmp_path: Path) -> None:
    commit = commit_of(MS_CV2)
    assert resolve_model(f"{MS_CV2}@{commit}") == _ms_folder(tmp_path / "ms-cache", MS_CV2, commit)
    assert all(f"Revision={commit}" in r for r in ms_hub.requests if "/models/" in r)
    for unknown in (f"{MS_CV2}@v9.9", "iic/NoSuchModel"):
        with pytest.raises(ModelLoadError, match="no such repository or revision on ModelScope"):
            resolve_model(unknown)


def test_modelscope_incomplete_download_names_the_missing_file(ms_hub: ModelScopeState) -> None:
    ms_hub.withheld.add(f"{MS_CV2}/llm.pt")  # listed, but its body cannot be fetched
    with pytest.raises(ModelLoadError, match=r"downloading failed; missing: llm\.pt .*vocalis download iic/Cosy"):
        resolve_model(MS_CV2)
    ms_hub.withheld.clear()
    fetched = len(ms_hub.file_gets)
    folder = resolve_model(MS_CV2)  # resumes: only the file that did not come
    assert ms_hub.file_gets[fetched:] == [f"{MS_CV2}/llm.pt"] and (folder / "llm.pt").is_file()


def test_modelscope_offline(ms_hub: ModelScopeState, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = resolve_model(MS_CV2)
    monkeypatch.setenv("MODELSCOPE_OFFLINE", "1")
    seen = len(ms_hub.requests)
    assert resolve_model(MS_CV2) == folder
    (folder / "llm.pt").unlink()  # e.g. a download interrupted, or a file deleted by hand
    with pytest.raises(ModelLoadError, match=r"incomplete; missing: llm\.pt; .*or unset MODELSCOPE_OFFLINE"):
        resolve_model(MS_CV2)
    with pytest.raises(ModelLoadError) as err:
        resolve_model(MS_CV3)
    message = str(err.value)
    assert message.startswith(f"offline (MODELSCOPE_OFFLINE): {MS_CV3} is not in {tmp_path / 'ms-cache'}")
    assert "llm.pt" in message and f"vocalis download {MS_CV3}" in message
    monkeypatch.delenv("MODELSCOPE_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # honoured for ModelScope too
    with pytest.raises(ModelLoadError, match=r"^offline \(HF_HUB_OFFLINE\)"):
        resolve_model(MS_CV3)
    assert len(ms_hub.requests) == seen


def test_modelscope_download_command(ms_hub: ModelScopeState, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from vocalis.cli import main
    from vocalis.model_dir import load_model

    assert main(["download", MS_CV2, "--cache-dir", str(tmp_path / "elsewhere")]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == _ms_folder(tmp_path / "elsewhere", MS_CV2)
    assert load_model(MS_CV2).kind == "official"


def test_download_command(hub, capsys: pytest.CaptureFixture[str]) -> None:
    from vocalis.cli import main

    assert main(["download", CV3_ID]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert (printed / "cosyvoice3.yaml").is_file() and not (printed / "llm.rl.pt").exists()
    assert main(["download", CV3_ID, "--all"]) == 0
    assert (Path(capsys.readouterr().out.strip()) / "llm.rl.pt").is_file()
    assert main(["download", "not-an-id"]) == 2


def test_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = resolve_model(CV2_ID)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert resolve_model(CV2_ID) == folder
    with pytest.raises(ModelLoadError, match=rf"cannot reach the Hugging Face hub.*vocalis download {CV3_ID}"):
        resolve_model(CV3_ID)
