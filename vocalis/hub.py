"""Models by hub id: `FunAudioLLM/CosyVoice2-0.5B`, `FunAudioLLM/Fun-CosyVoice3-0.5B-2512`, `iic/CosyVoice2-0.5B`.

A hub id is fetched once into the hub's usual cache through the hub's own client and the cached folder is used
from then on: Hugging Face through `huggingface_hub` (honouring HF_HUB_OFFLINE, HF_ENDPOINT, HF_HOME and
HF_HUB_CACHE, read at call time), ModelScope through `modelscope` (the optional `vocalis[modelscope]` extra; ids
with the `ms://` prefix or of the ModelScope-only `iic` organisation; honouring MODELSCOPE_OFFLINE, MODELSCOPE_ENDPOINT
and MODELSCOPE_CACHE, read at call time). Before use the folder is checked against the hub's own file listing (names
and sizes: as cached by `huggingface_hub`; `modelscope` checks sizes and sha256 itself while online) and the files a
loader needs; a missing model or file is named along with the command that fetches it.

Id syntax: `[hf://|ms://]ORG/NAME[@REVISION]`. A path that exists locally always wins.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import ModelLoadError

log = logging.getLogger(__name__)

HF, MODELSCOPE = "huggingface", "modelscope"
_PREFIXES = {"hf://": HF, "ms://": MODELSCOPE, "modelscope://": MODELSCOPE}
_MODELSCOPE_ORGS = ("iic",)  # organisations that publish on ModelScope only
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TRUE = {"1", "on", "yes", "true"}

# Never fetched by default: present in the releases, unused by Vocalis (CosyVoice 3's optional RL-tuned LLM).
DEFAULT_IGNORE = ("llm.rl.pt",)
# What a loader needs, by layout marker (the hub listing, when known, is checked on top of this).
REQUIRED_FILES = {
    "cosyvoice2.yaml": ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json"),
    "cosyvoice3.yaml": ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json"),
    "vocalis.json": ("vocalis.json", "llm.safetensors", "flow.safetensors", "hift.safetensors"),
}

# The released repos and their layouts (for naming what an empty offline cache lacks).
KNOWN_MODELS = {
    "FunAudioLLM/CosyVoice2-0.5B": "cosyvoice2.yaml",
    "iic/CosyVoice2-0.5B": "cosyvoice2.yaml",
    "FunAudioLLM/Fun-CosyVoice3-0.5B-2512": "cosyvoice3.yaml",
}


@dataclass(frozen=True, slots=True)
class HubRef:
    hub: str  # HF or MODELSCOPE
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        prefix = "ms://" if self.hub == MODELSCOPE and self.repo_id.split("/")[0] not in _MODELSCOPE_ORGS else ""
        return prefix + self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(ref: str) -> HubRef | None:
    """`[hf://|ms://]ORG/NAME[@REV]` -> HubRef; None for anything else (e.g. a path with more components)."""
    hub = None
    for prefix, name in _PREFIXES.items():
        if ref.startswith(prefix):
            hub, ref = name, ref[len(prefix) :]
            break
    repo_id, _, revision = ref.partition("@")
    if not _ID.match(repo_id) or repo_id.endswith((".", "..")):
        return None
    if hub is None:
        hub = MODELSCOPE if repo_id.split("/")[0] in _MODELSCOPE_ORGS else HF
    return HubRef(hub, repo_id, revision or None)


def is_hub_id(ref: str | Path) -> bool:
    """True for a hub id that is not an existing local path."""
    return not Path(ref).expanduser().exists() and parse_hub_id(str(ref)) is not None


def resolve_model(
    ref: str | Path,
    *,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    ignore: tuple[str, ...] = DEFAULT_IGNORE,
) -> Path:
    """A local model directory for `ref`: an existing path as it is, a hub id downloaded (once) and verified."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return local
    hub_ref = parse_hub_id(str(ref))
    if hub_ref is None:
        raise ModelLoadError(f"model directory not found: {local} (and it is not a hub id like ORG/NAME)")
    if hub_ref.hub == MODELSCOPE:
        return _modelscope_snapshot(hub_ref, cache_dir, offline, ignore)
    return _hf_snapshot(hub_ref, cache_dir, offline, ignore)


