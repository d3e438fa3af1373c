"""OpenAI Responses (router/protocols/responses/): POST /v1/responses, stored and continued, and the
stored responses' own routes: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

POST parses, finds the response it continues (`previous_response_id`, its own key's only), then
leases, streams and renders as every generation does (router/api/generate.py); its renderer makes
the record at the generation's end. A whole response's record is written before its body is
returned, a streamed one's before its last event goes out (on the event loop: two GCS writes, each
at most KV_TIMEOUT_S), so a client that continues a response as soon as it has it finds it stored. A
failed response is not stored; a record that cannot be written is logged and the answer still goes
out (a later previous_response_id naming it is then a 400).

The store is Ray's GCS key-value store (cluster/ray_api.py), which every ingress replica reads: a
response made through one node's replica is continued through any other's. Its bounds come from
ray-config.yaml `args.responses_store` (`configure`, called by the ingress deployment)."""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Query

from cluster import ray_api
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationDelta
from router.api.auth import principal
from router.api.bodies import json_body
from router.api.generate import generate
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import responses as resp
from router.protocols.openai import ProtocolError
from router.serving.output.parsing import OutputParser
from router.serving.renderers import ResponsesRenderer

router = APIRouter(tags=["openai"])
log = logging.getLogger("orchard.responses")

DROPPED_TOOLS_HEADER = "Orchard-Dropped-Tools"
KV_TIMEOUT_S = 5.0  # one GCS call of the store; past it the call fails (a 503, or a record not stored)
T = TypeVar("T")


class GcsKV:
    """The store's key-value store: Ray's GCS, in Orchard's namespace."""

    def get(self, key: str) -> bytes | None:
        return ray_api.kv_get(key, KV_TIMEOUT_S)

    def put(self, key: str, value: bytes) -> None:
        ray_api.kv_put(key, value, KV_TIMEOUT_S)

    def delete(self, key: str) -> None:
        ray_api.kv_delete(key, KV_TIMEOUT_S)

    def keys(self, prefix: str) -> list[str]:
        return ray_api.kv_keys(prefix, KV_TIMEOUT_S)


_STORE: list[resp.ResponseStore] = []


def configure(settings: resp.StoreSettings) -> None:
    """This replica's store, bounded by `settings` (the app's `responses_store` args)."""
    _STORE[:] = [resp.ResponseStore(GcsKV(), settings)]


def store() -> resp.ResponseStore:
    if not _STORE:
        configure(resp.StoreSettings())
    return _STORE[0]


async def _kv(call: Callable[..., T], *args: Any) -> T:
    """A store call in a thread; the GCS not answering is a 503 (the cause is logged, not shown)."""
    try:
        return await asyncio.to_thread(call, *args)
    except Exception:
        log.exception("stored responses: the key-value store failed")
        raise OrchardError("unavailable", "stored responses are unavailable right now; retry shortly", retry_after_s=1) from None


def _not_found(response_id: str) -> ProtocolError:
    return ProtocolError(404, "not_found", f"Response with id '{response_id}' not found.")


class StoringRenderer(ResponsesRenderer):
    """The Responses renderer that makes the response's record when it completes (or ends
    incomplete at max_output_tokens): `record`, written here at a stream's end (`save`)."""

    def __init__(
        self, req: resp.ResponsesRequest, parser: OutputParser, owner: str, items: list[dict[str, Any]], save: Callable[[resp.StoredResponse], None]
    ):
        super().__init__(req, parser)
        self.owner = owner
        self.items = items
        self.save = save
        self.record: resp.StoredResponse | None = None

    def _keep(self, response: dict[str, Any]) -> None:
        if self.req.store is not False and self.record is None and response["status"] in ("completed", "incomplete"):
            self.record = resp.StoredResponse(
                id=self.response_id, owner=self.owner, created_at=time.time(), model=self.req.model, response=response, input_items=self.items
            )

    def feed(self, delta: GenerationDelta) -> bytes:
        out = super().feed(delta)
        if self.record is None and self.encoder.done:
            self._keep(self.encoder.response())
            if self.record is not None:
                _save_logged(self.save, self.record)
        return out

    def respond(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        body = super().respond(deltas)
        self._keep(body)
        return body


def _save_logged(save: Callable[[resp.StoredResponse], None], record: resp.StoredResponse) -> None:
    try:
        save(record)
    except Exception:
        log.exception("stored responses: %s could not be stored", record.id)


def _put_now(record: resp.StoredResponse) -> None:
    """A stream's record, written on the event loop before its last event goes out; the sweep,
    which may list and delete many keys, runs in a thread after it."""
    kept = store()
    kept.put(record, sweep=False)
    asyncio.get_running_loop().run_in_executor(None, _sweep_logged, kept)


def _sweep_logged(kept: resp.ResponseStore) -> None:
    try:
        kept.sweep_if_due()
    except Exception:
        log.exception("stored responses: the sweep failed")


@router.post("/v1/responses")
async def responses(body: resp.ResponsesRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    kept = store()
    previous = None
    if body.previous_response_id is not None:
        previous = await _kv(kept.get, body.previous_response_id, who.name)
        if previous is None:
            raise ProtocolError(
                400, "previous_response_not_found", f"Previous response with id '{body.previous_response_id}' not found.", "previous_response_id"
            )
    req = resp.continued(body, previous)
    items: list[dict[str, Any]] = []
    if body.store is not False:
        items = resp.conversation(previous, body)
        try:
            kept.check_size(items)
        except resp.ResponseTooLarge as e:
            raise ProtocolError(
                400, "response_too_large", f"{e} (responses_store.max_response_bytes): start a new conversation, or send store: false", "input"
            ) from None
    made: list[StoringRenderer] = []

    def renderer(parser: OutputParser) -> StoringRenderer:
        made.append(StoringRenderer(req, parser, who.name, items, _put_now))
        return made[-1]

    answer = await generate(ingress, who, resp.to_chat_request(req), renderer, stream=bool(req.stream))  # type: ignore[arg-type]  # a chat request always gets a parser
    if req.dropped_tools:  # hosted tools (web_search, ...): left out of the model's tools, not refused (docs/protocols.md)
        answer.headers[DROPPED_TOOLS_HEADER] = ", ".join(req.dropped_tools)
    if not req.stream and made and made[0].record is not None:
        try:
            await asyncio.to_thread(kept.put, made[0].record)
        except Exception:
            log.exception("stored responses: %s could not be stored", made[0].record.id)
    return answer


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, stream: bool = False, who: Principal = Depends(principal)):
    """A stored response as it was returned (OpenAI's Response object)."""
    if stream:
        raise ProtocolError(
            400, "unsupported_parameter", "a stored response cannot be streamed again (background responses are not supported)", "stream"
        )
    record = await _kv(store().get, response_id, who.name)
    if record is None:
        raise _not_found(response_id)
    return json_body(record.response)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, who: Principal = Depends(principal)):
    if not await _kv(store().delete, response_id, who.name):
        raise _not_found(response_id)
    return json_body({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    who: Principal = Depends(principal),
):
    """The conversation a stored response answered (earlier turns' inputs and outputs, then its own
    input), a page at a time: OpenAI's list shape, newest first by default."""
    record = await _kv(store().get, response_id, who.name)
    if record is None:
        raise _not_found(response_id)
    return json_body(resp.item_page(record.input_items, limit=limit, order=order, after=after))
