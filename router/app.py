"""The OpenAI-compatible ingress and the app builder that `serve run ray-config.yaml` imports.

The ingress is stateless (several replicas may run): per request it asks the residency service for
a lease on an instance, streams straight from that instance's model-server actor (one channel per
actor carries all of this replica's streams on it, one Ray item per flush), and releases the lease at the end, on error and on client
disconnect (the generation is cancelled in the engine). A per-item inactivity timeout keeps a
frozen node from hanging a stream."""

import asyncio
import hmac
import time
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve

from cluster.placement import NAMESPACE, actor_name
from deployments.model_server import HTTP_STATUS, ModelServerError, unwrap
from router import metrics
from router import openai_protocol as oai
from router.registry import from_manifest
from router.residency_service import ON_HEAD, ResidencyService
from router.stream_mux import StreamMux, Unavailable

app = FastAPI(title="Orchard", description="Many MLX models, one OpenAI-compatible URL")


def error(status: int, code: str, message: str, param: str | None = None, retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    return JSONResponse(oai.error_body(status, code, message, param), status_code=status, headers=headers)


def lease_error(e: dict) -> JSONResponse:
    e = e["error"]
    return error(e["status"], e["code"], e["message"], "model" if e["status"] == 404 else None, e.get("retry_after_s"))


@serve.deployment(max_ongoing_requests=500, ray_actor_options=ON_HEAD)
@serve.ingress(app)
class Ingress:
    def __init__(self, residency, chunk_timeout_s: float = 60.0, api_keys: list[str] | None = None):
        self.residency = residency
        self.chunk_timeout_s = chunk_timeout_s
        self.api_keys = [k.encode() for k in api_keys or []]
        self._releases: set[asyncio.Task] = set()
        self.mux = StreamMux()

    # ---- plumbing ------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if not self.api_keys:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip().encode()
        return any(hmac.compare_digest(given, k) for k in self.api_keys)

    async def _body(self, request: Request, model_type: type[BaseModel]):
        if not self._authorized(request):
            return None, error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer ...)")
        try:
            body = await request.json()
        except Exception:
            return None, error(400, "invalid_json", "the request body is not valid JSON")
        try:
            return model_type.model_validate(body), None
        except ValidationError as e:
            return None, JSONResponse(oai.validation_error_body(e), status_code=400)
        except oai.ProtocolError as e:
            return None, JSONResponse(e.body(), status_code=e.status)

    def _release(self, lease_id: str) -> None:
        """End a lease in a task of its own: a client that disconnects cancels the request's task,
        and a release awaited there would be cancelled with it and leak the lease."""
        task = asyncio.get_running_loop().create_task(self._send_release(lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, lease_id: str) -> None:
        await self.residency.release.remote(lease_id)

    @staticmethod
    def _actor(model: str, node_id: str):
        """Looked up per request, not cached: an evicted model placed again on the same node is a
        new actor under the same name, and a cached handle would point at the dead one."""
        return ray.get_actor(actor_name(model, node_id), namespace=NAMESPACE)

    async def _lease(self, model: str) -> tuple[dict | None, JSONResponse | None]:
        lease = await self.residency.acquire.remote(model)
        if "error" in lease:
            return None, lease_error(lease)
        return lease, None

    async def _deltas(self, lease: dict, request: dict):
        """The model server's coalesced deltas, over this replica's channel to that actor (one Ray
        item per flush for all of its streams); releases the lease, and cancels the generation
        when the consumer stops early (client disconnect), fails, or finishes. A request that
        fails before any output raises its ModelServerError."""
        stream = None
        label = f"model {lease['model']} on {lease['node_id']}"
        try:
            try:
                actor = self._actor(lease["model"], lease["node_id"])
            except ValueError as e:  # no such actor: evicted or died since the lease was granted
                raise Unavailable(f"{label} is unavailable: {e}") from e
            stream = self.mux.open(actor, label, request)
            while True:
                delta = await stream.next(self.chunk_timeout_s)
                if "failure" in delta:
                    e = delta["failure"]
                    raise ModelServerError(e["code"], e["message"], e.get("param"))
                yield delta
                if delta.get("finish_reason"):
                    return
        finally:
            if stream is not None:
                stream.close()
            self._release(lease["lease_id"])

    # ---- models and cluster --------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models(self, request: Request):
        if not self._authorized(request):
            return error(401, "invalid_api_key", "a valid API key is required")
        models = await self.residency.models.remote()
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0, "owned_by": "orchard", "orchard": m} for m in models]}

    @app.get("/v1/cluster")
    async def cluster(self, request: Request):
        if not self._authorized(request):
            return error(401, "invalid_api_key", "a valid API key is required")
        return await self.residency.cluster.remote()

    @app.get("/v1/cluster/events")
    async def events(self, request: Request, since: int = 0):
        if not self._authorized(request):
            return error(401, "invalid_api_key", "a valid API key is required")
        return {"object": "list", "data": await self.residency.events.remote(since)}

    @app.post("/v1/models/{model}/{action}")
    async def model_action(self, request: Request, model: str, action: str):
        if not self._authorized(request):
            return error(401, "invalid_api_key", "a valid API key is required")
        if action == "load":
            try:
                body = await request.json() if await request.body() else {}
            except Exception:
                return error(400, "invalid_json", "the request body is not valid JSON")
            result = await self.residency.load.remote(model, (body or {}).get("node"))
        elif action == "unload":
            result = await self.residency.unload.remote(model)
        elif action in ("pin", "unpin"):
            result = await self.residency.pin.remote(model, action == "pin")
        else:
            return error(404, "unknown_action", f"no action {action!r}: use load, unload, pin or unpin")
        return lease_error(result) if "error" in result else result

    # ---- generation ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, oai.ChatCompletionRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, oai.CompletionRequest, chat=False)

    async def _generate(self, request: Request, body_type: type[BaseModel], chat: bool):
        body, failure = await self._body(request, body_type)
        if failure is not None:
            return failure
        lease, failure = await self._lease(body.model)
        if failure is not None:
            return failure
        try:  # the engine's own request shape; the model server validates it again
            if lease["kind"] == "vlm" and chat:
                generation = oai.to_vlm_request(body)
            elif lease["kind"] in ("llm", "vlm"):
                generation = oai.generation_fields(body)
            else:
                raise oai.ProtocolError(400, "model_not_supported", f"model {body.model} is a {lease['kind']} model: it does not generate text", "model")
            if chat and lease["kind"] == "llm" and body.has_images():
                raise oai.ProtocolError(400, "unsupported_content", f"model {body.model} takes no images", "messages")
        except oai.ProtocolError as e:
            self._release(lease["lease_id"])
            return JSONResponse(e.body(), status_code=e.status)
        started = time.monotonic()
        request_id = oai.new_request_id("chat" if chat else "completion")
        created = oai.now()
        deltas = self._deltas(lease, generation)
        try:  # the first item tells a bad request (4xx, nothing streamed yet) from a good one
            first = await deltas.__anext__()
        except StopAsyncIteration:
            return error(500, "empty_stream", "the model returned nothing")
        except Unavailable as e:
            return error(503, "model_unavailable", str(e), retry_after_s=1)
        except Exception as e:
            failure = unwrap(e)
            return error(failure.status, failure.code, failure.message, failure.param)
        if body.stream:
            encoder = oai.StreamEncoder(
                "chat" if chat else "completion", body.model, request_id, created, include_usage=body.include_usage, statuses=HTTP_STATUS
            )
            ttft_s = time.monotonic() - started
            return StreamingResponse(self._sse(first, deltas, encoder, body.model, ttft_s), media_type="text/event-stream")
        ttft_s = time.monotonic() - started
        collected = [first]
        try:
            async for delta in deltas:
                collected.append(delta)
        except Unavailable as e:
            return error(503, "model_unavailable", str(e), retry_after_s=1)
        metrics.on_request(body.model, ttft_s, sum(len(d.get("token_ids") or ()) for d in collected))
        respond = oai.chat_completion_response if chat else oai.completion_response
        try:
            return respond(body.model, request_id, created, oai.join_deltas(collected), statuses=HTTP_STATUS)
        except oai.ProtocolError as e:
            return JSONResponse(e.body(), status_code=e.status)

    async def _sse(self, first: dict, deltas, encoder: "oai.StreamEncoder", model: str, ttft_s: float):
        """SSE bytes; closing this generator (client gone) closes `deltas`, which cancels the
        generation and releases the lease."""
        tokens = len(first.get("token_ids") or ())
        try:
            yield encoder.feed(first)
            async for delta in deltas:
                tokens += len(delta.get("token_ids") or ())
                yield encoder.feed(delta)
        except Unavailable as e:
            yield encoder.error("model_unavailable", str(e), status=503)
        finally:
            await deltas.aclose()
            metrics.on_request(model, ttft_s, tokens)
        yield encoder.close()

    # ---- embeddings ----------------------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        body, failure = await self._body(request, oai.EmbeddingRequest)
        if failure is not None:
            return failure
        lease, failure = await self._lease(body.model)
        if failure is not None:
            return failure
        if lease["kind"] != "embedding":
            self._release(lease["lease_id"])
            return error(400, "model_not_supported", f"model {body.model} is a {lease['kind']} model, not an embedding model", "model")
        try:
            result = await self._actor(lease["model"], lease["node_id"]).embed.remote(body.texts(), body.dimensions)
        except Exception as e:
            failure = unwrap(e)
            return error(failure.status, failure.code, failure.message, failure.param)
        finally:
            self._release(lease["lease_id"])
        return oai.embedding_response(body.model, result["vectors"], result["prompt_tokens"], body.encoding_format)


