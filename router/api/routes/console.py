"""The operator's console (router/console): the page at /ui and the admin routes only it needs.

- GET /ui (and its two files): the page, plain files from the package, no key needed to fetch them
  (the page asks for the admin key and sends it in a header; it never goes in a URL);
- GET /v1/cluster/console: the cluster as the page shows it (router.console.view.ConsoleView);
- GET /v1/cluster/what-if?model=&node=: what the policy would do now for a request for `model`
  (anywhere) or an operator's load of it on `node`, carried out nowhere (rule P11);
- GET /v1/cluster/events/stream?since=: the residency log as server-sent events, one `StoryEvent`
  per event (the event and its sentence): first the log so far, then one `caught_up` event, then each
  new event as it is recorded (the residency service's long poll, next_events, feeds it), and a
  comment line every `KEEPALIVE_S` keeps idle connections open. A reconnecting
  client's Last-Event-ID header is where it goes on from.

The admin routes answer 401 without a key and 403 to a user key, in OpenAI's error format
(router/api/errors.py), as /v1/cluster does."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from cluster.serve_endpoints import direct_ingress
from deployments.wire.events import ClusterEvent
from deployments.wire.failure import OrchardError
from policy import Place, Reject, Use, Wait
from router.api.auth import require_admin
from router.api.ingress import Ingress, current
from router.api.sse import ClosingStreamingResponse
from router.console import links
from router.console.view import ConsoleSettings, ConsoleView, compose
from router.console.wording import decision_sentence, event_sentence

STATIC = Path(__file__).resolve().parent.parent.parent / "console" / "static"
PAGE = "/ui"
ASSETS = {f"{PAGE}/console.js": ("console.js", "text/javascript; charset=utf-8"), f"{PAGE}/console.css": ("console.css", "text/css; charset=utf-8")}
KEYLESS_PATHS = frozenset({PAGE, f"{PAGE}/", *ASSETS})
KEEPALIVE_S = 15.0
# Only this origin's own files; nothing inline, no frames of it elsewhere (clickjacking), no referrer.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_SETTINGS: list[ConsoleSettings] = []


def configure(settings: ConsoleSettings | None) -> None:
    """Make `settings` the console's in this process (IngressDeployment, from the app builder)."""
    _SETTINGS[:] = [settings] if settings is not None else []


def settings() -> ConsoleSettings:
    return _SETTINGS[0] if _SETTINGS else ConsoleSettings()


pages = APIRouter(tags=["console"])  # no key: the page and its files hold nothing of the cluster's
router = APIRouter(tags=["console"], dependencies=[Depends(require_admin)])


def _file(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=PAGE_HEADERS)


@pages.get(PAGE, include_in_schema=False)
@pages.get(f"{PAGE}/", include_in_schema=False)
async def page() -> Response:
    return _file("index.html", "text/html; charset=utf-8")


@pages.get(f"{PAGE}/console.js", include_in_schema=False)
async def script() -> Response:
    return _file(*ASSETS[f"{PAGE}/console.js"])


@pages.get(f"{PAGE}/console.css", include_in_schema=False)
async def style() -> Response:
    return _file(*ASSETS[f"{PAGE}/console.css"])


@router.get("/v1/cluster/console", response_model=ConsoleView)
async def console_view(request: Request, ingress: Ingress = Depends(current)) -> ConsoleView:
    """The cluster at a glance: node memory bars and stores, instances and what protects them, the
    policy in words (docs/console.md)."""
    cluster, models = await asyncio.gather(ingress.residency.cluster.remote(), ingress.residency.models.remote())
    cluster["ingress"] = await direct_ingress(serve.get_replica_context().app_name)
    names = [i["actor"] for n in cluster["nodes"] for i in n["instances"] if i.get("actor")]
    s = settings()
    dashboard = await asyncio.to_thread(links.dashboard_url, s.dashboard_url, request.headers.get("host"))
    ids = await links.actor_ids(names) if dashboard else {}
    return compose(cluster, models, s, now=cluster.get("now"), dashboard_url=dashboard, actor_ids=ids)


