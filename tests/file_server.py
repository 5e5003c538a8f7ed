"""A local HTTP file server for the download tests (GLUE's archives, the Wikipedia dump): Range
requests, broken connections on demand, every request recorded.

    with serving_files(monkeypatch) as server:
        server.files["data.bin"] = b"..."
        server.drops = [1000]   # the next response promises the whole body and sends 1000 bytes
        server.url("data.bin")
"""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
from collections.abc import Iterator


class FileServer(http.server.ThreadingHTTPServer):
    files: dict[str, bytes]
    ranges: bool = True                     # honour Range requests
    drops: list[int]                        # for each of the next file responses: send only this many body bytes
    requests: list                          # what record() keeps

    def record(self, name: str, range_header: str | None) -> None:
        """Keep a request: (file name, Range header); a subclass may keep less."""
        self.requests.append((name, range_header))

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FileServer

    def do_GET(self) -> None:
        server = self.server
        name, header = self.path.lstrip("/"), self.headers.get("Range")
        server.record(name, header)
        if name not in server.files:
            self._send(404, b"not found", {})
            return
        data = server.files[name]
        start = int(re.fullmatch(r"bytes=(\d+)-", header).group(1)) if header and server.ranges else 0
        if start >= len(data) > 0 and header and server.ranges:
            self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            return
        extra = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if start else {}
        body = data[start:]
        if server.drops:  # promise the whole body, send part of it, hang up
            body = body[:server.drops.pop(0)]
        self._send(206 if start else 200, body, extra, length=len(data) - start)

    def _send(self, code: int, body: bytes, headers: dict, length: int | None = None) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving_files(monkeypatch, server_class: type[FileServer] = FileServer) -> Iterator[FileServer]:
    """A ``server_class`` on 127.0.0.1 (a free port, proxies bypassed) in a thread, until the block ends."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    server = server_class(("127.0.0.1", 0), _Handler)
    server.files, server.drops, server.requests = {}, [], []
    server.timeout = 10
    with in_a_thread(server):
        yield server


@contextlib.contextmanager
def in_a_thread(server: http.server.HTTPServer) -> Iterator[None]:
    """``server`` serving from a daemon thread until the block ends, then shut down and closed."""
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
