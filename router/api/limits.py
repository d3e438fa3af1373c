"""OpenAI's x-ratelimit-* headers on every answer of a key with limits: a pure ASGI middleware (no task
of its own, so the route's context is the request's) that gives each request a fresh holder, which
the lease fills from the residency service's answer, and writes it on the response as it starts."""

from typing import Any

from router.serving.lease import RATE_LIMIT_HEADERS


class RateLimitHeaders:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: dict[str, str] = {}
        token = RATE_LIMIT_HEADERS.set(holder)

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start" and holder:
                message = dict(message)
                message["headers"] = [*message.get("headers", []), *((k.encode(), v.encode()) for k, v in holder.items())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            RATE_LIMIT_HEADERS.reset(token)