class AppArgs(BaseModel):
    """The `args:` of ray-config.yaml. Without `models`, every model of the prepared set in
    models_dir is registered (with `overrides` per model)."""

    models_dir: str = "models"
    models: list[dict] | None = None
    overrides: dict[str, dict] = Field(default_factory=dict)
    policy: dict = Field(default_factory=dict)
    chunk_timeout_s: float = 60.0
    api_keys: list[str] = Field(default_factory=list)
    watch_period_s: float = 1.0
    # Deltas per Ray item from a model server: the first at once, then every N tokens or M ms.
    # 8 / 50 ms measured better than 4 / 25 ms through the full path (docs/serve-benchmark.md).
    coalesce_tokens: int = Field(default=8, ge=1)
    coalesce_ms: float = Field(default=50.0, ge=0)


def build_app(args: dict) -> serve.Application:
    a = AppArgs.model_validate(args)
    models_dir = str(Path(a.models_dir).resolve())
    models = a.models if a.models is not None else from_manifest(models_dir, a.overrides)
    server_options = {"coalesce_tokens": a.coalesce_tokens, "coalesce_ms": a.coalesce_ms}
    residency = ResidencyService.bind(models, a.policy, models_dir, a.watch_period_s, server_options)
    return Ingress.bind(residency, a.chunk_timeout_s, a.api_keys)
