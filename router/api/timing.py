"""When a request reached the app: a pure ASGI middleware (no task of its own, so the route's
context is the request's) stamps it, and a generation's Server-Timing header reports the part of
its wait spent before its route ran (routing, body parsing and validation, the key's dependency)."""

import time
from contextvars import ContextVar
from typing import Any

ARRIVED: ContextVar[float | None] = ContextVar("orchard_arrived", default=None)  # time.monotonic() at the app's door


class StampArrival:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = ARRIVED.set(time.monotonic())
        try:
            await self.app(scope, receive, send)
        finally:
            ARRIVED.reset(token)
