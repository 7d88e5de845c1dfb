"""A loopback server speaking the part of the Hugging Face hub's HTTP API that `huggingface_hub` uses to download
(repo info, recursive tree listing, file resolve with HEAD metadata), serving local folders as model repos."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def _commit(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()  # a stable fake commit id per repo


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


class HubState:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.requests: list[str] = []  # "METHOD path" of every request
        self.file_gets: list[str] = []  # repo/path of every file body served


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _json(self, data: object, status: int = 200) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _missing(self, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo(self, parts: list[str]) -> tuple[str, Path] | None:
            repo_id = "/".join(parts[:2])
            folder = state.repos.get(repo_id)
            return (repo_id, folder) if folder is not None else None

        def _route(self) -> None:
            path = unquote(urlparse(self.path).path)
            state.requests.append(f"{self.command} {path}")
            parts = [p for p in path.split("/") if p]
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                found = self._repo(parts[2:4])
                if found is None:
                    return self._missing("RepoNotFound")
                repo_id, folder = found
                files = _files(folder)
                if parts[4] == "revision":
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": _commit(repo_id), "private": False,
                                       "siblings": [{"rfilename": str(p.relative_to(folder))} for p in files]})
                if parts[4] == "tree":
                    prefix = "/".join(parts[6:])
                    entries = [
                        {"type": "file", "path": str(p.relative_to(folder)), "size": p.stat().st_size,
                         "oid": hashlib.sha1(str(p.relative_to(folder)).encode()).hexdigest()}
                        for p in files if str(p.relative_to(folder)).startswith(prefix)
                    ]
                    return self._json(entries)
            if len(parts) >= 5 and parts[2] == "resolve":
                found = self._repo(parts[:2])
                if found is None:
                    return self._missing("RepoNotFound")
                repo_id, folder = found
                target = folder / "/".join(parts[4:])
                if not target.is_file():
                    return self._missing("EntryNotFound")
                data = target.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", _commit(repo_id))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if self.command == "GET":
                    state.file_gets.append(f"{repo_id}/{target.relative_to(folder)}")
                    self.wfile.write(data)
                return None
            return self._missing("NotFound")

        do_GET = _route
        do_HEAD = _route

    return Handler


@contextmanager
def on_loopback(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The base URL of a threaded HTTP server running `handler` on 127.0.0.1 (a free port) until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def loopback_hub(repos: dict[str, Path]) -> Iterator[tuple[str, HubState]]:
    """(endpoint URL, request log) of a hub serving `repos` (repo id -> folder) on 127.0.0.1."""
    state = HubState(repos)
    with on_loopback(_handler(state)) as url:
        yield url, state
