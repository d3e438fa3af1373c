"""From a parsed request and a lease to engine calls: what the model server is asked, and the
deltas (or the result) it answers with. Every failure leaves as an OrchardError.

Text generation of every protocol runs here the same way: `prepare` turns the chat (or
completion) request into the model server's request for the lease's model kind, plus the output
parser a chat protocol runs over the deltas; a `DeltaStream` submits it on this replica's channel
to the actor and yields its coalesced deltas. Other kinds (embeddings, rerank, audio) are one call."""

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from deployments.model_server import ModelServerError, unwrap
from router.errors import OrchardError
from router.protocols import openai as oai
from router.serving.lease import Lease
from router.serving.output.parsing import OutputConfig, OutputParser
from router.serving.output.tool_grammar import forced_call_grammar
from router.serving.stream_mux import StreamMux, Unavailable

ChatOrCompletion = oai.ChatCompletionRequest | oai.CompletionRequest


def as_error(e: BaseException) -> OrchardError:
    """Whatever a model-server call raised, as an OrchardError (Ray's wrappers unwrapped)."""
    if isinstance(e, OrchardError):
        return e
    if isinstance(e, Unavailable):
        return OrchardError("model_unavailable", str(e), retry_after_s=1)
    f = unwrap(e)
    return OrchardError(f.code, f.message, f.param, retry_after_s=1 if f.code in ("unavailable", "engine_stopped") else None)


def require_kind(lease: Lease, kinds: tuple[str, ...], what: str) -> None:
    if lease.kind not in kinds:
        raise OrchardError("model_not_supported", f"model {lease.model} is a {lease.kind} model, not {what}", "model")


def prepare(lease: Lease, body: ChatOrCompletion, *, allow_remote_images: bool) -> tuple[dict, OutputParser | None]:
    """The model server's request for this lease's model kind, and the output parser a chat
    protocol runs over its deltas. Raises OrchardError for what this model cannot do."""
    model = body.model
    require_kind(lease, ("llm", "vlm"), "a text-generation model")
    if not isinstance(body, oai.ChatCompletionRequest):
        if lease.kind != "llm":
            raise OrchardError("model_not_supported", f"model {model} is a {lease.kind} model: use chat completions", "model")
        return oai.generation_fields(body), None
    config = OutputConfig(tool_parser=lease.tool_parser, reasoning=lease.reasoning)
    parser = OutputParser(config, tools=body.uses_tools)
    if lease.kind == "vlm":
        oai.check_image_urls(body, allow_remote=allow_remote_images)
        return oai.to_vlm_request(body), parser
    if body.has_images():
        raise OrchardError("unsupported_content", f"model {model} takes no images; use a vision model", "messages")
    generation = oai.generation_fields(body)
    if body.uses_tools:  # forced_tool is None unless uses_tools
        if config.tool_parser is None:
            raise OrchardError("tools_not_supported", f"model {model} has no tool-call parser configured (registry: tool_parser)", "tools")
        if body.forced_tool is not None:
            grammar = forced_call_grammar(
                config.tool_parser, generation["tools"], body.forced_tool, parallel=body.parallel_tool_calls is True, reasoning=config.reasoning
            )
            generation["constraint"] = {"type": "lark", "grammar": grammar}
    return generation, parser


class DeltaStream:
    """One generation's deltas from the instance: `first()` (raises the request's error when it
    failed before any output: nothing was sent to the client yet), then iterate for the rest.
    Its end, or closing it (`aclose`, also on client disconnect), cancels what is left of the
    generation in the engine and releases the lease with the tokens used (a streaming response
    that takes the stream over hands the lease off first). A failure after some output ends the
    iteration with `Unavailable`. An instance that stopped or died before any output costs nothing:
    the generation moves, once, to a fresh lease on the same model (`Lease.move`)."""

    def __init__(self, mux: StreamMux, lease: Lease, request: dict, chunk_timeout_s: float):
        self.lease = lease
        self.started = time.monotonic()
        self.ttft_s: float | None = None
        self.tokens = 0
        self.used_tokens: int | None = None  # prompt + completion, from the final delta's usage
        self.moved = False  # its first instance went away before any output: it runs on another
        self._deltas = self._run(mux, request, chunk_timeout_s)

    async def _run(self, mux: StreamMux, request: dict, chunk_timeout_s: float) -> AsyncGenerator[dict, None]:
        stream = None
        output = False
        try:
            while True:
                try:
                    if stream is None:
                        stream = mux.open(self.lease.actor(), self.lease.label, request)
                    delta = await self._next(stream, chunk_timeout_s)
                except Exception as e:
                    if output or self.moved or not instance_gone(e):
                        raise
                    # Nothing was generated yet and the instance stopped or died: once, on another lease.
                    self.moved = True
                    if stream is not None:
                        stream.close()
                        stream = None
                    await self.lease.move(str(e))
                    continue
                output = True
                self.tokens += len(delta.get("token_ids") or ())
                usage = delta.get("usage")
                if usage:
                    self.used_tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
                yield delta
                if delta.get("finish_reason"):
                    return
        finally:
            if stream is not None:
                stream.close()
            self.lease.release(self.used_tokens)

    async def _next(self, stream: Any, chunk_timeout_s: float) -> dict:
        try:
            delta = await stream.next(chunk_timeout_s)
        except Unavailable as e:
            self.lease.report_unavailable(str(e))
            raise
        if "failure" in delta:
            failure = delta["failure"]
            raise ModelServerError(failure["code"], failure["message"], failure.get("param"))
        return delta

    async def first(self) -> dict:
        try:
            delta = await self._deltas.__anext__()
        except StopAsyncIteration:
            raise OrchardError("empty_stream", "the model returned nothing") from None
        except Exception as e:
            raise as_error(e) from None
        self.ttft_s = time.monotonic() - self.started
        return delta

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._deltas

    async def aclose(self) -> None:
        await self._deltas.aclose()


def instance_gone(e: BaseException) -> bool:
    """Whether a call failed because its instance is stopping or gone (dead, or its actor name no
    longer found), not because of the request or a silent instance: worth one more try elsewhere."""
    if isinstance(e, Unavailable):
        return not e.timed_out
    return as_error(e).code in ("unavailable", "model_unavailable", "engine_stopped")


async def call(lease: Lease, method: Callable[[Any], Awaitable[Any]]) -> Any:
    """One model-server call (embed, rerank, transcribe, speak, count_tokens) on the lease's actor;
    once more on a fresh lease when the instance stopped or died before answering."""
    moved = False
    while True:
        try:
            return await method(lease.actor())
        except Exception as e:
            error = as_error(e)
            if error.code in ("unavailable", "model_unavailable"):
                lease.report_unavailable(error.message)
            if moved or not instance_gone(e):
                raise error from None
            moved = True
            await lease.move(error.message)
