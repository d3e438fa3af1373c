"""From a parsed request and a lease to engine calls: what the model server is asked, and the
deltas (or the result) it answers with. Every failure leaves as an OrchardError.

Text generation of every protocol runs here the same way: `prepare` turns the chat (or
completion) request into the model server's request for the lease's model kind, plus the output
parser a chat protocol runs over the deltas; a `DeltaStream` submits it on this replica's channel
to the actor and yields its coalesced deltas, and a non-streamed request is a `WholeGeneration`,
one call answered once at its end. Other kinds (embeddings, rerank, audio) are one call.

A call whose instance stopped or went away before answering anything moves, once, to a fresh lease
on the same model, but only when the instance's end is known not to be the request's doing: the
residency service stopped it (engine_stopped), an operator's or the service's `ray.kill`, an
intended exit, its node's death, or an actor gone before the request reached it. When the actor's
process exited on its own (a segfault, an abort, an exit code, a SIGKILL such as an out-of-memory
kill) while the request ran on it, the request may be what killed it (same input, same death): it
is not tried again, and the client gets `model_crashed` (502) saying so."""

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import ray

from deployments.failures import crashed, death_cause, unwrap
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationDelta, GenerationRequest, VLMRequest, WholeReply, parse_request
from router.protocols import openai as oai
from router.serving.lease import Lease
from router.serving.output.families import history_messages
from router.serving.output.parsing import OutputConfig, OutputParser
from router.serving.output.tool_grammar import forced_call_grammar
from router.serving.stream_mux import StreamMux, Unavailable

ChatOrCompletion = oai.ChatCompletionRequest | oai.CompletionRequest


def crash_error(lease: Lease, e: BaseException) -> OrchardError:
    """The client's error for a request whose instance's process died while running it (`crashed`)."""
    cause = death_cause(e) or "its process exited"
    return OrchardError(
        "model_crashed",
        f"the instance of model {lease.model} died while running this request ({cause}); it was not retried, since the request may be what ended it",
    )


