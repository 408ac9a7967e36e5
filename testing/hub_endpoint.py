"""A local Hugging Face Hub endpoint for tests: the few Hub API routes that `huggingface_hub`'s `HfApi` calls
to check a token, create a model repo and commit files to it, served on 127.0.0.1 (a free port), recording
every request and every commit. Nothing leaves the machine.

It stands in for the Hub's server side only, so the real client code runs unchanged: point the client at
`LocalHub.endpoint` with HF_ENDPOINT (read when `huggingface_hub` is imported, so in a subprocess's
environment) or, in-process, by setting `huggingface_hub.constants.ENDPOINT` before `HfApi()` is made.
It answers `regular` to every file in the preupload step, so files travel base64-encoded inside the commit
(no LFS or Xet storage): keep test files small. A commit of an LFS file is refused with 400.

    with LocalHub() as hub:   # tokens: {TOKEN: (USER, "write")}
        ...                   # HF_ENDPOINT=hub.endpoint HF_TOKEN=TOKEN
        hub.commits[0].files  # {"t5.safetensors": b"...", "README.md": b"..."}

Routes (as called by huggingface_hub 2.x):
    GET  /api/whoami-v2                                 the token's user and role
    POST /api/repos/create                              create a model repo (409 when it exists)
    POST /api/validate-yaml                             README.md metadata check (always valid)
    POST /api/models/{namespace}/{name}/preupload/{rev} upload mode of each file (always `regular`)
    POST /api/models/{namespace}/{name}/commit/{rev}    NDJSON: a `header` line, then one `file` line per file
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["TOKEN", "USER", "Commit", "LocalHub"]

TOKEN = "hf_local_test_token"
"""The write token `LocalHub` accepts by default."""
USER = "tester"
"""The user that token belongs to."""
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_ROUTES = (
    ("GET", re.compile(r"/api/whoami-v2"), "whoami"),
    ("POST", re.compile(r"/api/repos/create"), "create"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("POST", re.compile(rf"/api/models/{_REPO}/preupload/(?P<revision>[^/]+)"), "preupload"),
    ("POST", re.compile(rf"/api/models/{_REPO}/commit/(?P<revision>[^/]+)"), "commit"),
)


@dataclass(frozen=True)
class Commit:
    """One commit the endpoint accepted: its repo, branch, message and the files' bytes by path."""

    repo_id: str
    revision: str
    summary: str
    files: dict[str, bytes]


@dataclass
class LocalHub:
    """The endpoint, its state and a server thread; a context manager that starts and stops it.

    Attributes:
        tokens: token -> (user, role); `role` is `write` or `read` (read tokens cannot create or commit).
        fail: route name (`whoami`, `create`, `preupload`, `commit`) -> HTTP status to answer instead.
        repos: repo id -> the visibility it was created with (`private`, `public`, or None for the default).
        commits: the accepted commits, in order. requests: `METHOD path` of every request, in order.
    """

    tokens: dict[str, tuple[str, str]] = field(default_factory=lambda: {TOKEN: (USER, "write")})
    fail: dict[str, int] = field(default_factory=dict)
    repos: dict[str, str | None] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, method: str, path: str, token: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """The status and JSON body for one request."""
        self.requests.append(f"{method} {path}")
        found = [
            (name, match) for verb, pattern, name in _ROUTES if verb == method and (match := pattern.fullmatch(path))
        ]
        if not found:
            return 404, {"error": f"no route {method} {path}"}
        [(name, match)] = found
        if name in self.fail:
            return self.fail[name], {"error": f"{name} failed (LocalHub.fail)"}
        if token not in self.tokens:
            return 401, {"error": "Invalid credentials in Authorization header"}
        user, role = self.tokens[token]
        if name == "whoami":
            return 200, {"type": "user", "name": user, "orgs": [], "auth": {"accessToken": {"role": role}}}
        if name == "validate_yaml":
            return 200, {"errors": [], "warnings": []}
        if role != "write":
            return 403, {"error": "This token has no write access"}
        if name == "create":
            return self._create(user, json.loads(body))
        repo_id = match["repo"]
        if repo_id not in self.repos:
            return 404, {"error": "Repository not found"}
        if name == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        return self._commit(repo_id, match["revision"], body)

    def _create(self, user: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        namespace = payload.get("organization") or user
        if namespace != user:
            return 403, {"error": f"You cannot create a repo under {namespace!r}"}
        repo_id = f"{namespace}/{payload['name']}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
        self.repos[repo_id] = payload.get("visibility")
        return 200, {"url": f"{self.endpoint}/{repo_id}"}

    def _commit(self, repo_id: str, revision: str, body: bytes) -> tuple[int, dict[str, Any]]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return 400, {"error": "the commit must start with a header line"}
        files = {}
        for line in lines[1:]:
            if line["key"] != "file" or line["value"].get("encoding") != "base64":
                return 400, {"error": f"LocalHub stores only regular base64 files, not {line['key']!r}"}
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        self.commits.append(Commit(repo_id, revision, lines[0]["value"]["summary"], files))
        oid = hashlib.sha1(body).hexdigest()
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}


class _Handler(BaseHTTPRequestHandler):
    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        authorization = self.headers.get("Authorization") or ""
        token = authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") else None
        status, payload = self.server.hub.answer(self.command, self.path.split("?")[0], token, body)  # type: ignore[attr-defined]
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _serve

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the requests are recorded in `LocalHub.requests`."""
