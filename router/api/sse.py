"""Server-sent events for a generation: the renderer's bytes over a DeltaStream.

The generation and the client are decoupled so that a client cannot hold a lease by not reading:
a pump task drains the DeltaStream as fast as the instance answers, renders each delta and appends
the bytes to the response's buffer; the response writes from that buffer. The generation's end
therefore ends the lease (DeltaStream's close releases it) whatever the client does, and:
- a client that falls more than `STREAM_BUFFER_BYTES` behind has its generation cancelled (the
  stream ends with an error event after what it was sent);
- a write the client takes none of for `write_timeout_s` (the app's `Ingress.stream_write_timeout_s`)
  ends the response, cancelling the generation if it still runs, and resets its connection
  (router/api/connection.py: the server would otherwise hold it, and what it buffered, until the
  client closes it);
- the response ending any other way (the client went away) cancels the generation too.
Errors after the first delta end the stream with the protocol's error event, worded for the key
that asked (router.api.errors.for_principal). A stream whose first delta is late (a long prompt
being read) starts without it and sends keep-alives until it comes, so no client's idle timeout
fires during a prefill; its errors then are error events too."""

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from deployments.failures import unwrap
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationDelta
from router import metrics
from router.api import connection
from router.api.errors import for_principal
from router.api.keys import Principal
from router.serving.generation import DeltaStream
from router.serving.renderers import Renderer

log = logging.getLogger("orchard.ingress")

KEEPALIVE_S = 5.0  # between keep-alives while a prompt is read (Claude Code gives up after ~300 s without a byte)
STREAM_BUFFER_BYTES = 4 * 1024**2  # rendered bytes a stream may hold for a client that reads slower than its model writes


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends. Starlette's
    leaves an iterator that was cancelled while the response awaited `send` (a slow or gone client)
    suspended until garbage collection, and with it the generation's cancel and the lease's release
    (seen: a disconnected stream that kept generating past its client for 25 s and more)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


class _ClientStalled(Exception):
    """The client took none of a write for the write timeout."""


class StreamBuffer:
    """Rendered bytes between the pump (`put`, `end`) and the response (`chunks`): bounded by the
    pump, which cancels its generation when `over` says the client fell too far behind."""

    def __init__(self, limit_bytes: int = STREAM_BUFFER_BYTES):
        self.limit_bytes = limit_bytes
        self.size = 0
        self.ended = False
        self._chunks: deque[bytes] = deque()
        self._ready = asyncio.Event()

    def put(self, chunk: bytes) -> None:
        if chunk:
            self._chunks.append(chunk)
            self.size += len(chunk)
            self._ready.set()

    def end(self) -> None:
        self.ended = True
        self._ready.set()

    @property
    def over(self) -> bool:
        return self.size > self.limit_bytes

    async def chunks(self) -> AsyncIterator[bytes]:
        """What was put since the last write, joined (one write per wake-up), until the end."""
        while True:
            if not self._chunks:
                if self.ended:
                    return
                self._ready.clear()
                await self._ready.wait()
                continue
            chunk = b"".join(self._chunks)
            self._chunks.clear()
            self.size = 0
            yield chunk


async def pump(
    first: GenerationDelta | asyncio.Future[GenerationDelta],
    deltas: DeltaStream,
    renderer: Renderer,
    model: str,
    who: Principal,
    out: StreamBuffer,
    keepalive_s: float = KEEPALIVE_S,
) -> None:
    """Drain the generation into `out` as rendered SSE bytes; close it (cancelling what is left and
    releasing the lease) at its end, on a failure, when `out` is over its bound, or when cancelled.
    `first` still pending (a long prompt being read): the stream's start and a keep-alive (the
    protocol's `renderer.ping()`) go out now, and another every `keepalive_s` until it comes."""
    try:
        if isinstance(first, asyncio.Future):
            out.put(renderer.start() + renderer.ping())
            while True:
                done, _ = await asyncio.wait({first}, timeout=keepalive_s)
                if done:
                    break
                out.put(renderer.ping())
            first = first.result()
        out.put(renderer.start() + renderer.feed(first))
        async for delta in deltas:
            out.put(renderer.feed(delta))
            if out.over and not delta.get("finish_reason"):
                log.info("a stream of %s fell %d bytes behind its model: its generation is cancelled", model, out.size)
                out.put(
                    renderer.fail(499, "cancelled", f"the client read more than {out.limit_bytes} bytes behind the model: the generation was stopped")
                )
                break
    except Exception as e:  # Unavailable, or the instance's failure after some output
        error = for_principal(unwrap(e), who.admin, model)
        out.put(renderer.fail(error.status, error.code, error.message))
    finally:
        try:
            if isinstance(first, asyncio.Future) and not first.done():  # cancelled while the prompt was read
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
            await deltas.aclose()
        finally:
            metrics.on_request(model, deltas.ttft_s, deltas.tokens, deltas.elapsed_s())
            out.put(renderer.close())
            out.end()


class PumpedEventStream(ClosingStreamingResponse):
    """The SSE response of a generation: starts its pump at once (in the route's context), writes
    what the pump buffers, each write bounded by `write_timeout_s` (a write that times out resets
    the connection), and stops the pump (cancelling a generation still running) when the response
    ends before it."""

    def __init__(
        self,
        first: GenerationDelta | asyncio.Future[GenerationDelta],
        deltas: DeltaStream,
        renderer: Renderer,
        model: str,
        who: Principal,
        *,
        write_timeout_s: float,
        headers: dict[str, str] | None = None,
        buffer_bytes: int = STREAM_BUFFER_BYTES,
    ):
        self.buffer = StreamBuffer(buffer_bytes)
        self.write_timeout_s = write_timeout_s
        self.model = model
        self.deltas = deltas
        self.pump = asyncio.get_running_loop().create_task(pump(first, deltas, renderer, model, who, self.buffer))
        super().__init__(self.buffer.chunks(), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, timed_send)
        except* _ClientStalled:  # a task group (ASGI < 2.4) wraps it
            reset = await asyncio.to_thread(connection.reset, scope)  # a scan of this process's descriptors: off the event loop
            log.info(
                "a stream of %s: its client took nothing for %.0f s; the response ends%s",
                self.model,
                self.write_timeout_s,
                " and its connection is reset" if reset else "",
            )
        finally:
            await self.stop()

    async def stop(self) -> None:
        """End the pump now if it still runs (the generation is cancelled, the lease released)."""
        if not self.pump.done():
            self.pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, OrchardError):
            await self.pump
        await self.deltas.aclose()  # a pump cancelled before its first step never ran its own (idempotent)


event_stream = PumpedEventStream  # what routes call: the SSE response of a generation
