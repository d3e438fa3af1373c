"""The model-server actor: one loaded model instance (one engine) inside its own Ray actor process.

Orchard's placement policy decides the node; `model_server_options` turns that decision into Ray
actor options (num_cpus=0 and a hard node affinity: Apple GPUs are not a Ray resource). The actor
streams LLM / VLM output coalesced and multiplexed (one channel per caller, one Ray item per flush
for all of its streams: deployments/channels.py), and turns every failure into the wire's
`OrchardError` (deployments/failures.py), which pickles across Ray by its fields. Importing this
module stays light (no MLX): cluster/model_servers.py creates the actor from here."""

import asyncio
import contextlib
import errno
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deployments.channels import PATH_COUNTERS, Channel, Delivery, Whole
from deployments.engine import RequestError
from deployments.failures import RETRY_S, engine_error, internal_error, load_error_for_caller, unwrap
from deployments.manifest import ManifestEntry, model_location
from deployments.spare import SPARE_ENTRY, NoModel, give_back_heap, keep_kernels, left_behind, process_bytes, warm_up
from deployments.wire.failure import OrchardError
from deployments.wire.generation import ChannelItem, GenerationRequest, VLMRequest, WholeReply, parse_request
from deployments.wire.measured import MeasuredMemory
from deployments.wire.reports import HealthReport, MemoryReport, Released
from deployments.wire.results import EmbeddingResult, RerankResult, TranscribedSegment, TranscriptionResult

# Which method serves which kind, and the words an error message uses for it.
_SERVES = {
    "generate": (("llm", "vlm"), "text generation"),
    "embed": (("embedding",), "embeddings"),
    "rerank": (("rerank",), "reranking"),
    "transcribe": (("stt",), "transcription"),
    "speak": (("tts",), "speech"),
}
_STT_FORMATS = ("json", "text", "verbose_json")


def model_server_options(
    *,
    ray_node_id: str | None,
    name: str | None = None,
    namespace: str | None = None,
    detached: bool = True,
    max_concurrency: int = 1000,
    **extra: Any,
) -> dict[str, Any]:
    """Ray actor options for a ModelServer. num_cpus=0: memory, not Ray's CPU count, decides what
    fits (the policy's job); a hard node affinity pins it where the policy chose; no restarts, as a
    restarted actor would hold an unloaded engine; max_concurrency bounds the open streams."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": max_concurrency, "max_restarts": 0}
    if ray_node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray_node_id, soft=False)
    if name is not None:
        options["name"] = name
        if namespace is not None:
            options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    options.update(extra)
    return options


_REMOTE = None


def remote_model_server():
    """`ray.remote(ModelServer)`, made once per process; call `.options(**model_server_options(...))`."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(ModelServer)
    return _REMOTE


