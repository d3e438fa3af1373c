"""The OpenAI-compatible ingress and the app builder that `serve run ray-config.yaml` imports.

The ingress is stateless (several replicas may run): per request it asks the residency service for
a lease on an instance, streams straight from that instance's model-server actor (one channel per
actor carries all of this replica's streams on it, one Ray item per flush), and releases the lease at the end, on error and on client
disconnect (the generation is cancelled in the engine). A per-item inactivity timeout keeps a
frozen node from hanging a stream."""

import asyncio
import contextlib
import contextvars
import hmac
import time
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve

from cluster.placement import NAMESPACE, actor_name
from deployments.model_server import ModelServerError, unwrap
from router import metrics
from router import openai_protocol as oai
from router.registry import from_manifest
from router import anthropic_protocol as anth
from router import responses_protocol as resp
from router.output_parsing import OutputConfig, OutputParser
from router.renderers import AnthropicRenderer, OpenAIRenderer, Protocol, Renderer, ResponsesRenderer, error_response, protocol_error_response
from router.residency_service import ON_HEAD, ResidencyService
from router.tool_grammar import forced_call_grammar
from router.rerank_audio_protocol import RerankRequest, SpeechRequest, TranscriptionForm, rerank_response
from router.stream_mux import StreamMux, Unavailable

app = FastAPI(title="Orchard", description="Many MLX models, one OpenAI-compatible URL")


def error(status: int, code: str, message: str, param: str | None = None, retry_after_s: float | None = None) -> JSONResponse:
    """An error in OpenAI's format (the endpoints that only speak OpenAI's protocol)."""
    return error_response("openai", status, code, message, param, retry_after_s)


def lease_error(result: dict, protocol: Protocol = "openai") -> JSONResponse:
    """The residency service's {"error": ...} (no lease, a failed cluster operation) as a response."""
    e = result["error"]
    return error_response(protocol, e["status"], e["code"], e["message"], "model" if e["status"] == 404 else None, e.get("retry_after_s"))


