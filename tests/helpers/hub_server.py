"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub's `model_info`,
`snapshot_download` and `hf_hub_download` call, served from files in memory, reached through
HF_ENDPOINT (or the constants it sets, in-process).

  GET  /api/models/{repo}[/revision/{rev}]   -> {"id", "sha", "siblings": [{"rfilename"}]}
  GET  /api/models/{repo}/tree/{rev}[/{dir}]  -> [{"type": "file", "path", "size", "oid"}]
  HEAD /{repo}/resolve/{rev}/{file}           -> X-Repo-Commit, ETag (the blob's git sha1),
  GET  (the same)                                Content-Length; GET honours `Range: bytes=N-`

Errors carry the X-Error-Code header huggingface_hub maps to its exceptions (RepoNotFound,
GatedRepo, RevisionNotFound, EntryNotFound). Every request is recorded (method, path, headers)
so that a test can assert what was asked, e.g. that an offline run asked nothing; a repository
can drop the connection in the middle of a file once, to see the download resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import socket
import threading
import urllib.parse


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # a gated repository: only this bearer token gets in
    # the first GET of a file sends this many bytes of its body, then drops the connection
    drop_at: int | None = None


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                hub._handle(self, body=True)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- routing ----------------------------------------------------------------------------
    def _handle(self, h: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append((h.command, h.path, dict(h.headers)))
        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            repo = self._repo(h, repo_id, body)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                rev = rest[1] if len(rest) > 1 else "main"
                if self._revision_ok(h, repo, rev, body):
                    self._json(h, {"id": repo_id, "sha": repo.sha, "private": False,
                                   "siblings": [{"rfilename": f} for f in sorted(repo.files)]},
                               body)
                return
            if rest[0] == "tree" and len(rest) >= 2:
                if self._revision_ok(h, repo, rest[1], body):
                    under = "/".join(rest[2:])
                    self._json(h, [{"type": "file", "path": f, "size": len(d), "oid": git_sha1(d)}
                                   for f, d in sorted(repo.files.items())
                                   if not under or f.startswith(under + "/")], body)
                return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(h, "/".join(parts[:2]), body)
            if repo is not None and self._revision_ok(h, repo, parts[3], body):
                self._file(h, repo, "/".join(parts[4:]), body)
            return
        self._error(h, 404, None, body)

    def _repo(self, h, repo_id: str, body: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:  # the Hub answers 401 for a missing repository to anonymous callers
            self._error(h, 401, "RepoNotFound", body)
            return None
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(h, 401, "GatedRepo", body)
            return None
        return repo

    def _revision_ok(self, h, repo: Repo, rev: str, body: bool) -> bool:
        if rev in ("main", repo.sha):
            return True
        self._error(h, 404, "RevisionNotFound", body)
        return False

    def _file(self, h, repo: Repo, name: str, body: bool) -> None:
        data = repo.files.get(name)
        if data is None:
            self._error(h, 404, "EntryNotFound", body, {"X-Repo-Commit": repo.sha})
            return
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and body:
            start, status = int(rng[6:].split("-")[0]), 206
        h.send_response(status)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{git_sha1(data)}"')
        h.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if body and repo.drop_at is not None and start == 0:
            repo.drop_at, cut = None, repo.drop_at
            h.wfile.write(data[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if body:
            h.wfile.write(data[start:])

    def _json(self, h, obj, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h, status: int, code: str | None, body: bool,
               headers: dict[str, str] | None = None) -> None:
        data = json.dumps({"error": code or "not found"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def hub_env(url: str, hf_home: str) -> dict[str, str]:
    """The environment a subprocess needs to use the stand-in (and nothing else) online."""
    return {"HF_ENDPOINT": url, "HF_HOME": hf_home, "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1"}
