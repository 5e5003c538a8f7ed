"""A local stand-in for the Hugging Face hub: one model repository at one commit, served over the
endpoints huggingface_hub's ``snapshot_download`` calls (pointed at it by ``HF_ENDPOINT``), every
request recorded.

    with serving_hub("org/tiny-bert", {"config.json": b"...", ...}) as hub:
        hub.endpoint      # for HF_ENDPOINT
        hub.requests      # [("GET", "/api/models/org/tiny-bert/revision/main"), ...]

- ``GET /api/models/{repo}/revision/{rev}``: the repository's info, its commit (``sha``) and files;
- ``GET /api/models/{repo}/tree/{rev}``: the files, with their sizes and git blob ids;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: a file, with the ``X-Repo-Commit`` and ``ETag``
  headers the download keys its cache on, and ``Range`` requests (a resumed download);
- anything else, or another repository: 404 with the ``X-Error-Code: RepoNotFound`` the hub sends.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
from collections.abc import Iterator

from file_server import in_a_thread


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's contents (the hub's ``oid`` of a file that is not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer(http.server.ThreadingHTTPServer):
    repo: str
    commit: str
    files: dict[str, bytes]
    requests: list[tuple[str, str]]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: HubServer

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        hub = self.server
        hub.requests.append((self.command, self.path))
        path = self.path.split("?")[0]
        repo = re.escape(hub.repo)
        if re.fullmatch(rf"/api/models/{repo}/revision/[^/]+", path):
            info = {"id": hub.repo, "modelId": hub.repo, "sha": hub.commit, "private": False,
                    "siblings": [{"rfilename": name} for name in hub.files]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        elif re.fullmatch(rf"/api/models/{repo}/tree/[^/]+/?", path):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
                    for name, data in hub.files.items()]
            self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        elif (match := re.fullmatch(rf"/{repo}/resolve/[^/]+/(.+)", path)) and match.group(1) in hub.files:
            self._send_file(hub.files[match.group(1)], body)
        else:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)

    def _send_file(self, data: bytes, body: bool) -> None:
        headers = {"X-Repo-Commit": self.server.commit, "ETag": f'"{git_blob_id(data)}"',
                   "Accept-Ranges": "bytes"}
        start = 0
        if match := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = min(int(match.group(1)), len(data))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(206 if start else 200, data[start:], headers, body)

    def _send(self, code: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving_hub(repo: str, files: dict[str, bytes], commit: str = "c0ffee" * 6 + "c0de") -> Iterator[HubServer]:
    """A :class:`HubServer` of ``repo`` at ``commit`` on 127.0.0.1 (a free port) in a thread, until the block ends."""
    server = HubServer(("127.0.0.1", 0), _Handler)
    server.repo, server.commit, server.files, server.requests = repo, commit, files, []
    with in_a_thread(server):
        yield server
