"""A streaming client cannot hold a lease by not reading (issue 25 item 4), in pure asyncio: the SSE
response's pump drains the generation whatever the client does (its end releases the lease), a
client that falls too far behind has its generation cancelled, a write the client takes nothing of
ends the response after the write timeout (and its connection is reset: a real socket here), and a
reading client, however slow, gets every byte. The stream mux never waits for a request's consumer:
one whose queue fills is cancelled alone."""

import asyncio
import errno
import socket

import pytest

from router.api import connection, sse
from router.api.keys import Principal
from router.serving import stream_mux

USER = Principal(name="team-a", role="user", models=frozenset({"m"}))


class FakeDeltas:
    """A DeltaStream's surface: deltas at `interval_s`, then its end; `aclose` is what releases."""

    def __init__(self, n: int, interval_s: float = 0.0, text: str = "x" * 50):
        self.n, self.interval_s, self.text = n, interval_s, text
        self.sent = 0
        self.released_at: float | None = None
        self.finished = False
        self.ttft_s, self.tokens = 0.0, 0
        self._gen = self._run()

    async def _run(self):
        try:
            for i in range(self.n):
                await asyncio.sleep(self.interval_s)
                self.sent += 1
                last = i == self.n - 1
                self.finished = last
                yield {"text": self.text, "finish_reason": "length" if last else None}
        finally:
            if self.released_at is None:
                self.released_at = asyncio.get_running_loop().time()

    def __aiter__(self):
        return self._gen

    async def aclose(self):
        await self._gen.aclose()
        if self.released_at is None:
            self.released_at = asyncio.get_running_loop().time()

    def elapsed_s(self) -> float:
        return 0.0


class TextRenderer:
    def start(self) -> bytes:
        return b"start\n"

    def feed(self, delta: dict) -> bytes:
        return f"data: {delta['text']}\n".encode()

    def fail(self, status: int, code: str, message: str) -> bytes:
        return f"error: {status} {code} {message}\n".encode()

    def close(self) -> bytes:
        return b"done\n"


@pytest.fixture(autouse=True)
def _no_ray_metrics(monkeypatch):
    monkeypatch.setattr(sse.metrics, "on_request", lambda *a, **k: None)


async def _serve(response, send, spec_version: str = "2.4") -> None:
    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)


async def _never_reading(n: int, write_timeout_s: float, limit_bytes: int | None = None) -> tuple[FakeDeltas, float, float, list[bytes]]:
    """A client that takes the headers and nothing of the body. Returns (deltas, when the lease was
    released, when the response ended, the body writes it was offered)."""
    loop = asyncio.get_running_loop()
    deltas = FakeDeltas(n, interval_s=0.001)
    first = await deltas._gen.__anext__()
    offered: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            offered.append(message["body"])
            await asyncio.Event().wait()  # the client's window is shut: the write never completes

    response = sse.event_stream(
        first,
        deltas,  # type: ignore[arg-type]
        TextRenderer(),  # type: ignore[arg-type]
        "m",
        USER,
        write_timeout_s=write_timeout_s,
        buffer_bytes=limit_bytes or sse.STREAM_BUFFER_BYTES,
    )
    started = loop.time()
    await asyncio.wait_for(_serve(response, send), timeout=10)
    ended = loop.time()
    assert deltas.released_at is not None
    return deltas, deltas.released_at - started, ended - started, offered


def test_a_client_that_never_reads_releases_at_the_generations_end_and_is_cut_at_the_write_timeout():
    deltas, released_s, ended_s, offered = asyncio.run(_never_reading(200, write_timeout_s=1.0))
    assert deltas.finished and deltas.sent == 200  # the whole generation ran: nothing was cancelled
    assert released_s < 0.8  # at the generation's end (200 deltas of 1 ms), not at the write timeout
    assert 1.0 <= ended_s < 2.0  # the stuck write ended the response after the write timeout
    assert len(offered) == 1  # the one write it never took


def test_a_client_too_far_behind_has_its_generation_cancelled():
    deltas, released_s, _, _ = asyncio.run(_never_reading(100_000, write_timeout_s=1.0, limit_bytes=10_000))
    assert not deltas.finished and deltas.sent < 1000  # cancelled at the bound (57 bytes a delta), long before its end
    assert released_s < 0.9


