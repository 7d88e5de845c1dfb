"""A loopback server speaking the part of ModelScope's `/api/v1` hub API that `modelscope.snapshot_download` uses
(modelscope 1.40 / modelscope-hub 0.5): the recursive file listing and the file body, serving local folders as model
repos. Everything else (e.g. the client's intranet-acceleration probe) is answered 404, as a plain public hub would.

    GET /api/v1/models/{owner}/{name}/repo/files?Revision=R&Recursive=True[&Root=DIR]
        -> {"Code": 200, "Success": true, "Data": {"Files": [{"Path", "Name", "Type": "blob"|"tree", "Size",
            "Sha256", "Revision", ...}]}}; the client checks every body against Size and Sha256
    GET /api/v1/models/{owner}/{name}/repo?Revision=R&FilePath=P   (Range: bytes=N- resumes with 206)
        -> the file's bytes

A repo has two revisions: the branch `master` (the client's default) and a commit id; any other is 404.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from hub_server import on_loopback


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(("ms:" + repo_id).encode()).hexdigest()  # a stable fake commit id per repo


class ModelScopeState:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos  # ModelScope id -> folder
        self.requests: list[str] = []  # "METHOD path?query" of every request
        self.file_gets: list[str] = []  # repo/path of every file body served
        self.withheld: set[str] = set()  # repo/path listed but whose body answers 404 (a broken upload)
        self._sha256: dict[tuple[Path, int, int], str] = {}
        self._lock = threading.Lock()

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if key not in self._sha256:
                self._sha256[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self._sha256[key]


def _listing(state: ModelScopeState, repo_id: str, folder: Path, root: str, recursive: bool) -> list[dict]:
    base = folder / root if root else folder
    paths = sorted(base.rglob("*") if recursive else base.glob("*"))
    entries = []
    for path in paths:
        rel = str(path.relative_to(folder))
        entry = {"Name": path.name, "Path": rel, "Revision": commit_of(repo_id), "Mode": "33188"}
        if path.is_dir():
            entries.append(entry | {"Type": "tree", "Size": 0, "Sha256": "", "IsLFS": False})
        else:
            entries.append(entry | {"Type": "blob", "Size": path.stat().st_size, "Sha256": state.sha256(path),
                                    "IsLFS": path.suffix in (".pt", ".safetensors")})
    return entries


def _handler(state: ModelScopeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _json(self, data: dict, status: int = 200) -> None:
            body = json.dumps(data | {"RequestId": "loopback"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _missing(self, message: str) -> None:
            self._json({"Code": 404, "Success": False, "Message": message}, 404)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            state.requests.append(f"GET {url.path}?{url.query}")
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            parts = [p for p in url.path.split("/") if p]
            # api/v1/models/{owner}/{name}/repo[/files]
            if parts[:3] != ["api", "v1", "models"] or len(parts) not in (6, 7) or parts[5] != "repo":
                return self._missing(f"no route {url.path}")
            repo_id = "/".join(parts[3:5])
            folder = state.repos.get(repo_id)
            if folder is None:
                return self._missing(f"model {repo_id} not found")
            if query.get("Revision", "master") not in ("master", commit_of(repo_id)):
                return self._missing(f"revision {query['Revision']} of {repo_id} not found")
            if len(parts) == 7 and parts[6] == "files":
                root = query.get("Root", "").strip("/")
                if root and not (folder / root).is_dir():
                    return self._missing(f"{root} not found in {repo_id}")
                files = _listing(state, repo_id, folder, root, query.get("Recursive", "False") == "True")
                return self._json({"Code": 200, "Success": True, "Message": "success", "Data": {"Files": files}})
            if len(parts) == 7:
                return self._missing(f"no route {url.path}")
            name = query.get("FilePath", "")
            target = folder / name
            if not name or not target.is_file() or f"{repo_id}/{name}" in state.withheld:
                return self._missing(f"file {name} not found in {repo_id}")
            self._file(repo_id, name, target.read_bytes())
            return None

        def _file(self, repo_id: str, name: str, data: bytes) -> None:
            start = 0
            resume = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if resume and int(resume[1]) < len(data):
                start = int(resume[1])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            state.file_gets.append(f"{repo_id}/{name}")
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def loopback_modelscope(repos: dict[str, Path]) -> Iterator[tuple[str, ModelScopeState]]:
    """(endpoint URL, state) of a ModelScope hub serving `repos` (ModelScope id -> folder) on 127.0.0.1."""
    state = ModelScopeState(repos)
    with on_loopback(_handler(state)) as url:
        yield url, state
