"""A Hugging Face Hub stand-in on 127.0.0.1 (the one allowed at the network edge): prepared folders served
in the Hub's URL layout, enough for huggingface_hub's own snapshot_download to fetch them.

    GET  /api/models/<repo>[/revision/<rev>]      model info: sha, siblings (with sizes)
    GET  /api/models/<repo>/tree/<rev>[/<path>]   the file list (recursive)
    HEAD /<repo>/resolve/<rev>/<file>             X-Repo-Commit, ETag, Content-Length
    GET  /<repo>/resolve/<rev>/<file>             the bytes (Range honoured: resumed downloads)

`throttle_bytes_per_s` slows the file bodies; `requests` counts what was asked for."""

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repos: dict[str, Path], throttle_bytes_per_s: float | None = None):
        self.repos = repos
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, head=True)

            def do_GET(self) -> None:
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()

    def _files(self, repo: str) -> list[Path]:
        root = self.repos[repo]
        return sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))

    def _json(self, handler: BaseHTTPRequestHandler, body: object, status: int = 200) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path))
        m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if m and m["repo"] in self.repos:
            root = self.repos[m["repo"]]
            siblings = [{"rfilename": p.relative_to(root).as_posix(), "size": p.stat().st_size} for p in self._files(m["repo"])]
            return self._json(h, {"id": m["repo"], "modelId": m["repo"], "sha": SHA, "private": False, "siblings": siblings})
        m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/[^/]+(?:/(?P<sub>.*))?", path)
        if m and m["repo"] in self.repos:
            root = self.repos[m["repo"]]
            entries = [
                {"type": "file", "path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                for p in self._files(m["repo"])
            ]
            return self._json(h, entries)
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<file>.+)", path)
        if m and m["repo"] in self.repos and (self.repos[m["repo"]] / m["file"]).is_file():
            data = (self.repos[m["repo"]] / m["file"]).read_bytes()
            start = 0
            if (rng := h.headers.get("Range")) and (r := re.fullmatch(r"bytes=(\d+)-", rng)):
                start = int(r[1])
            h.send_response(206 if start else 200)
            h.send_header("X-Repo-Commit", SHA)
            h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("Content-Length", str(len(data) - start))
            if start:
                h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            h.end_headers()
            if head:
                return
            body = memoryview(data)[start:]
            step = 1 << 20
            for i in range(0, len(body), step):
                h.wfile.write(body[i : i + step])
                if self.throttle_bytes_per_s:
                    time.sleep(step / self.throttle_bytes_per_s)
            return
        self._json(h, {"error": "Repository not found"}, 404)