AnyDecision = Annotated[Use | Place | Wait | Reject, Field(discriminator="decision")]


class WhatIf(BaseModel):
    """The policy's answer now, carried out nowhere: `decision` as policy/decisions.py types it,
    `words` it in a sentence, `message` the policy's own reason (a placement's, a wait's or a refusal's)."""

    model_config = ConfigDict(frozen=True)

    object: Literal["orchard.what_if"] = "orchard.what_if"
    model: str
    node: str | None
    decision: AnyDecision
    words: str
    message: str


@router.get("/v1/cluster/what-if", response_model=WhatIf)
async def what_if(
    model: str = Query(min_length=1), node: str | None = Query(default=None, min_length=1), ingress: Ingress = Depends(current)
) -> WhatIf:
    """What the policy would do now for a request for `model` (no `node`) or an operator's load of
    it on `node`: use a copy, place it (evicting what), wait, or refuse with its reason. An unknown
    model or node is a 404; nothing is loaded, evicted or recorded."""
    if node is not None:
        known = {n["node_id"] for n in (await ingress.residency.cluster.remote())["nodes"]}
        if node not in known:
            raise OrchardError("node_not_found", f"no node {node!r} in the cluster (nodes: {', '.join(sorted(known))})", "node")
    decision = await ingress.residency.what_if.remote(model, node)
    if isinstance(decision, Reject) and decision.code == "unknown_model":
        raise OrchardError("model_not_found", f"The model '{model}' does not exist", "model")
    message = decision.reason if isinstance(decision, Place) else "" if isinstance(decision, Use) else decision.message
    return WhatIf(model=model, node=node, decision=decision, words=decision_sentence(decision), message=message)


class StoryEvent(BaseModel):
    """One server-sent event of /v1/cluster/events/stream: the residency event and its sentence."""

    model_config = ConfigDict(frozen=True)

    event: ClusterEvent
    sentence: str


class CaughtUp(BaseModel):
    """The stream's one `caught_up` event: every event logged before it opened has been sent (up to
    `last_seq`); what follows is live."""

    model_config = ConfigDict(frozen=True)

    last_seq: int


def sse_frame(event: ClusterEvent) -> bytes:
    body = StoryEvent(event=event, sentence=event_sentence(event)).model_dump_json()
    return f"id: {event.seq}\nevent: cluster_event\ndata: {body}\n\n".encode()


async def _stream(request: Request, ingress: Ingress, since: int) -> AsyncIterator[bytes]:
    yield b": orchard cluster events\n\n"  # the headers and a first byte at once
    caught_up = False
    while not await request.is_disconnected():
        events = await ingress.residency.next_events.remote(since, 0.0 if not caught_up else KEEPALIVE_S)
        for e in events:
            since = max(since, e.seq)
            yield sse_frame(e)
        if not caught_up:  # what was logged before the stream opened has been sent: the rest is live
            caught_up = True
            yield f"event: caught_up\ndata: {CaughtUp(last_seq=since).model_dump_json()}\n\n".encode()
        elif not events:
            yield b": keep-alive\n\n"


# Not in /openapi.json: a stream that never ends is no JSON operation (and a fuzzer's plain GET of it
# would wait forever); docs/console.md documents it.
@router.get("/v1/cluster/events/stream", include_in_schema=False)
async def event_stream(
    request: Request,
    since: int = Query(default=0, ge=0),
    last_event_id: str | None = Header(default=None),
    ingress: Ingress = Depends(current),
) -> ClosingStreamingResponse:
    """The residency log from event `since` (or the Last-Event-ID header's), then each new event as
    it is recorded: `text/event-stream`, one `cluster_event` per event, its data a StoryEvent."""
    if last_event_id is not None and last_event_id.isdigit():
        since = max(since, int(last_event_id))
    return ClosingStreamingResponse(
        _stream(request, ingress, since), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
