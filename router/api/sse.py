"""Server-sent events for a generation: the renderer's bytes over a DeltaStream. Closing the
response (client gone) closes the stream, which cancels the generation and releases the lease."""

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from router.residency import metrics
from router.serving.generation import DeltaStream
from router.serving.renderers import Renderer
from router.serving.stream_mux import Unavailable


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


def event_stream(first: dict, deltas: DeltaStream, renderer: Renderer, model: str) -> StreamingResponse:
    return StreamingResponse(_events(first, deltas, renderer, model), media_type="text/event-stream")