def _env_true(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def _fetch_hint(hub_ref: HubRef) -> str:
    return f"fetch it with `vocalis download {hub_ref}` where the hub can be reached"


# ---- Hugging Face ----------------------------------------------------------------------------------------------
def _hf_cache_dir(cache_dir: str | Path | None) -> str | None:
    if cache_dir is not None:
        return str(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None  # the library's default (~/.cache/huggingface/hub)


def _hf_snapshot(hub_ref: HubRef, cache_dir: str | Path | None, offline: bool | None,
                 ignore: tuple[str, ...]) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError as exc:
        raise ModelLoadError(f"{hub_ref} is a Hugging Face id: install its client with "
                             "`pip install 'vocalis[hub]'` (huggingface_hub)") from exc
    offline = _env_true("HF_HUB_OFFLINE") if offline is None else offline
    cache = _hf_cache_dir(cache_dir)
    where = cache or "the default Hugging Face cache"
    try:
        folder = huggingface_hub.snapshot_download(
            hub_ref.repo_id, revision=hub_ref.revision, cache_dir=cache, local_files_only=offline,
            endpoint=os.environ.get("HF_ENDPOINT") or None, ignore_patterns=list(ignore) or None,
        )
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as exc:
        snapshot = _hf_cached_snapshot(Path(cache or huggingface_hub.constants.HF_HUB_CACHE), hub_ref)
        if offline and snapshot is not None:
            missing = missing_files(snapshot, _hf_cached_listing(snapshot, ignore))
            raise ModelLoadError(
                f"offline (HF_HUB_OFFLINE): {hub_ref} in {snapshot} is incomplete; missing: {', '.join(missing)}; "
                f"{_fetch_hint(hub_ref)}, or unset HF_HUB_OFFLINE"
            ) from exc
        if offline:
            raise ModelLoadError(
                f"offline (HF_HUB_OFFLINE): {hub_ref} is not in {where}; missing: the whole model "
                f"({_expected(KNOWN_MODELS.get(hub_ref.repo_id))}); {_fetch_hint(hub_ref)}, or unset HF_HUB_OFFLINE"
            ) from exc
        endpoint = os.environ.get("HF_ENDPOINT") or "the default endpoint"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"cannot reach the Hugging Face hub ({endpoint}) for {hub_ref} and it is not in {where} "
                             f"({reason}); {_fetch_hint(hub_ref)}") from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise ModelLoadError(f"{hub_ref}: no such repository on the hub (or it needs a token: HF_TOKEN)") from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise ModelLoadError(f"{hub_ref}: no such revision on the hub") from exc
    except (hf_errors.HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"downloading {hub_ref} failed: {exc}") from exc
    folder = Path(folder)
    listing = _hf_cached_listing(folder, ignore)
    missing = missing_files(folder, listing)
    if missing:
        how = f"{_fetch_hint(hub_ref)}" + (", or unset HF_HUB_OFFLINE" if offline else " (run it again to resume)")
        raise ModelLoadError(f"{hub_ref} in {folder} is incomplete; missing: {', '.join(missing)}; {how}")
    return folder


def _hf_cached_snapshot(cache: Path, hub_ref: HubRef) -> Path | None:
    """The cached snapshot folder of `hub_ref` (the cache layout `models--ORG--NAME/{refs,snapshots}`), if any."""
    repo = cache / ("models--" + hub_ref.repo_id.replace("/", "--"))
    revision = hub_ref.revision or "main"
    try:
        commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        commit = revision  # a commit id given directly
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _hf_cached_listing(snapshot: Path, ignore: tuple[str, ...]) -> dict[str, int] | None:
    """The repo's file listing at this commit as `huggingface_hub` cached it (`<repo cache>/trees/<commit>.json`:
    path -> size), without the ignored patterns; None where this client version keeps no such listing."""
    tree = snapshot.parent.parent / "trees" / f"{snapshot.name}.json"
    try:
        files = json.loads(tree.read_text(encoding="utf-8"))["files"]
        listing = {str(name): int(meta["size"]) for name, meta in files.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {n: s for n, s in listing.items() if not any(fnmatch.fnmatch(n, p) for p in ignore)}


# ---- ModelScope ------------------------------------------------------------------------------------------------
def _modelscope_snapshot(hub_ref: HubRef, cache_dir: str | Path | None, offline: bool | None,
                         ignore: tuple[str, ...]) -> Path:
    try:
        from modelscope import snapshot_download
    except ImportError as exc:
        raise ModelLoadError(f"{hub_ref} is a ModelScope id: install its client with "
                             "`pip install 'vocalis[modelscope]'`") from exc
    flag = next((n for n in ("MODELSCOPE_OFFLINE", "HF_HUB_OFFLINE") if _env_true(n)), "MODELSCOPE_OFFLINE")
    offline = _env_true(flag) if offline is None else offline
    # Passed explicitly: the client reads MODELSCOPE_CACHE / MODELSCOPE_ENDPOINT once per process (its first call).
    cache = str(cache_dir) if cache_dir else os.environ.get("MODELSCOPE_CACHE") or None
    endpoint = os.environ.get("MODELSCOPE_ENDPOINT") or None
    where = cache or "the default ModelScope cache"
    try:
        folder = Path(snapshot_download(hub_ref.repo_id, revision=hub_ref.revision, cache_dir=cache,
                                        local_files_only=offline, endpoint=endpoint,
                                        ignore_file_pattern=list(ignore) or None))
    except Exception as exc:  # modelscope raises its own and requests' error types
        failures = getattr(exc, "failed_files", None) or {}  # FileDownloadError: path -> error of each file missed
        failed = sorted(failures)
        first = failures[failed[0]] if failed else exc
        reason = (str(first).splitlines() or [type(first).__name__])[0]
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if offline:
            raise ModelLoadError(f"offline ({flag}): {hub_ref} is not in {where}; missing: the whole model "
                                 f"({_expected(KNOWN_MODELS.get(hub_ref.repo_id))}); {_fetch_hint(hub_ref)}, "
                                 f"or unset {flag}") from exc
        if failed:
            raise ModelLoadError(f"{hub_ref}: downloading failed; missing: {', '.join(failed)} ({reason}); "
                                 f"{_fetch_hint(hub_ref)} (run it again to resume)") from exc
        if status == 404:
            raise ModelLoadError(f"{hub_ref}: no such repository or revision on ModelScope ({reason})") from exc
        raise ModelLoadError(f"{hub_ref}: downloading failed: {reason}; {_fetch_hint(hub_ref)}") from exc
    missing = missing_files(folder, None)
    if missing:
        raise ModelLoadError(f"{hub_ref} in {folder} is incomplete; missing: {', '.join(missing)}; "
                             f"{_fetch_hint(hub_ref)}" + (f", or unset {flag}" if offline else ""))
    return folder


# ---- completeness ----------------------------------------------------------------------------------------------
def _expected(marker: str | None) -> str:
    names = REQUIRED_FILES.get(marker or "", None)
    if names is None:
        return "one of " + ", ".join(REQUIRED_FILES) + " with its checkpoints"
    return ", ".join(names)


def missing_files(folder: Path, listing: dict[str, int] | None) -> list[str]:
    """Files a model folder lacks: those of the hub listing (path -> size; a wrong size counts as missing) and
    those its layout needs to load. Empty = complete."""
    missing: list[str] = []
    for name, size in sorted((listing or {}).items()):
        path = folder / name
        if not path.is_file():
            missing.append(name)
        elif path.stat().st_size != size:
            missing.append(f"{name} (size {path.stat().st_size}, expected {size})")
    marker = next((m for m in REQUIRED_FILES if (folder / m).is_file()), None)
    if marker is None:
        return missing or [f"a model layout ({_expected(None)})"]
    missing += [n for n in REQUIRED_FILES[marker] if not (folder / n).is_file() and n not in missing]
    return missing


# ---- `vocalis download` ----------------------------------------------------------------------------------------
def add_download_command(sub: argparse._SubParsersAction) -> None:
    dl = sub.add_parser("download", help="fetch a model by hub id into the hub cache (ahead of time)")
    dl.add_argument("model", help="hub id: FunAudioLLM/CosyVoice2-0.5B, FunAudioLLM/Fun-CosyVoice3-0.5B-2512, "
                                  "iic/CosyVoice2-0.5B, ms://ORG/NAME; @REVISION pins a revision")
    dl.add_argument("--cache-dir", help="cache folder (default: the hub client's, e.g. HF_HUB_CACHE)")
    dl.add_argument("--all", action="store_true", help="also files Vocalis does not use (" +
                    ", ".join(DEFAULT_IGNORE) + ")")
    dl.set_defaults(func=download_command)


def download_command(args: argparse.Namespace) -> int:
    """`vocalis download ID`: prints the local folder, usable as --model (or pass the id itself)."""
    ref = str(args.model)
    if parse_hub_id(ref) is None:
        raise ModelLoadError(f"{ref!r} is not a hub id (ORG/NAME, optionally hf:// or ms:// and @REVISION)")
    folder = resolve_model(ref, cache_dir=args.cache_dir, ignore=() if args.all else DEFAULT_IGNORE)
    print(folder)
    return 0