class ModelFacts(Protocol):
    """What building a model's request reads of the model: a lease, or a count's site (counting.py)."""

    @property
    def model(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def tool_parser(self) -> str | None: ...
    @property
    def reasoning(self) -> Any: ...


def require_kind(lease: ModelFacts, kinds: tuple[str, ...], what: str) -> None:
    if lease.kind not in kinds:
        raise OrchardError("model_not_supported", f"model {lease.model} is a {lease.kind} model, not {what}", "model")


def prepare(lease: ModelFacts, body: ChatOrCompletion, *, allow_remote_images: bool) -> tuple[GenerationRequest | VLMRequest, OutputParser | None]:
    """The model server's request for this lease's model kind (checked here, so a field the
    engine refuses is an invalid_request before anything is sent), and the output parser a chat
    protocol runs over its deltas. Raises OrchardError for what this model cannot do."""
    model = body.model
    require_kind(lease, ("llm", "vlm"), "a text-generation model")
    if not isinstance(body, oai.ChatCompletionRequest):
        if lease.kind != "llm":
            raise OrchardError("model_not_supported", f"model {model} is a {lease.kind} model: use chat completions", "model")
        return parse_request(GenerationRequest, oai.generation_fields(body)), None
    config = OutputConfig(tool_parser=lease.tool_parser, reasoning=lease.reasoning)
    parser = OutputParser(config, tools=body.uses_tools, tool_specs=[t.as_dict() for t in body.tools or ()] if body.uses_tools else None)
    if lease.kind == "vlm":
        oai.check_image_urls(body, allow_remote=allow_remote_images)
        return parse_request(VLMRequest, oai.to_vlm_request(body)), parser
    if body.has_images():
        raise OrchardError("unsupported_content", f"model {model} takes no images; use a vision model", "messages")
    generation = oai.generation_fields(body)
    if generation.get("messages"):  # past calls in the shape the model's template renders (families.py)
        generation["messages"] = history_messages(config.tool_parser, generation["messages"])
    if body.uses_tools:  # forced_tool is None unless uses_tools
        if config.tool_parser is None:
            raise OrchardError("tools_not_supported", f"model {model} has no tool-call parser configured (registry: tool_parser)", "tools")
        if body.forced_tool is not None:
            try:
                grammar = forced_call_grammar(
                    config.tool_parser, generation["tools"], body.forced_tool, parallel=body.parallel_tool_calls is True, reasoning=config.reasoning
                )
            except ValueError as e:  # a tool the parsers let through that no grammar can force
                raise OrchardError("invalid_request", f"the forced tool call cannot be built: {e}", "tools") from None
            generation["constraint"] = {"type": "lark", "grammar": grammar, "param": "tools"}
    return parse_request(GenerationRequest, generation), parser


class DeltaStream:
    """One generation's deltas from the instance: `first()` (raises the request's error when it
    failed before any output: nothing was sent to the client yet), then iterate for the rest.
    Its end, or closing it (`aclose`, also on client disconnect), cancels what is left of the
    generation in the engine and releases the lease with the tokens used (a streaming response
    that takes the stream over hands the lease off first). A failure after some output ends the
    iteration with `Unavailable`. An instance that stopped or went away before any output, for a
    reason not the request's (see the top), costs nothing: the generation moves, once, to a fresh
    lease on the same model (`Lease.move`); one whose process crashed while running it is
    `model_crashed` (`_crash`)."""

    def __init__(self, mux: StreamMux, lease: Lease, request: GenerationRequest | VLMRequest, chunk_timeout_s: float):
        self.lease = lease
        self.started = time.monotonic()
        self.ttft_s: float | None = None
        self.tokens = 0
        self.used_tokens: int | None = None  # prompt + completion, from the final delta's usage
        self._deltas = self._run(mux, request, chunk_timeout_s)

    async def _run(self, mux: StreamMux, request: GenerationRequest | VLMRequest, chunk_timeout_s: float) -> AsyncGenerator[GenerationDelta, None]:
        stream = None
        output = False
        try:
            while True:
                try:
                    if stream is None:
                        stream = mux.open(self.lease.actor(), self.lease.label, request)
                    delta = await self._next(stream, chunk_timeout_s)
                except Exception as e:
                    if not may_move(self.lease, e, output):
                        raise
                    death = await self._crash(stream, e)
                    if death is not None:
                        raise crash_error(self.lease, death) from None
                    # Nothing was generated yet and the instance stopped or went away: once, on another lease.
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

    async def _crash(self, stream: Any, e: BaseException) -> BaseException | None:
        """Ray's word that the instance's process crashed while this generation ran on it (then it
        does not move), or None. The channel only says its actor is gone (`Unavailable`): whether
        the request reached it and how the actor ended are asked of Ray, by the submit's own result
        (failed: the request never reached that process) and a call to the actor, which fails with
        the death cause the GCS recorded (a live actor only closed its channel). When Ray does not
        say within _PROBE_S, the generation does not move either: it fails as `Unavailable`."""
        if not isinstance(e, Unavailable) or stream is None:
            return e if crashed(e) else None
        try:
            await asyncio.wait_for(_result(stream.submitted), _PROBE_S)
        except TimeoutError:
            raise e from None
        except Exception:
            return None
        try:
            await asyncio.wait_for(_result(stream.reader.actor.health.remote()), _PROBE_S)
        except TimeoutError:
            raise e from None
        except Exception as probe:
            return probe if crashed(probe) else None
        return None

    async def _next(self, stream: Any, chunk_timeout_s: float) -> GenerationDelta:
        try:
            item = await stream.next(chunk_timeout_s)
        except Unavailable as e:
            self.lease.report_unavailable(str(e))
            raise
        if isinstance(item, OrchardError):  # the request failed before any output
            raise item
        return item

    async def first(self) -> GenerationDelta:
        try:
            delta = await self._deltas.__anext__()
        except StopAsyncIteration:
            raise OrchardError("empty_stream", "the model returned nothing") from None
        except Exception as e:
            raise unwrap(e) from None
        self.ttft_s = time.monotonic() - self.started
        return delta

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        return self._deltas

    async def aclose(self) -> None:
        await self._deltas.aclose()


class WholeGeneration:
    """One generation wanted whole (a non-streamed request): `run()` is one call to the instance
    (`ModelServer.generate_whole`), answered with every delta merged into one, instead of a submit
    and its channel's items (a lone short chat saved about 2 ms: docs/serve-path.md). It keeps what
    the channel path gives a request:
    - an instance that stopped or went away before answering costs nothing: since nothing reached
      the client yet, the generation moves once to a fresh lease (`Lease.move`) however far it got,
      unless its process crashed while running it (`model_crashed`: see the top);
    - an instance that makes no progress for `timeout_s` (its `progress` says so, or it does not
      answer that either) fails the request with `model_unavailable`;
    - the request's cancellation (its client went away) cancels the call, hence the generation;
    - the lease is released with the tokens used (the key's limits count them)."""

    def __init__(self, lease: Lease, request: GenerationRequest | VLMRequest, timeout_s: float):
        self.lease = lease
        self.request = request
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.ttft_s: float | None = None
        self.tokens = 0

    async def run(self) -> GenerationDelta:
        """The merged delta, or the request's OrchardError (raised)."""
        used = None
        try:
            while True:
                try:
                    reply = await self._call(self.lease.actor())
                    if isinstance(reply, OrchardError):  # the request failed before any output
                        raise reply
                    delta = reply.delta
                    code = delta.get("error_code")
                    if delta.get("finish_reason") == "error" and code is not None and code in _GONE_CODES:
                        raise OrchardError(code, delta.get("error") or "the engine stopped", retry_after_s=1)
                except Exception as e:
                    error = unwrap(e)
                    # Lease.actor reports its own error (raised here as it is, so `unwrap` returns it unchanged).
                    if (error is not e or isinstance(e, Unavailable)) and error.code in ("unavailable", "model_unavailable"):
                        self.lease.report_unavailable(error.message)
                    if crashed(e):
                        raise crash_error(self.lease, e) from None
                    if not may_move(self.lease, e):
                        raise error from None
                    await self.lease.move(error.message)
                    continue
                break
            self.tokens = len(delta.get("token_ids") or ())
            self.ttft_s = max(0.0, time.monotonic() - self.started - reply.last_s)
            usage = delta.get("usage")
            if usage:
                used = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            return delta
        finally:
            self.lease.release(used)

    async def _call(self, actor: Any) -> WholeReply | OrchardError:
        request_id = uuid.uuid4().hex
        ref = actor.generate_whole.remote(request_id, self.request)
        reply = asyncio.ensure_future(ref)
        try:
            while True:
                done, _ = await asyncio.wait((reply,), timeout=self.timeout_s)
                if done:
                    return reply.result()
                idle_s = await self._idle_s(actor, request_id)
                if reply.done():
                    return reply.result()
                if idle_s is None or idle_s >= self.timeout_s:
                    raise Unavailable(f"{self.lease.label} made no progress for {self.timeout_s:.0f} s", timed_out=True)
        finally:
            if not reply.done():  # cancelled (the client went away) or given up: the generation stops
                reply.cancel()
                ray.cancel(ref)

    async def _idle_s(self, actor: Any, request_id: str) -> float | None:
        try:
            async with asyncio.timeout(min(self.timeout_s, 5.0)):
                return await actor.progress.remote(request_id)
        except TimeoutError:
            return None

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


_GONE_CODES = ("unavailable", "engine_stopped")  # an error delta that says the instance went away, not the request failed
_PROBE_S = 10.0  # how long a stream waits for Ray to say how its instance ended (DeltaStream._crash)


async def _result(ref: Any) -> Any:
    return await ref


def may_move(lease: Lease, e: BaseException, output: bool = False) -> bool:
    """The one rule for moving a call to a fresh lease: its instance stopped or went away
    (`instance_gone`), nothing reached the client yet (`output`), and it has not moved before
    (once per request). The callers check `crashed` first: a crash is never moved."""
    return not output and not lease.moved and instance_gone(e)


def instance_gone(e: BaseException) -> bool:
    """Whether a call failed because its instance is stopping or gone (dead, or its actor name no
    longer found), not because of the request or a silent instance: worth one more try elsewhere,
    unless its process crashed under the request (`crashed`: checked by the callers)."""
    if isinstance(e, Unavailable):
        return not e.timed_out
    return unwrap(e).code in ("unavailable", "model_unavailable", "engine_stopped")


async def call(lease: Lease, method: Callable[[Any], Awaitable[Any]]) -> Any:
    """One model-server call (embed, rerank, transcribe, speak, count_tokens) on the lease's actor;
    once more on a fresh lease when the instance stopped or went away before answering, unless its
    process crashed while running the call (`model_crashed`)."""
    while True:
        try:
            return await method(lease.actor())
        except Exception as e:
            error = unwrap(e)
            if error.code in ("unavailable", "model_unavailable"):
                lease.report_unavailable(error.message)
            if crashed(e):
                raise crash_error(lease, e) from None
            if not may_move(lease, e):
                raise error from None
            await lease.move(error.message)
