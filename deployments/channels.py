"""A model server's ways out for generations: a `Channel` per caller (every stream that caller opened
here, one Ray item per flush, since every Ray stream item costs ~0.75 ms of CPU end to end:
shared/ray/README.md), a `Whole` per non-streamed generation (its one reply), and a `Delivery` per
generation that the engine feeds and that ends exactly once."""

import asyncio
import time
from typing import Any, Protocol

from deployments.failures import engine_error
from deployments.wire.failure import OrchardError
from deployments.wire.generation import ChannelItem, GenerationDelta, WholeReply


class Server(Protocol):
    """What a Delivery uses of its model server: its count of calls in flight (a drain waits for
    them) and its engine (to cancel a generation)."""

    _in_flight: int
    engine: Any


# Where a request's first token spends the path's time inside a model server (counters()):
# submit_lag_s: from the ingress's submit call (its wall clock; same host or synced clocks) to this
# actor running it; first_flush_s: from a first delta's arrival in its channel to the flush that
# carries it (waiting, with backpressure 1, for the caller to take the previous flush); taken_s:
# from a flush's yield to the caller having taken it (the channel's round trip per item).
PATH_COUNTERS = {"submit_lag_s": 0.0, "submits": 0, "first_flush_s": 0.0, "first_flushes": 0, "taken_s": 0.0, "flushes": 0}


def _merge(items: list[Any]) -> Any:
    """A request's items in order -> one: deltas' text and tokens joined, the last one's finish (a
    failure before any output is its request's only item)."""
    if len(items) == 1:
        return items[0]
    out: GenerationDelta = dict(items[-1])  # type: ignore[assignment]  # a delta: a failure is never merged
    out["text"] = "".join(d.get("text") or "" for d in items)
    if "token_ids" in out:
        out["token_ids"] = [t for d in items for t in d.get("token_ids") or ()]
    if "logprobs" in out:
        given = [d["logprobs"] for d in items if d.get("logprobs") is not None]
        out["logprobs"] = [lp for part in given for lp in part] if given else None
    return out


def _size(item: ChannelItem) -> int:
    """Tokens in an item (an LLM delta lists them; a VLM delta is about one, a failure none)."""
    if isinstance(item, OrchardError):
        return 0
    return len(item["token_ids"]) if "token_ids" in item else 1


def _is_failure(delta: GenerationDelta) -> bool:
    """A first delta that only reports an error (admission failed, engine stopped)."""
    failed = delta.get("finish_reason") == "error" or delta.get("error_code") is not None
    return failed and not delta.get("text") and not delta.get("token_ids")


class Channel:
    """The outbox of one caller (an ingress replica) on one model server: every stream that caller
    opened here, merged per request and sent as ONE Ray item per flush, so the per-item cost of Ray
    (~0.75 ms of CPU end to end) is paid per flush, not per stream (shared/ray/README.md)."""

    def __init__(self, path: dict[str, float]) -> None:
        self.ready: dict[str, list[ChannelItem]] = {}
        self.tokens: dict[str, int] = {}
        self.path = path  # the server's path counters (ModelServer.counters): how long first deltas wait here
        self.firsts: list[float] = []  # when each first delta in `ready` was put
        self.open: dict[str, Delivery] = {}  # generations still running, by request id
        self.oldest: float | None = None
        self.sending = False  # a batch went out and its caller has not taken it yet (open_channel)
        self.wake = asyncio.Event()  # something is waiting to go out
        self.urgent = asyncio.Event()  # ... and should go out now (a first delta, an end, a full buffer)

    def put(self, request_id: str, item: ChannelItem, urgent: bool, most: int, first: bool = False) -> None:
        if first:
            self.firsts.append(time.monotonic())
        self.ready.setdefault(request_id, []).append(item)
        self.tokens[request_id] = self.tokens.get(request_id, 0) + _size(item)
        if self.oldest is None:
            self.oldest = time.monotonic()
        self.wake.set()
        if urgent or self.tokens[request_id] >= most:
            self.urgent.set()

    def take(self) -> list[tuple[str, ChannelItem]]:
        batch = [(rid, _merge(items)) for rid, items in self.ready.items()]
        if self.firsts:
            now = time.monotonic()
            self.path["first_flush_s"] += sum(now - t for t in self.firsts)
            self.path["first_flushes"] += len(self.firsts)
            self.firsts = []
        self.ready, self.tokens, self.oldest = {}, {}, None
        self.wake.clear()
        self.urgent.clear()
        return batch


