"""The ingress end of multiplexed streaming: one channel per model-server actor per ingress replica.

Every generation this replica runs on an actor shares one Ray stream (ModelServer.channel): the
actor sends one item per flush carrying the merged deltas of all those generations, and a reader
task here fans them out to per-request queues. Relaying one Ray item per stream per flush cost
about 0.75 ms of CPU each (shared/ray/README.md); per actor per flush, that cost no longer grows
with the number of open streams.

The reader never waits for a request's consumer (one slow request must not stall the channel's
other streams): each request's queue holds at most `MAX_QUEUED` items, and a request whose consumer
lets it fill is cancelled (its generation stopped in the engine, its stream ended with `Overrun`)
instead. The ingress's consumer drains its queue as the items come (router/api/sse.py's pump), so a
reading client, however slow, never meets this bound."""

import asyncio
import contextlib
import time
import uuid
from typing import Any

import ray

from cluster.ray_api import actor_id
from deployments.channels import open_channel
from deployments.wire.failure import OrchardError
from deployments.wire.generation import ChannelItem, GenerationRequest, VLMRequest
from router.serving.detached import send_detached

MAX_QUEUED = 1024  # items (one per flush) a request's consumer may leave unread before it is cancelled


class Unavailable(OrchardError):
    """The instance died or stopped answering mid-request (`timed_out`: it only went silent):
    model_unavailable, worth another try in a second."""

    timed_out = False  # also once unpickled (OrchardError pickles by its own fields)

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__("model_unavailable", message, retry_after_s=1)
        self.timed_out = timed_out


class Overrun(OrchardError):
    """A request's consumer left MAX_QUEUED items unread: the generation was cancelled."""

    def __init__(self) -> None:
        super().__init__("cancelled", f"the stream was not read ({MAX_QUEUED} deliveries waited): its generation was stopped")


_GONE = object()  # put in every queue of a channel whose actor went away
_OVERRUN = object()  # put in a request's queue when it filled: the request was cancelled


class _Reader:
    """Reads one actor's channel and routes each (request_id, delta) to that request's queue."""

    def __init__(self, mux: "StreamMux", key: str, actor: Any, label: str):
        self.mux = mux
        self.key = key
        self.actor = actor
        self.label = label
        self.channel_id = f"{mux.replica_id}:{uuid.uuid4().hex[:8]}"
        self.streams: dict[str, MuxStream] = {}
        self.failure: str | None = None
        self.stream = open_channel(actor, self.channel_id)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for ref in self.stream:
                for request_id, item in await ref:
                    stream = self.streams.get(request_id)
                    if stream is not None:
                        stream.deliver(item)
            self.failure = f"{self.label} closed its stream"
        except asyncio.CancelledError:
            self.failure = f"{self.label}: the ingress stopped reading"
            raise
        except Exception as e:  # RayActorError, ActorUnavailableError, ...
            self.failure = f"{self.label} is unavailable: {type(e).__name__}"
        finally:
            self.mux._forget(self)
            for stream in self.streams.values():
                stream.queue.put_nowait(_GONE)


class MuxStream:
    """One generation's items from its channel (its deltas, or its failure before any output),
    with a per-item inactivity timeout."""

    def __init__(self, reader: _Reader, request_id: str, submitted: Any = None):
        self.reader = reader
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.submitted = submitted  # the submit call's ObjectRef: a cancel is sent only after it ran

    def deliver(self, item: ChannelItem) -> None:
        """The reader's hand-off: queue `item`, or cancel the request when its consumer left
        MAX_QUEUED items unread (never wait: the channel carries other requests' streams)."""
        if self.queue.qsize() < MAX_QUEUED:
            self.queue.put_nowait(item)
            return
        self.close()  # unrouted, and its generation cancelled in the engine
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_OVERRUN)

    async def next(self, timeout_s: float) -> ChannelItem:
        try:
            if self.queue.empty():
                async with asyncio.timeout(timeout_s):  # no task per item, unlike wait_for
                    item = await self.queue.get()
            else:
                item = self.queue.get_nowait()
        except TimeoutError:
            raise Unavailable(f"{self.reader.label} sent nothing for {timeout_s:.0f} s", timed_out=True) from None
        if item is _GONE:
            raise Unavailable(self.reader.failure or f"{self.reader.label} is unavailable")
        if item is _OVERRUN:
            raise Overrun()
        if isinstance(item, OrchardError) or item.get("finish_reason") is not None:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop routing; cancel the generation in the engine unless it already ended (sent detached:
        a cancel sent in the request's context is cancelled with the request, router/serving/detached.py)."""
        self.reader.streams.pop(self.request_id, None)
        if not self.finished and self.reader.failure is None:
            send_detached(_Cancel(self.reader.actor, self.submitted), self.request_id)
        self.finished = True


class _Cancel:
    """`actor.cancel` sent after the request's submit has run: Ray does not order an async actor's
    calls, and a cancel that overtook its submit would find nothing and the generation would run on
    for nobody (seen in the model server's tests). Shaped like a Ray method for send_detached."""

    def __init__(self, actor: Any, submitted: Any):
        self.actor, self.submitted = actor, submitted

    async def remote(self, request_id: str) -> Any:
        if self.submitted is not None:
            with contextlib.suppress(Exception):  # failed or gone: the cancel goes anyway (a no-op then)
                await self.submitted
        return await self.actor.cancel.remote(request_id)


class StreamMux:
    """Channels of one ingress replica, keyed by actor id (an actor placed again under the same name
    is a new actor, hence a new channel)."""

    def __init__(self) -> None:
        self.replica_id = uuid.uuid4().hex[:12]
        self._readers: dict[str, _Reader] = {}

    def open(self, actor: Any, label: str, request: GenerationRequest | VLMRequest) -> MuxStream:
        """Submit `request` to `actor` (not awaited: a request the server refuses comes back on the
        channel as its OrchardError) and return its stream."""
        key = actor_id(actor)
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = _Reader(self, key, actor, label)
        request_id = uuid.uuid4().hex
        stream = reader.streams[request_id] = MuxStream(reader, request_id)
        stream.submitted = actor.submit.remote(reader.channel_id, request_id, request, sent_at=time.time())
        return stream

    def _forget(self, reader: _Reader) -> None:
        if self._readers.get(reader.key) is reader:
            del self._readers[reader.key]

    def close(self) -> None:
        """Close every channel (the replica is shutting down): each actor cancels what was open."""
        for reader in list(self._readers.values()):
            reader.task.cancel()
            with contextlib.suppress(Exception):
                ray.cancel(reader.stream)