@serve.deployment(max_ongoing_requests=500, ray_actor_options=ON_HEAD)
@serve.ingress(app)
class Ingress:
    def __init__(
        self, residency, chunk_timeout_s: float = 60.0, api_keys: list[str] | None = None, *,
        allow_remote_images: bool = False, max_audio_bytes: int = 25 * 1024**2,
    ):
        self.residency = residency
        self.chunk_timeout_s = chunk_timeout_s
        self.allow_remote_images = allow_remote_images
        self.max_audio_bytes = max_audio_bytes
        self.api_keys = [k.encode() for k in api_keys or []]
        self._releases: set[asyncio.Task] = set()
        self.mux = StreamMux()
        self._handles: dict[tuple[str, str], tuple[float, Any]] = {}  # (model, node) -> (loaded_at, actor)

    def __del__(self):  # Serve calls it when the replica shuts down
        with contextlib.suppress(Exception):
            self.mux.close()

    # ---- plumbing ------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        """OpenAI clients send `Authorization: Bearer <key>`, Anthropic clients `x-api-key: <key>`."""
        if not self.api_keys:
            return True
        given = (request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")).strip().encode()
        return any(hmac.compare_digest(given, k) for k in self.api_keys)

    async def _json(self, request: Request, protocol: Protocol) -> tuple[Any, JSONResponse | None]:
        """The body as JSON after the key check, or the error in `protocol`'s format."""
        if not self._authorized(request):
            return None, error_response(protocol, 401, "invalid_api_key", "a valid API key is required (Authorization: Bearer ... or x-api-key)")
        try:
            return await request.json(), None
        except Exception:
            return None, error_response(protocol, 400, "invalid_json", "the request body is not valid JSON")

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
        """End a lease in a task of its own, in an empty context: a client that disconnects cancels
        the request's task, and Serve also cancels every handle call made in that request's
        context (a copied context still carries it), so a release sent from either would be
        cancelled with the request and leak the lease (seen: 1 in 3 disconnects under load)."""
        task = asyncio.get_running_loop().create_task(self._send_release(lease_id), context=contextvars.Context())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, lease_id: str) -> None:
        await self.residency.release.remote(lease_id)

    def _actor(self, lease: dict):
        """The lease's model-server actor. Handles are cached per instance incarnation (the lease's
        loaded_at): ray.get_actor is a blocking GCS call, once per request was a measurable share
        of the ingress's event loop at GPU token rates; a model placed again on the same node is a
        new actor under the same name and a new loaded_at, so a stale handle is never reused."""
        key = (lease["model"], lease["node_id"])
        cached = self._handles.get(key)
        if cached is not None and cached[0] == lease["loaded_at"]:
            return cached[1]
        handle = ray.get_actor(actor_name(lease["model"], lease["node_id"]), namespace=NAMESPACE)
        self._handles[key] = (lease["loaded_at"], handle)
        return handle

    async def _lease(self, model: str, protocol: Protocol = "openai") -> tuple[dict | None, JSONResponse | None]:
        lease = await self.residency.acquire.remote(model)
        if "error" in lease:
            return None, lease_error(lease, protocol)
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
                actor = self._actor(lease)
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

    # ---- generation: every protocol, one path ---------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body, failure = await self._body(request, oai.ChatCompletionRequest)
        if failure is not None:
            return failure
        return await self._generate(body, lambda parser: OpenAIRenderer(body, parser))

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body, failure = await self._body(request, oai.CompletionRequest)
        if failure is not None:
            return failure
        return await self._generate(body, lambda parser: OpenAIRenderer(body, None))

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic Messages, translated to a chat request and rendered back (router/anthropic_protocol.py)."""
        raw, failure = await self._json(request, "anthropic")
        if failure is not None:
            return failure
        try:
            req = anth.parse_messages_request(raw)
            chat = oai.parse_chat_request(anth.to_chat_request(req))
        except oai.ProtocolError as e:
            return protocol_error_response("anthropic", e)
        return await self._generate(chat, lambda parser: AnthropicRenderer(req, parser), protocol="anthropic", stream=bool(req.stream))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        raw, failure = await self._json(request, "anthropic")
        if failure is not None:
            return failure
        try:
            req = anth.parse_count_tokens_request(raw)
            chat = oai.parse_chat_request(anth.to_chat_request(req) | {"model": req.model})
        except oai.ProtocolError as e:
            return protocol_error_response("anthropic", e)
        lease, failure = await self._lease(chat.model, "anthropic")
        if failure is not None:
            return failure
        try:
            generation, _ = self._prepare(lease, chat)
            count = await self._actor(lease).count_tokens.remote(generation)
        except oai.ProtocolError as e:
            return protocol_error_response("anthropic", e)
        except Exception as e:
            f = unwrap(e)
            return error_response("anthropic", f.status, f.code, f.message, f.param)
        finally:
            self._release(lease["lease_id"])
        return anth.count_tokens_response(count)

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI Responses, stateless (router/responses_protocol.py)."""
        raw, failure = await self._json(request, "openai")
        if failure is not None:
            return failure
        try:
            req = resp.parse_responses_request(raw)
            chat = oai.parse_chat_request(resp.to_chat_request(req))
        except oai.ProtocolError as e:
            return protocol_error_response("openai", e)
        return await self._generate(chat, lambda parser: ResponsesRenderer(req, parser), stream=bool(req.stream))

    def _prepare(self, lease: dict, body: oai.ChatCompletionRequest | oai.CompletionRequest) -> tuple[dict, OutputParser | None]:
        """The model server's request for this lease's model kind, and the output parser a chat
        protocol runs over its deltas. Raises ProtocolError for what this model cannot do."""
        kind, model = lease["kind"], body.model
        chat = isinstance(body, oai.ChatCompletionRequest)
        if kind not in ("llm", "vlm"):
            raise oai.ProtocolError(400, "model_not_supported", f"model {model} is a {kind} model: it does not generate text", "model")
        if not chat:
            return oai.generation_fields(body), None
        config = OutputConfig(tool_parser=lease.get("tool_parser"), reasoning=lease.get("reasoning"))
        parser = OutputParser(config, tools=body.uses_tools)
        if kind == "vlm":
            oai.check_image_urls(body, allow_remote=self.allow_remote_images)
            return oai.to_vlm_request(body), parser
        if body.has_images():
            raise oai.ProtocolError(400, "unsupported_content", f"model {model} takes no images; use a vision model", "messages")
        generation = oai.generation_fields(body)
        if body.uses_tools and config.tool_parser is None:
            raise oai.ProtocolError(400, "tools_not_supported", f"model {model} has no tool-call parser configured (registry: tool_parser)", "tools")
        if body.forced_tool is not None:
            grammar = forced_call_grammar(
                config.tool_parser, generation["tools"], body.forced_tool, parallel=body.parallel_tool_calls is True, reasoning=config.reasoning
            )
            generation["constraint"] = {"type": "lark", "grammar": grammar}
        return generation, parser

    async def _generate(self, body, make_renderer, protocol: Protocol = "openai", stream: bool | None = None):
        """Lease, stream from the instance, render in the client's protocol, release."""
        stream = bool(body.stream) if stream is None else stream
        lease, failure = await self._lease(body.model, protocol)
        if failure is not None:
            return failure
        try:
            generation, parser = self._prepare(lease, body)
            renderer = make_renderer(parser)
        except oai.ProtocolError as e:
            self._release(lease["lease_id"])
            return protocol_error_response(protocol, e)
        started = time.monotonic()
        deltas = self._deltas(lease, generation)
        try:  # the first item tells a bad request (4xx, nothing streamed yet) from a good one
            first = await deltas.__anext__()
        except StopAsyncIteration:
            return error_response(protocol, 500, "empty_stream", "the model returned nothing")
        except Unavailable as e:
            return error_response(protocol, 503, "model_unavailable", str(e), retry_after_s=1)
        except Exception as e:
            f = unwrap(e)
            return error_response(protocol, f.status, f.code, f.message, f.param)
        ttft_s = time.monotonic() - started
        if stream:
            return StreamingResponse(self._sse(first, deltas, renderer, body.model, ttft_s), media_type="text/event-stream")
        collected = [first]
        try:
            async for delta in deltas:
                collected.append(delta)
        except Unavailable as e:
            return error_response(protocol, 503, "model_unavailable", str(e), retry_after_s=1)
        metrics.on_request(body.model, ttft_s, sum(len(d.get("token_ids") or ()) for d in collected))
        try:
            return renderer.respond(collected)
        except oai.ProtocolError as e:
            return protocol_error_response(protocol, e)

    async def _sse(self, first: dict, deltas, renderer: Renderer, model: str, ttft_s: float):
        """SSE bytes; closing this generator (client gone) closes `deltas`, which cancels the
        generation and releases the lease."""
        tokens = len(first.get("token_ids") or ())
        try:
            yield renderer.start() + renderer.feed(first)
            async for delta in deltas:
                tokens += len(delta.get("token_ids") or ())
                yield renderer.feed(delta)
        except Unavailable as e:
            yield renderer.fail(503, "model_unavailable", str(e))
        finally:
            await deltas.aclose()
            metrics.on_request(model, ttft_s, tokens)
        yield renderer.close()

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
            result = await self._actor(lease).embed.remote(body.texts(), body.dimensions)
        except Exception as e:
            failure = unwrap(e)
            return error(failure.status, failure.code, failure.message, failure.param)
        finally:
            self._release(lease["lease_id"])
        return oai.embedding_response(body.model, result["vectors"], result["prompt_tokens"], body.encoding_format)

    # ---- rerank and audio ----------------------------------------------------------------------
    async def _call(self, request_model: str, kind: str, what: str, call):
        """Lease `request_model`, check it is a `kind` model, run `call(actor)`, release. Returns
        (result, None) or (None, an OpenAI-format error response)."""
        lease, failure = await self._lease(request_model)
        if failure is not None:
            return None, failure
        try:
            if lease["kind"] != kind:
                return None, error(400, "model_not_supported", f"model {request_model} is a {lease['kind']} model, not {what}", "model")
            return await call(self._actor(lease)), None
        except ValueError as e:  # the actor vanished since the lease was granted
            return None, error(503, "model_unavailable", f"model {request_model} is unavailable: {e}", retry_after_s=1)
        except Exception as e:
            f = unwrap(e)
            return None, error(f.status, f.code, f.message, f.param)
        finally:
            self._release(lease["lease_id"])

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(self, request: Request):
        """Cohere / Jina shape: query, documents (strings or {"text": ...}), top_n, return_documents."""
        body, failure = await self._body(request, RerankRequest)
        if failure is not None:
            return failure
        result, failure = await self._call(body.model, "rerank", "a rerank model", lambda a: a.rerank.remote(body.query, body.texts(), body.top_n))
        if failure is not None:
            return failure
        return rerank_response(body, result)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request):
        """OpenAI's multipart transcription: file, model, language, prompt, temperature,
        response_format json / text / verbose_json."""
        if not self._authorized(request):
            return error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer ...)")
        too_big = error(413, "file_too_large", f"audio files are limited to {self.max_audio_bytes} bytes", "file")
        if int(request.headers.get("content-length") or 0) > self.max_audio_bytes + 64 * 1024:
            return too_big
        try:
            form = await request.form()
        except Exception as e:
            return error(400, "invalid_request", f"expected multipart/form-data: {e}")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            return error(400, "missing_required_parameter", "a 'file' part with the audio is required", "file")
        audio = await upload.read(self.max_audio_bytes + 1)
        if len(audio) > self.max_audio_bytes:
            return too_big
        try:
            fields = TranscriptionForm.model_validate({k: v for k, v in form.items() if isinstance(v, str)})
        except ValidationError as e:
            return JSONResponse(oai.validation_error_body(e), status_code=400)
        result, failure = await self._call(
            fields.model, "stt", "a speech-to-text model",
            lambda a: a.transcribe.remote(audio, fields.language, fields.temperature, fields.prompt, fields.response_format),
        )
        if failure is not None:
            return failure
        body = result["body"]
        return PlainTextResponse(body) if isinstance(body, str) else body

    @app.post("/v1/audio/speech")
    async def speech(self, request: Request):
        """OpenAI's text-to-speech: model, input, voice, response_format (wav, pcm), speed."""
        body, failure = await self._body(request, SpeechRequest)
        if failure is not None:
            return failure
        audio, failure = await self._call(
            body.model, "tts", "a text-to-speech model",
            lambda a: a.speak.remote(body.input, body.engine_voice(), body.speed, body.response_format),
        )
        if failure is not None:
            return failure
        return Response(audio, media_type="audio/wav" if body.response_format == "wav" else "audio/pcm")


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
    # ... stretched linearly to this at 16+ streams on one instance (docs/serve-benchmark.md).
    coalesce_max_ms: float = Field(default=100.0, ge=0)
    # The model-server actor's GIL switch interval: how long the engine thread can wait for the
    # GIL held by the event loop or Ray's threads (Python's default: 5 ms, a whole fast GPU step).
    # 0.1 ms: H200, 10M model, 64 streams 0.68 -> 0.93 of in-process; none lost on the CPU.
    gil_switch_ms: float | None = Field(default=0.1, gt=0)
    # Vision: image parts may be data: URLs; http(s) URLs only when the operator allows fetching.
    allow_remote_images: bool = False
    max_audio_bytes: int = Field(default=25 * 1024**2, ge=1)  # OpenAI's transcription limit


def build_app(args: dict) -> serve.Application:
    a = AppArgs.model_validate(args)
    models_dir = str(Path(a.models_dir).resolve())
    models = a.models if a.models is not None else from_manifest(models_dir, a.overrides)
    server_options = {
        "coalesce_tokens": a.coalesce_tokens, "coalesce_ms": a.coalesce_ms, "coalesce_max_ms": a.coalesce_max_ms,
        "gil_switch_ms": a.gil_switch_ms,
    }
    residency = ResidencyService.bind(models, a.policy, models_dir, a.watch_period_s, server_options)
    return Ingress.bind(residency, a.chunk_timeout_s, a.api_keys, allow_remote_images=a.allow_remote_images, max_audio_bytes=a.max_audio_bytes)
