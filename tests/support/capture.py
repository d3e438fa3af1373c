"""A recording reverse proxy for the agent-CLI tests: every request a client sends goes on to an
upstream (Orchard) unchanged, and its method, path and JSON body are kept in order (`requests`),
with the status, the response's headers and the time until its head. What the real CLIs send is saved this way
as the replay fixtures (tests/fixtures/agents/)."""

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Captured:
    method: str
    path: str
    body: Any
    status: int = 0
    head_s: float = 0.0
    error: str = ""  # the body of an error answer
    headers: dict[str, str] = field(default_factory=dict)  # the answer's headers, names in lower case


@dataclass
class CaptureProxy:
    upstream: str
    requests: list[Captured] = field(default_factory=list)
    port: int = 0
    _server: uvicorn.Server | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        seen = Captured(request.method, request.url.path, body)
        self.requests.append(seen)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        started = time.monotonic()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600), auto_decompress=False)
        try:
            upstream = await session.request(request.method, self.upstream + request.url.path, params=request.query_params, data=raw, headers=headers)
        except aiohttp.ClientError as e:
            await session.close()
            seen.status = 502
            return Response(json.dumps({"error": {"message": f"capture proxy: {e}"}}), status_code=502, media_type="application/json")
        seen.status, seen.head_s = upstream.status, time.monotonic() - started
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        seen.headers = {k.lower(): v for k, v in out.items()}
        if upstream.status >= 400:
            raw_error = await upstream.read()
            seen.error = raw_error.decode("utf-8", "replace")
            upstream.release()
            await session.close()
            return Response(raw_error, status_code=upstream.status, headers=out)

        async def relay():
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.release()
                await session.close()

        return StreamingResponse(relay(), status_code=upstream.status, headers=out)

    def start(self) -> "CaptureProxy":
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE", "HEAD"])])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])), daemon=True).start()  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