class Whole:
    """The outbox of one whole generation (a non-streamed request, `ModelServer.generate_whole`):
    its deltas kept until the end, then answered as the call's one reply. Shaped like a Channel
    for Delivery (`put`, `open`)."""

    def __init__(self) -> None:
        self.items: list[ChannelItem] = []
        self.open: dict[str, Delivery] = {}
        self.started = self.last = time.monotonic()
        self.first_at: float | None = None
        self.done = asyncio.Event()

    def put(self, request_id: str, item: ChannelItem, urgent: bool, most: int, first: bool = False) -> None:
        self.last = time.monotonic()
        if first:
            self.first_at = self.last
        self.items.append(item)
        if isinstance(item, OrchardError) or item.get("finish_reason") is not None:
            self.done.set()

    def reply(self) -> WholeReply | OrchardError:
        """The OrchardError when it failed before any output, else every delta merged with its
        timings (WholeReply)."""
        if isinstance(self.items[0], OrchardError):
            return self.items[0]
        first_at = self.first_at if self.first_at is not None else self.last
        return WholeReply(delta=_merge(self.items), first_s=first_at - self.started, last_s=self.last - first_at)


class Delivery:
    """One generation's way into its channel. The LLM engine calls `put_nowait` on the server's
    event loop, one thread-safe call per engine step for all of them, so no task or queue per
    request stands between the engine and the channel (a VLM stream is fed by a task instead).
    Ends exactly once: its last delta, a failure, or a cancel."""

    def __init__(self, server: Server, ch: "Channel | Whole", request_id: str, most: int):
        self.server = server
        self.ch = ch
        self.request_id = request_id
        self.most = most
        self.first = True
        self.ended = False
        self.cancelled = False
        self.engine_id: int | None = None  # an LLM generation, as the engine knows it
        self.task: asyncio.Task | None = None  # what starts or feeds it (constraint compile, VLM stream)
        server._in_flight += 1  # counted from submit, not from the first step: a drain must see it
        ch.open[request_id] = self

    def put_nowait(self, delta: Any) -> None:
        if self.ended:
            return
        if self.cancelled:  # the caller is gone: only the engine's final delta matters, as the end
            if delta.finish_reason is not None:
                self._end()
            return
        d: GenerationDelta = delta.model_dump()  # the engine's Delta (or VLMDelta), in the wire's shape
        if self.first and _is_failure(d):
            self.fail(engine_error(d.get("error_code"), d.get("error"), d.get("error_param")))
            return
        if d.get("error") is not None and d.get("error_code") in (None, "internal"):  # the engine's exception text stays in the log
            d["error"] = engine_error(None, d["error"]).message
        ended = d.get("finish_reason") is not None
        self.ch.put(self.request_id, d, self.first or ended, self.most, first=self.first)
        self.first = False
        if ended:
            self._end()

    def fail(self, error: OrchardError) -> None:
        """End with an error: the OrchardError itself before any output, an error delta after some."""
        if self.ended:
            return
        if not self.cancelled:
            item: ChannelItem = (
                error
                if self.first
                else GenerationDelta(text="", finish_reason="error", error=error.message, error_code=error.code, error_param=error.param)
            )
            self.ch.put(self.request_id, item, True, self.most)
        self._end()

    def cancel(self) -> None:
        """The caller stopped reading: stop the generation; it ends when the engine confirms, or when
        the task that starts or feeds it stops (`watch`)."""
        if self.ended or self.cancelled:
            return
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()
        if self.engine_id is not None:
            self.server.engine.cancel(self.engine_id)  # an LLM/VLM engine's own

    def watch(self, task: asyncio.Task) -> None:
        """`task` starts or feeds this generation. A cancelled task ends it (also one cancelled before
        it ever ran, whose body never gets to say so), unless the engine took it by then: the
        engine's final delta ends it."""
        self.task = task

        def done(t: asyncio.Task) -> None:
            if (t.cancelled() or t.exception() is not None) and self.engine_id is None:
                self._end()

        task.add_done_callback(done)

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.server._in_flight -= 1
        self.ch.open.pop(self.request_id, None)


def open_channel(server: Any, channel_id: str) -> Any:
    """Start reading `channel_id` of a ModelServer actor (the ObjectRefGenerator of its batches).
    Backpressure 1: the actor's generator resumes after a flush only once the caller has taken
    it, so the server knows what is delivered; a drain then waits for the last batch to be taken,
    since Ray drops the items a caller has not taken yet when the actor is killed."""
    return server.channel.options(_generator_backpressure_num_objects=1).remote(channel_id)
