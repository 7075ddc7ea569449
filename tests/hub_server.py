"""A small threaded HTTP server that serves checkpoint folders the way the Hugging Face hub does.

Routes: ``HEAD|GET /{owner}/{name}/resolve/{revision}/{file}``, where revision is ``main`` or
the repository's commit. Small files answer directly; ``.safetensors`` files answer with a 302 to
``/cdn/...`` (as the hub redirects large files to its storage), carrying ``X-Repo-Commit``,
``X-Linked-Etag`` and ``X-Linked-Size`` like the hub's redirect. ``Range: bytes=a-b`` gets a 206
with ``Content-Range``. Every body byte sent is counted.

Faults are queued with ``fail(kind, match, times)`` and hit the next matching GETs of file data:
``429`` / ``503`` (with ``Retry-After: 0``), ``truncate`` (headers promise the full body, half is
sent, then the connection closes), ``reset`` (the connection closes without an answer), ``slow``
(the body trickles out in small pieces), ``long`` (a 206 whose body is longer than the range) and
``stall`` (half the body, then silence until ``release`` is set; ``stalled`` says it began).

Run as a script (``python tests/hub_server.py DIR owner/name``) it serves one folder until killed.
"""
from __future__ import annotations

import hashlib
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class HubServer:
    def __init__(self):
        self.repos: dict[str, tuple[Path, str]] = {}  # repo id -> (folder, commit)
        self.sent = 0  # body bytes sent
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, range)
        self.faults: list[list] = []  # [kind, substring of the file name, times left, matches to let pass]
        self.stalled, self.release = threading.Event(), threading.Event()  # for the "stall" fault
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def add(self, repo_id: str, folder: Path) -> str:
        commit = hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        self.repos[repo_id] = (Path(folder), commit)
        return commit

    def fail(self, kind: str, match: str = "", times: int = 1, after: int = 0) -> None:
        """The next `times` GETs of files whose name contains `match` fail with `kind`, once
        `after` such GETs went through."""
        with self.lock:
            self.faults.append([kind, match, times, after])

    def take_fault(self, name: str) -> str | None:
        with self.lock:
            for f in self.faults:
                if f[2] > 0 and f[1] in name:
                    if f[3] > 0:
                        f[3] -= 1
                        continue
                    f[2] -= 1
                    return f[0]
        return None

    def reset_counts(self) -> None:
        with self.lock:
            self.sent, self.requests = 0, []

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        hub = self.hub
        path = unquote(self.path.split("?")[0])
        with hub.lock:
            hub.requests.append((self.command, path, self.headers.get("Range")))
        m = re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)", path)
        if m:
            return self._file(m[1], m[2], m[3], body, cdn=True)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(m[1], m[2], m[3], body, cdn=False)
        self._plain(404, b"not found")

    def _plain(self, code: int, text: bytes, headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(text)

    def _file(self, repo: str, revision: str, name: str, body: bool, cdn: bool) -> None:
        hub = self.hub
        if repo not in hub.repos:
            return self._plain(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
        folder, commit = hub.repos[repo]
        if revision not in ("main", commit):
            return self._plain(404, b"Revision not found", {"X-Error-Code": "RevisionNotFound"})
        file = folder / name
        if ".." in name or not file.is_file():
            return self._plain(404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
        size = file.stat().st_size
        etag = '"' + hashlib.sha256(f"{file}:{size}".encode()).hexdigest() + '"'
        meta = {"X-Repo-Commit": commit, "ETag": etag}
        if name.endswith(".safetensors") and not cdn:  # large files live elsewhere: redirect
            self.send_response(302)
            for k, v in {**meta, "X-Linked-Etag": etag, "X-Linked-Size": str(size),
                         "Location": f"{hub.url}/cdn/{repo}/{commit}/{name}", "Content-Length": "0"}.items():
                self.send_header(k, v)
            self.end_headers()
            return
        start, end = 0, size
        rng = self.headers.get("Range")
        if rng:
            m = RANGE.fullmatch(rng.strip())
            if m is None or int(m[1]) >= size:
                return self._plain(416, b"bad range", {"Content-Range": f"bytes */{size}"})
            start, end = int(m[1]), min(size, int(m[2]) + 1 if m[2] else size)
        fault = hub.take_fault(name) if body else None
        if fault in ("429", "503"):
            return self._plain(int(fault), b"busy", {"Retry-After": "0"})
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.close_connection = True
            self.connection.close()
            return
        with open(file, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        if fault == "long":
            data += b"\x00" * 16
        self.send_response(206 if rng else 200)
        for k, v in meta.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not body:
            return
        if fault in ("truncate", "stall"):
            data = data[:len(data) // 2]
            self.close_connection = True
        if fault == "stall":  # half the body, then nothing until the test releases it
            self.wfile.write(data)
            self.wfile.flush()
            hub.stalled.set()
            hub.release.wait()
            return
        step = 4096 if fault == "slow" else len(data) or 1
        for k in range(0, len(data), step):
            self.wfile.write(data[k:k + step])
            with hub.lock:
                hub.sent += len(data[k:k + step])
            if fault == "slow":
                self.wfile.flush()
                time.sleep(0.001)



if __name__ == "__main__":
    server = HubServer()
    server.add(sys.argv[2], Path(sys.argv[1]))
    with server:
        print(server.url, flush=True)
        threading.Event().wait()
