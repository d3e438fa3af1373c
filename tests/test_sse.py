"""The SSE response closes its body iterator when the response is cancelled mid-send (a client gone
while the proxy applied backpressure): the iterator's cleanup is what cancels the generation and
releases the lease, so it must not wait for garbage collection."""

import asyncio

import pytest
from fastapi.responses import StreamingResponse

from router.api.sse import ClosingStreamingResponse


async def _cancel_while_sending(response_class: type[StreamingResponse], spec_version: str) -> list[str]:
    seen: list[str] = []
    blocked = asyncio.Event()

    async def body():
        try:
            while True:
                yield b"data: x\n\n"
        finally:
            seen.append("closed")

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never says anything
        return {}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            blocked.set()
            await asyncio.Event().wait()  # a send that never completes: backpressure

    response = response_class(body(), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    task = asyncio.create_task(response(scope, receive, send))
    await blocked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # a scheduled close would have run by now
    closed = list(seen)
    del response  # held until here, as the server's frames hold it while the request unwinds
    return closed


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_response_cancelled_mid_send_closes_its_iterator(spec_version):
    assert asyncio.run(_cancel_while_sending(ClosingStreamingResponse, spec_version)) == ["closed"]


def test_starlettes_own_response_leaves_it_open_which_is_why_ours_exists():
    """If Starlette starts closing the iterator itself, ClosingStreamingResponse can go."""
    assert asyncio.run(_cancel_while_sending(StreamingResponse, "2.4")) == []
