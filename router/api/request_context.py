"""The request's context, set at the app's door by one pure ASGI middleware (no task of its own, so
the route's context is the request's):

- a fresh holder for OpenAI's x-ratelimit-* headers, which the lease fills from the residency
  service's answer and this writes on the response as it starts (answers to a key with limits);
- when the request reached the app, which a generation's Server-Timing header reports."""

import time
from contextvars import ContextVar
from typing import Any

from router.serving.lease import RATE_LIMIT_HEADERS

ARRIVED: ContextVar[float | None] = ContextVar("orchard_arrived", default=None)  # time.monotonic() at the app's door


class RequestContext:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = ARRIVED.set(time.monotonic())
        holder: dict[str, str] = {}
        limits = RATE_LIMIT_HEADERS.set(holder)

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start" and holder:
                message = dict(message)
                message["headers"] = [*message.get("headers", []), *((k.encode(), v.encode()) for k, v in holder.items())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            RATE_LIMIT_HEADERS.reset(limits)
            ARRIVED.reset(arrived)
