"""Server-sent events for a generation: the renderer's bytes over a DeltaStream. Closing the
response (client gone) closes the stream, which cancels the generation and releases the lease."""

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.residency import metrics
from router.serving.generation import DeltaStream
from router.serving.renderers import Renderer
from router.serving.stream_mux import Unavailable


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


async def _events(first: dict, deltas: DeltaStream, renderer: Renderer, model: str) -> AsyncIterator[bytes]:
    try:
        yield renderer.start() + renderer.feed(first)
        async for delta in deltas:
            yield renderer.feed(delta)
    except Unavailable as e:
        yield renderer.fail(503, "model_unavailable", str(e))
    finally:
        await deltas.aclose()
        metrics.on_request(model, deltas.ttft_s, deltas.tokens, deltas.elapsed_s())
    yield renderer.close()


def event_stream(first: dict, deltas: DeltaStream, renderer: Renderer, model: str, headers: dict[str, str] | None = None) -> StreamingResponse:
    return ClosingStreamingResponse(_events(first, deltas, renderer, model), media_type="text/event-stream", headers=headers)