def test_a_slow_reader_gets_every_byte():
    async def run() -> tuple[bytes, FakeDeltas]:
        deltas = FakeDeltas(300, interval_s=0.0005)
        first = await deltas._gen.__anext__()
        got: list[bytes] = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                await asyncio.sleep(0.01)  # slower than the model, never stuck
                got.append(message["body"])

        response = sse.event_stream(first, deltas, TextRenderer(), "m", USER, write_timeout_s=1.0)  # type: ignore[arg-type]
        await asyncio.wait_for(_serve(response, send), timeout=10)
        return b"".join(got), deltas

    body, deltas = asyncio.run(run())
    assert deltas.finished
    assert body == b"start\n" + b"data: " + b"x" * 50 + b"\n" + (b"data: " + b"x" * 50 + b"\n") * 299 + b"done\n"


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_client_gone_mid_stream_cancels_the_generation(spec_version):
    async def run() -> FakeDeltas:
        deltas = FakeDeltas(10_000, interval_s=0.001)
        first = await deltas._gen.__anext__()
        sent = asyncio.Event()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                sent.set()
                await asyncio.Event().wait()

        response = sse.event_stream(first, deltas, TextRenderer(), "m", USER, write_timeout_s=60.0)  # type: ignore[arg-type]
        task = asyncio.create_task(_serve(response, send, spec_version))
        await sent.wait()
        task.cancel()  # the server cancels the request: its client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        return deltas

    deltas = asyncio.run(run())
    assert deltas.released_at is not None and not deltas.finished


def test_a_failure_mid_stream_reaches_a_user_key_without_the_instances_details():
    class Failing(FakeDeltas):
        async def _run(self):
            yield {"text": "a", "finish_reason": None}
            raise stream_mux.Unavailable("model m on mac-studio-2 is unavailable: RayActorError")

    async def run(who: Principal) -> bytes:
        deltas = Failing(0)
        first = await deltas._gen.__anext__()
        got: list[bytes] = []

        async def send(message: dict) -> None:
            got.append(message.get("body", b""))

        await _serve(sse.event_stream(first, deltas, TextRenderer(), "m", who, write_timeout_s=1.0), send)  # type: ignore[arg-type]
        return b"".join(got)

    user = asyncio.run(run(USER))
    assert b"error: 503 model_unavailable" in user and b"mac-studio-2" not in user and b"RayActorError" not in user
    admin = asyncio.run(run(Principal(name="ops", role="admin")))
    assert b"mac-studio-2" in admin


class _FakeActor:
    def __init__(self):
        self.cancelled: list[str] = []

        async def cancel(request_id: str) -> None:
            self.cancelled.append(request_id)

        self.cancel = type("M", (), {"remote": staticmethod(cancel)})()


class _FakeReader:
    def __init__(self):
        self.actor = _FakeActor()
        self.label = "model m on n1"
        self.failure = None
        self.streams: dict[str, stream_mux.MuxStream] = {}


def test_the_mux_cancels_a_request_whose_consumer_lets_its_queue_fill_and_never_waits():
    async def run():
        reader = _FakeReader()
        slow = reader.streams["slow"] = stream_mux.MuxStream(reader, "slow")  # type: ignore[arg-type]
        fine = reader.streams["fine"] = stream_mux.MuxStream(reader, "fine")  # type: ignore[arg-type]
        read = 0
        for i in range(stream_mux.MAX_QUEUED + 1):  # what the reader does per flush: never awaits
            slow.deliver({"text": str(i)})
            fine.deliver({"text": str(i)})
            if i % 100 == 0:  # this one's consumer keeps up: it reads everything in order
                while not fine.queue.empty():
                    assert (await fine.next(1.0))["text"] == str(read)
                    read += 1
        await asyncio.sleep(0.01)  # the detached cancel runs
        with pytest.raises(stream_mux.Overrun) as info:
            await slow.next(1.0)
        return reader, info.value

    reader, error = asyncio.run(run())
    assert reader.actor.cancelled == ["slow"] and "slow" not in reader.streams and "fine" in reader.streams
    assert error.code == "cancelled" and "n1" not in error.message


def test_a_connection_given_up_on_is_reset():
    """router/api/connection.py: an asyncio server holds megabytes for a client that reads nothing
    (what uvicorn's close would wait to flush); the connection's socket, found by the scope's two
    addresses, is reset: the server's transport closes at once and the client sees ECONNRESET."""

    async def run() -> tuple[bool, bool, int]:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        server = await asyncio.start_server(lambda _r, w: accepted.set_result(w), "127.0.0.1", 0)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await loop.sock_connect(client, server.sockets[0].getsockname())
            writer = await accepted
            writer.write(b"x" * 16 * 1024**2)  # more than the kernel takes: the rest waits in the transport
            await asyncio.sleep(0.1)
            assert writer.transport.get_write_buffer_size() > 0
            stranger = connection.reset({"client": ("127.0.0.1", 1), "server": writer.get_extra_info("sockname")})
            found = connection.reset({"client": writer.get_extra_info("peername"), "server": writer.get_extra_info("sockname")})
            for _ in range(100):
                error = client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    break
                await asyncio.sleep(0.02)
            return stranger, found and writer.transport.is_closing(), error
        finally:
            client.close()
            server.close()

    stranger, found, error = asyncio.run(run())
    assert not stranger  # no socket of this process has those addresses: nothing is touched
    assert found and error == errno.ECONNRESET
    assert not connection.reset({"type": "http"})  # no addresses (an ASGI server that gives none)