class ModelServer:
    """One engine (built by deployments.models.open_engine) behind a Ray actor. Methods valid only
    for another kind raise OrchardError("unsupported"); engine RequestErrors keep their code."""

    def __init__(
        self,
        entry: ManifestEntry | dict | None,
        models_dir: str,
        node_id: str,
        *,
        engine_options: dict[str, Any] | None = None,
        coalesce_tokens: int = 4,
        coalesce_ms: float = 25.0,
        coalesce_max_ms: float | None = None,
        gil_switch_ms: float | None = None,
        load_now: bool = False,
        known_memory: MeasuredMemory | None = None,
    ):
        from deployments.models import open_engine

        keep_kernels()
        if gil_switch_ms is not None:
            # How soon a thread waiting for the GIL (the engine's, after an eval) gets it from the
            # event loop or Ray's threads; Python's default is 5 ms, a whole fast GPU step.
            sys.setswitchinterval(gil_switch_ms / 1000.0)

        self.spare = entry is None  # a process started ahead of demand (rule R1): `take` gives it its model
        self._spare_started = self.spare  # stays true once it has taken one (its dashboard row is from creation)
        self.entry = SPARE_ENTRY if entry is None else entry if isinstance(entry, ManifestEntry) else ManifestEntry.model_validate(entry)
        self.models_dir = models_dir
        self.node_id = node_id
        self.path = Path(model_location(self.entry, models_dir))
        self.coalesce_tokens = coalesce_tokens
        self.coalesce_ms = coalesce_ms
        # Channels stretch their flush interval from coalesce_ms (up to 8 streams) linearly to
        # coalesce_max_ms (16 streams and more): each SSE event costs the same CPU whatever it
        # carries, and a stream's own token rate falls as the batch grows.
        self.coalesce_max_ms = max(coalesce_ms, coalesce_max_ms if coalesce_max_ms is not None else coalesce_ms)
        self.engine: Any = NoModel() if self.spare else open_engine(self.entry, Path(models_dir), **(engine_options or {}))
        self._knows(known_memory)
        if self.spare:
            warm_up()
        self.models_held = 0 if self.spare else 1  # models this process has held in turn (R1: a spare again after each)
        self._in_flight = 0
        self._load_lock = asyncio.Lock()
        self._load_error: BaseException | None = None
        self._channels: dict[str, Channel] = {}
        self._closed_channels: set[str] = set()  # a late submit to one of these is dropped
        self._wholes: dict[str, Whole] = {}  # whole generations running (generate_whole), by request id
        self._path: dict[str, float] = dict(PATH_COUNTERS)  # where the path's time goes here (counters())
        self._exiting = False
        self._released: Released | None = None  # what `stop` gave back
        if load_now:
            self._load_in_creation()

    def __repr__(self) -> str:
        """What the Ray dashboard shows for this actor. Ray reads it once, when the creation task
        (this __init__) ends: loading in __init__ is what makes it tell the loaded state and size. A
        spare's stays what it was at creation; the model it takes names its `take` task (the
        dashboard's Tasks) and its log lines."""
        made = self.__dict__  # what __init__ set: Ray asks this too when __init__ raised (and reports why)
        if made.get("_spare_started"):
            return f"ModelServer(@{made.get('node_id', '?')}, started as a spare: its `take` task names its model)"
        where = f"{getattr(made.get('entry'), 'name', 'a model')}@{made.get('node_id', '?')}"
        if "engine" not in made:
            return f"ModelServer({where}, failed to start)"
        health = self.engine.health()
        if health.status == "ready":
            report = self.engine.memory()
            held = report.held_bytes / 2**20
            return f"ModelServer({where}, ready, {held:.1f} MiB, loaded in {report.load_seconds:.1f} s)"
        if self._load_error is not None:  # the dashboard is the operator's: the whole message
            return f"ModelServer({where}, failed to load: {type(self._load_error).__name__}: {self._load_error})"
        return f"ModelServer({where}, {health.status})"

    # ---- lifecycle ---------------------------------------------------------------------------
    def _load_in_creation(self) -> None:
        """Load during actor creation, on a thread with an event loop of its own (__init__ may run
        where the actor's loop already runs; engines keep no loop-bound state from loading). A
        failure is kept for `load` to report: the actor stays up, its repr says why."""

        def run() -> None:
            try:
                asyncio.run(self._load_engine())
            except BaseException as e:  # reported by load()
                self._load_error = e

        thread = threading.Thread(target=run, name="orchard-load")
        thread.start()
        thread.join()
        if self._load_error is not None:
            error = self._load_error
            print(f"orchard: {self.entry.name}@{self.node_id} failed to load: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        else:
            print(f"orchard: {self!r}", file=sys.stderr, flush=True)

    async def _load_engine(self) -> None:
        if not self.entry.hub and not self.path.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"model folder of {self.entry.name} not found on node {self.node_id}", str(self.path))
        await self.engine.load()

    async def load(self) -> MemoryReport:
        """Load the engine (done already when created with load_now); its MemoryReport (bytes,
        load_seconds), as `memory` answers it. FileNotFoundError when the model folder is missing on this node
        (the caller's not_found), OrchardError("load_failed") when the engine fails; loading
        twice returns the report of the first."""
        async with self._load_lock:
            if self.spare:
                raise OrchardError("invalid_request", f"the spare on {self.node_id} holds no model: `take` gives it one")
            if self._load_error is not None:
                raise load_error_for_caller(self._load_error)
            if self.engine.health().status == "ready":
                return self.memory()
            try:
                await self._load_engine()
            except Exception as e:
                print(f"orchard: {self.entry.name}@{self.node_id} failed to load: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                raise load_error_for_caller(e) from None
            return self.memory()

    def _knows(self, known: MeasuredMemory | None) -> None:
        """What an earlier load of the model measured (rule M1): the engine runs no measurement again
        where it was of the same weights under the same settings."""
        if known is not None and hasattr(self.engine, "known_memory"):
            self.engine.known_memory = known

    async def take(
        self,
        entry: ManifestEntry | dict,
        models_dir: str,
        engine_options: dict[str, Any] | None = None,
        known_memory: MeasuredMemory | None = None,
    ) -> MemoryReport:
        """A spare (rule R1) becomes `entry`'s model server and loads it, as `load` does: the process,
        its imports and the device are ready, so this costs the weights. Its actor keeps the
        spare's name (the residency service knows which model it holds), and its log says which."""
        from deployments.models import open_engine

        if not self.spare:
            raise OrchardError("invalid_request", f"this model server already holds {self.entry.name}")
        self.spare = False
        self.models_held += 1
        self.entry = entry if isinstance(entry, ManifestEntry) else ManifestEntry.model_validate(entry)
        self.models_dir = models_dir
        self.path = Path(model_location(self.entry, models_dir))
        self.engine = open_engine(self.entry, Path(models_dir), **(engine_options or {}))
        self._knows(known_memory)
        # Ray's log monitor prefixes this actor's later log lines with the name after this token
        for stream in (sys.stdout, sys.stderr):
            print(f":actor_name:ModelServer({self.entry.name}@{self.node_id}, taken spare)", file=stream, flush=True)
        print(f"orchard: the spare on {self.node_id} takes {self.entry.name}", file=sys.stderr, flush=True)
        return await self.load()

    def process_bytes(self) -> int:
        """What this process holds of its node's memory (spare.process_bytes): what a spare holds (R1's `spare_bytes`)."""
        return process_bytes()

    def health(self) -> HealthReport:
        """The HealthReport: engine health plus this server's node and its calls in flight (streams included)."""
        import ray

        scheduling = getattr(self.engine, "scheduling", None)  # an LLM engine's admission settings, as this instance runs them
        report = HealthReport(
            **self.engine.health().model_dump(),
            node_id=self.node_id,
            in_flight=self._in_flight,
            actor_name=ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None,
            scheduling=scheduling() if scheduling is not None else None,
        )
        return report

    def memory(self) -> MemoryReport:
        """What the engine holds, in bytes, and how long its load took."""
        return self.engine.memory()

    async def shrink_prefix_cache(self, target_bytes: int = 0) -> int:
        """Give back kept prompt prefixes down to `target_bytes` (what the residency loop asks of a
        node's instances before it evicts a model there for room, rule X4); the bytes freed, 0 for an
        engine that keeps none."""
        shrink = getattr(self.engine, "shrink_prefix_cache", None)
        if shrink is None or self.engine.health().status != "ready":
            return 0
        return int(await shrink(target_bytes))

    def counters(self) -> dict:
        """The engine's work counters (an LLM engine: mlx-lm's BatchGenerator counters; {} else),
        and where the path's time goes in this server (PATH_COUNTERS)."""
        read = getattr(self.engine, "counters", None)
        return (read() if read is not None else {}) | self._path

    def running(self) -> int:
        """Requests still generating, or whose last deltas still wait in a channel: a drain that
        killed the actor before the final flush would cut every stream short of its end."""
        unsent = sum(1 for ch in self._channels.values() if ch.ready or ch.sending)
        unanswered = sum(1 for w in self._wholes.values() if not w.open)  # ended, its reply not yet returned
        return max(self._in_flight, self.engine.running_requests()) + unsent + unanswered

    async def drain(self, timeout_s: float) -> int:
        """Wait until no request runs (or timeout_s); how many still run. New calls are not refused:
        the router stops sending before it drains."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.running() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        return self.running()

    async def stop(self, reason: str = "stopped") -> Released:
        """Stop the engine: running streams end (engine_stopped), later calls fail the same way. The
        engine drops its model, batch and caches and clears MLX's buffer cache as it stops; what the
        process gave back and still holds, measured here (rule X1: a placement waiting for this
        memory may load before the process has exited)."""
        if self._released is not None:  # stopped already (the exit's own stop after the release)
            return self._released
        print(f"orchard: {self.entry.name}@{self.node_id} stopping: {reason}", file=sys.stderr, flush=True)
        started = time.monotonic()
        before = self.process_bytes()
        await self.engine.stop()
        mx = sys.modules.get("mlx.core")  # imported with any engine (and a spare's warm-up)
        if mx is not None:
            mx.clear_cache()
        give_back_heap()
        released = self._released = Released(
            process_before_bytes=before,
            process_bytes=self.process_bytes(),
            mlx_bytes=mx.get_active_memory() + mx.get_cache_memory() if mx is not None else 0,
            seconds=time.monotonic() - started,
        )
        print(
            f"orchard: {self.entry.name}@{self.node_id} released {released.freed_bytes / 2**20:.0f} MiB,"
            f" {released.held_bytes / 2**20:.0f} MiB held until its process exits",
            file=sys.stderr,
            flush=True,
        )
        return released

    async def recycle(self, max_models: int) -> int | None:
        """After `stop`, become a spare again (rule R1) instead of exiting, and return this process's
        resident memory: only a process started as a spare (its actor's name says no model), that
        has held fewer than `max_models` models, whose stopped engine left no MLX memory and no
        thread behind. None (it stays stopped; the caller ends it) otherwise."""
        if not self._spare_started or self._released is None or self.models_held >= max_models or self._exiting:
            return None
        self.engine = NoModel()
        if (left := left_behind()) is not None:
            print(f"orchard: {self.entry.name}@{self.node_id} {left}: it exits", file=sys.stderr, flush=True)
            return None
        print(
            f"orchard: {self.entry.name}@{self.node_id} is the spare of {self.node_id} again ({self.models_held} models held)",
            file=sys.stderr,
            flush=True,
        )
        for stream in (sys.stdout, sys.stderr):
            print(f":actor_name:ModelServer(@{self.node_id}, spare again)", file=stream, flush=True)
        self.spare, self.entry, self._released = True, SPARE_ENTRY, None
        self.path = Path(model_location(self.entry, self.models_dir))
        return self.process_bytes()

    async def exit(self, reason: str = "stopped") -> None:
        """End this actor (after `stop`): its channels close, its log says why, and Ray records an
        intended exit (ray.actor.exit_actor) instead of a kill. The caller sees the actor die."""
        import ray

        self._exiting = True
        for ch in self._channels.values():
            ch.wake.set()
        await asyncio.sleep(0)  # let the channels' generators see it and return
        print(f"orchard: {self.entry.name}@{self.node_id} exits: {reason}", file=sys.stderr, flush=True)
        ray.actor.exit_actor()

    # ---- requests ----------------------------------------------------------------------------
    def _engine_for(self, method: str) -> Any:
        if self.spare:
            raise OrchardError("unavailable", f"this model server on {self.node_id} holds no model yet", retry_after_s=RETRY_S)
        kinds, what = _SERVES[method]
        if self.entry.kind not in kinds:
            raise OrchardError("unsupported", f"model {self.entry.name} ({self.entry.kind}) does not serve {what}", "model")
        return self.engine

    @contextlib.asynccontextmanager
    async def _call(self):
        """Count the call for drain and turn every failure into an OrchardError."""
        self._in_flight += 1
        try:
            yield
        except OrchardError:
            raise
        except RequestError as e:
            raise engine_error(e.code, e.message, e.param) from None
        except Exception as e:
            raise internal_error(e) from None
        finally:
            self._in_flight -= 1

    def _parse_generation(self, request: Any) -> GenerationRequest | VLMRequest:
        """A generation request checked for this kind: a GenerationRequest for an LLM, a VLMRequest
        for a VLM (the model itself, or its fields as a dict: a bad field is an invalid_request
        naming it)."""
        return parse_request(GenerationRequest if self.entry.kind == "llm" else VLMRequest, request)

    # ---- multiplexed streams: one Ray item per flush for all of a caller's streams -------------
    async def channel(self, channel_id: str) -> AsyncIterator[list[tuple[str, ChannelItem]]]:
        """The stream of batches for one caller: [(request_id, GenerationDelta), ...], one Ray item per
        flush. A flush goes out at once when a stream has its first delta, its end, or
        `coalesce_tokens` tokens waiting, else `flush_interval_s()` after the oldest waiting delta. A
        request that fails before any output sends its OrchardError as its only item. Closing the channel (the caller went away) cancels its requests."""
        ch = self._channel(channel_id)
        try:
            while True:
                await ch.wake.wait()
                if self._exiting and not ch.ready:
                    return
                wait_s = self.flush_interval_s(len(ch.open))
                left = ch.oldest + wait_s - time.monotonic() if ch.oldest is not None else 0.0
                if left > 0 and not ch.urgent.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(ch.urgent.wait(), left)
                ch.sending = True
                sent = time.monotonic()
                yield ch.take()  # resumes once the caller took the batch (open_channel's backpressure)
                ch.sending = False
                self._path["taken_s"] += time.monotonic() - sent
                self._path["flushes"] += 1
        finally:
            for delivery in list(ch.open.values()):
                delivery.cancel()
            self._channels.pop(channel_id, None)
            self._closed_channels.add(channel_id)

    def _channel(self, channel_id: str) -> Channel:
        """The outbox of `channel_id`, made by whichever comes first: the caller's channel() or its submit."""
        ch = self._channels.get(channel_id)
        if ch is None:
            ch = self._channels[channel_id] = Channel(self._path)
        return ch

    def flush_interval_s(self, streams: int) -> float:
        """coalesce_ms with up to 8 open streams, rising linearly to coalesce_max_ms at 16."""
        stretch = min(1.0, max(0.0, (streams - 8) / 8))
        return (self.coalesce_ms + stretch * (self.coalesce_max_ms - self.coalesce_ms)) / 1000.0

    def submit(self, channel_id: str, request_id: str, request: GenerationRequest | VLMRequest | dict, sent_at: float | None = None) -> None:
        """Start a generation whose deltas go out on `channel_id` under `request_id`. Never raises:
        a bad request is reported on the channel, so the caller need not wait for this call.
        `sent_at`: the caller's time.time() when it sent this call (counted in submit_lag_s)."""
        if sent_at is not None:
            self._path["submit_lag_s"] += time.time() - sent_at
            self._path["submits"] += 1
        if channel_id in self._closed_channels:
            return
        self._begin(self._channel(channel_id), request_id, request)

    def _begin(self, outbox: Channel | Whole, request_id: str, request: GenerationRequest | VLMRequest | dict) -> Delivery | None:
        """Start a generation whose deltas go to `outbox`; None when the request was refused (its
        failure is the outbox's one item)."""
        most = max(1, self.coalesce_tokens)
        try:
            self._engine_for("generate")
            parsed = self._parse_generation(request)
        except Exception as e:
            outbox.put(request_id, unwrap(e), True, most)
            return None
        delivery = Delivery(self, outbox, request_id, most)
        loop = asyncio.get_running_loop()
        if isinstance(parsed, VLMRequest):
            delivery.watch(loop.create_task(self._feed(delivery, parsed)))
        elif parsed.constraint is not None:  # its grammar compiles first, off the loop
            delivery.watch(loop.create_task(self._start_constrained(delivery, parsed)))
        else:
            self._start(delivery, parsed, None)
        return delivery

    async def generate_whole(self, request_id: str, request: GenerationRequest | VLMRequest | dict) -> WholeReply | OrchardError:
        """A whole generation in one call, for a caller that wants no deltas before the end (a
        non-streamed request): one Ray reply instead of a submit and a channel item. The reply is
        `Whole.reply()`: the OrchardError (returned, not raised) when it failed before any output,
        else a WholeReply, every delta merged into one (an error after some output is its
        finish_reason "error"). Cancelling the call (`ray.cancel`:
        the caller went away or gave up) cancels the generation. `progress(request_id)` says how
        long it has been since it last produced anything."""
        whole = self._wholes[request_id] = Whole()
        try:
            delivery = self._begin(whole, request_id, request)
            try:
                await whole.done.wait()
            except asyncio.CancelledError:
                if delivery is not None:
                    delivery.cancel()
                raise
            return whole.reply()
        finally:
            self._wholes.pop(request_id, None)

    def progress(self, request_id: str) -> float | None:
        """Seconds since the whole generation `request_id` last produced a delta (or started);
        None when none by that id runs here (not arrived yet, or ended)."""
        whole = self._wholes.get(request_id)
        return None if whole is None else time.monotonic() - whole.last

    def _start(self, delivery: Delivery, request: Any, grammar: Any) -> None:
        try:
            delivery.engine_id = self.engine.start(request, delivery, grammar)  # an LLM/VLM engine's own
        except Exception as e:
            delivery.fail(unwrap(e))

    async def _start_constrained(self, delivery: Delivery, request: Any) -> None:
        try:
            grammar = await self.engine.compile(request)  # an LLM/VLM engine's own
        except Exception as e:
            delivery.fail(unwrap(e))
            return
        if delivery.cancelled:
            delivery._end()
        else:
            self._start(delivery, request, grammar)

    def cancel(self, request_id: str) -> bool:
        """Cancel a submitted generation (its caller stopped reading); whether it was running."""
        outboxes: list[Channel | Whole] = [*self._channels.values(), *self._wholes.values()]
        for outbox in outboxes:
            delivery = outbox.open.get(request_id)
            if delivery is not None:
                delivery.cancel()
                return True
        return False

    async def _feed(self, delivery: Delivery, request: VLMRequest) -> None:
        """A VLM generation: its engine's delta stream -> the delivery."""
        stream = self.engine.generate(  # an LLM/VLM engine's own
            request.messages,
            images=request.images,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop=request.stop,
        )
        try:
            async for delta in stream:
                delivery.put_nowait(delta)
                if delivery.ended:
                    return
            delivery.fail(OrchardError("internal", "the engine stream ended early"))
        except Exception as e:
            delivery.fail(unwrap(e))
        finally:
            with contextlib.suppress(BaseException):
                await stream.aclose()

    async def count_tokens(self, request: GenerationRequest | dict) -> int:
        """Prompt tokens of a text-generation request as the engine would feed it (chat template,
        tools included), without generating: Anthropic's count_tokens."""
        async with self._call():
            self._engine_for("generate")
            if self.entry.kind != "llm":
                raise OrchardError("unsupported", f"model {self.entry.name} ({self.entry.kind}) does not count tokens", "model")
            return len(await asyncio.to_thread(self.engine.tokenize, self._parse_generation(request)))  # an LLM/VLM engine's own

    async def embed(self, texts: list[str] | str, dimensions: int | None = None) -> EmbeddingResult:
        """The vectors, the tokens the model ran, their dimensions."""
        async with self._call():
            return await self._engine_for("embed").embed(texts, dimensions=dimensions)

    async def rerank(self, query: str, documents: list[str], top_n: int | None = None) -> RerankResult:
        """The documents' relevance to the query, best first, and the tokens the model ran."""
        async with self._call():
            return await self._engine_for("rerank").rerank(query, documents, top_n=top_n)

    async def transcribe(
        self,
        audio: bytes,
        language: str | None = None,
        temperature: float = 0.0,
        prompt: str | None = None,
        response_format: str = "json",
    ) -> TranscriptionResult:
        """The transcription (text, language, duration_s, segments) and `body`: OpenAI's response
        for `response_format` (a dict, or a str for "text")."""
        async with self._call():
            engine = self._engine_for("transcribe")
            if response_format not in _STT_FORMATS:
                raise OrchardError(
                    "unsupported",
                    f"response_format {response_format!r} is not supported; use one of {', '.join(_STT_FORMATS)}",
                    "response_format",
                )
            result = await engine.transcribe(audio, language=language, temperature=temperature, prompt=prompt)
            return TranscriptionResult(
                text=result.text,
                language=result.language,
                duration_s=result.duration_s,
                segments=[TranscribedSegment(start=s.start, end=s.end, text=s.text) for s in result.segments],
                body=result.response(response_format),
            )

    async def speak(self, text: str, voice: str | None = None, speed: float = 1.0, response_format: str = "wav") -> bytes:
        """Encoded audio bytes (wav or pcm, OpenAI's formats the engine can write)."""
        async with self._call():
            engine = self._engine_for("speak")
            from deployments.engines.tts import FORMATS, encode

            if response_format not in FORMATS:
                raise OrchardError(
                    "unsupported",
                    f"response_format {response_format!r} is not supported; use one of {', '.join(FORMATS)}",
                    "response_format",
                )
            speech = await engine.speak(text, voice=voice, speed=speed)
            return await asyncio.to_thread(encode, speech, response_format)
