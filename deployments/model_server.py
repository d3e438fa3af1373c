"""The model-server actor: one loaded model instance (one engine) inside its own Ray actor process.

Orchard's placement policy decides the node; `model_server_options` turns that decision into Ray
actor options (num_cpus=0 and a hard node affinity: Apple GPUs are not a Ray resource). The actor
streams LLM / VLM output coalesced and multiplexed (one channel per caller, one Ray item per flush
for all of its streams), because every Ray stream item costs ~0.75 ms of CPU end to end (docs in
shared/ray/README.md), and turns every failure into the wire's `OrchardError`
(deployments/wire/failure.py), which pickles across Ray by its fields; `unwrap` takes Ray's wrappers
off again on the caller's side. Importing this module stays light (no MLX): the router imports
`unwrap` from here."""

import asyncio
import contextlib
import errno
import re
import secrets
import sys
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deployments.engine import RequestError
from deployments.manifest import ManifestEntry, model_location
from deployments.spare import SPARE_ENTRY, NoModel, keep_kernels, warm_up
from deployments.wire.failure import OrchardError
from deployments.wire.generation import ChannelItem, GenerationDelta, GenerationRequest, VLMRequest, WholeReply, parse_request
from deployments.wire.reports import HealthReport, MemoryReport
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


# Codes that say the instance went away, not that the request failed: a retry (elsewhere) may serve it.
_RETRYABLE = ("unavailable", "engine_stopped")
_RETRY_S = 1.0


def internal_error(e: BaseException | str, where: str = "the model server") -> OrchardError:
    """An unexpected failure as its caller (and so a client) sees it: `internal`, with a short
    incident id and no exception text; the exception itself (its traceback when there is one) goes
    to this process's log under the same id, for the operator."""
    incident = secrets.token_hex(4)
    if isinstance(e, BaseException):
        detail = "".join(traceback.format_exception(e)).rstrip()
    else:
        detail = e
    print(f"orchard: incident {incident} in {where}: {detail}", file=sys.stderr, flush=True)
    return OrchardError("internal", f"{where} failed unexpectedly (incident {incident}; the operator's logs have the details)")


def _engine_error(code: str | None, message: str | None, param: str | None = None) -> OrchardError:
    """An engine's failure (a RequestError, an error delta) as it may leave this process: its own
    message for an expected error, an incident id (`internal_error`) for an internal one."""
    if code in (None, "internal"):
        return internal_error(message or "generation failed", "the engine")
    return OrchardError(code, message or "generation failed", param, retry_after_s=_RETRY_S if code in _RETRYABLE else None)


def _actor_died(exc: BaseException) -> Any:
    """The RayActorError (ActorDiedError, ActorUnavailableError) behind `exc`, or None."""
    import ray.exceptions as rex

    seen: BaseException | None = exc
    for _ in range(8):
        if isinstance(seen, rex.RayActorError):
            return seen
        seen = getattr(seen, "cause", None) if isinstance(seen, rex.RayTaskError) else None
        if seen is None:
            return None
    return None


def death_cause(exc: BaseException) -> str | None:
    """What Ray says ended the model server behind a failed call (its GCS death cause: "The actor is
    dead because it was killed by `ray.kill`.", "... its worker process has died. Worker exit type:
    SYSTEM_ERROR ...", "... its node has died ..."), without the actor's id, pid, address or Ray's
    advice; None when the call did not fail for its actor's death or absence."""
    died = _actor_died(exc)
    if died is None:
        return None
    lines = [line.strip() for line in str(died).splitlines() if line.strip() and not line.startswith("\t")]
    cause = next((line for line in lines if "dead because" in line or "died because" in line), lines[-1] if lines else type(died).__name__)
    cause = cause.split(" Some common causes")[0].split(" Node Id:")[0].split(" Owner Id:")[0]
    return re.sub(r"\b[0-9a-f]{16,}\b", "…", cause)[:300]


def crashed(exc: BaseException) -> bool:
    """Whether a model-server call failed because the actor's process exited on its own: a crash
    (a segfault, an abort, any exit code) or a SIGKILL (an out-of-memory kill). Not for a
    `ray.kill` (an operator's or the residency service's), an `exit_actor` (an intended exit), its
    node's death, or an actor that was only unreachable (tests/test_security_inputs.py)."""
    import ray.exceptions as rex

    died = _actor_died(exc)
    if not isinstance(died, rex.ActorDiedError):
        return False
    text = str(died)
    return "worker process has died" in text and "INTENDED_" not in text


def unwrap(exc: BaseException) -> OrchardError:
    """The OrchardError behind whatever a call to a model server raised: Ray's RayTaskError
    (whose `.cause` is the actor's exception), a FileNotFoundError from `load` (not_found), an
    engine RequestError, a dead or unreachable actor (unavailable, with Ray's death cause), a
    cancelled task (cancelled); anything else is `internal_error` (an incident id, the exception in
    the log). The one translator: the router, the residency service and this server (for what its
    engine raised) map every failure through it. An instance that went away (unavailable,
    engine_stopped) says a retry could help (`retry_after_s`)."""
    import ray.exceptions as rex

    seen = exc
    for _ in range(8):  # RayTaskError chains (an actor calling an actor) nest causes
        if isinstance(seen, OrchardError) and not isinstance(seen, rex.RayTaskError):
            return seen
        cause = getattr(seen, "cause", None) if isinstance(seen, rex.RayTaskError) else None
        if cause is None:
            break
        seen = cause
    if isinstance(seen, OrchardError):  # a dual RayTaskError(OrchardError) without cause
        return OrchardError(seen.code, seen.message, seen.param, retry_after_s=seen.retry_after_s)
    if isinstance(seen, RequestError):
        return _engine_error(seen.code, seen.message, seen.param)
    if isinstance(seen, FileNotFoundError):
        return OrchardError("not_found", without_paths(str(seen)), "model")
    if isinstance(seen, (rex.TaskCancelledError, asyncio.CancelledError)):
        return OrchardError("cancelled", "the request was cancelled")
    if isinstance(seen, (rex.RayActorError, rex.ActorUnavailableError)):
        return OrchardError("unavailable", f"the model server is unavailable: {death_cause(seen) or type(seen).__name__}", retry_after_s=_RETRY_S)
    return internal_error(seen)


# The folders of an absolute path (POSIX), not a URL's nor a relative path's: what `without_paths` drops.
_FOLDERS = re.compile(r"(?<![\w.:/~-])(?:/[^\s'\"/]+)+/")


def without_paths(text: str) -> str:
    """`text` with every absolute path cut to its last part: a load failure goes to clients (a
    503's message), which must not learn where a node keeps its models; the log keeps the whole."""
    return _FOLDERS.sub("", text)


def _load_failure(e: BaseException) -> OrchardError:
    """A load that failed, as the caller sees it: not_found (no folder), else load_failed with the
    engine's exception named (the controller tells an out-of-memory from bad files by it); no
    absolute path in the message (`without_paths`)."""
    if isinstance(e, OrchardError):
        return e
    if isinstance(e, FileNotFoundError):
        return OrchardError("not_found", without_paths(str(e)), "model")
    return OrchardError("load_failed", without_paths(f"{type(e).__name__}: {e}"))


def _load_error_for_caller(e: BaseException) -> Exception:
    """What `load` raises for a failed load: a FileNotFoundError (the caller's not_found) or the
    OrchardError of `_load_failure`, without absolute paths either way."""
    failure = _load_failure(e)
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, failure.message.removeprefix(f"[Errno {errno.ENOENT}] "))
    return failure


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


# Where a request's first token spends the path's time inside a model server (counters()):
# submit_lag_s: from the ingress's submit call (its wall clock; same host or synced clocks) to this
# actor running it; first_flush_s: from a first delta's arrival in its channel to the flush that
# carries it (waiting, with backpressure 1, for the caller to take the previous flush); taken_s:
# from a flush's yield to the caller having taken it (the channel's round trip per item).
_PATH_COUNTERS = {"submit_lag_s": 0.0, "submits": 0, "first_flush_s": 0.0, "first_flushes": 0, "taken_s": 0.0, "flushes": 0}


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


class _Channel:
    """The outbox of one caller (an ingress replica) on one model server: every stream that caller
    opened here, merged per request and sent as ONE Ray item per flush, so the per-item cost of Ray
    (~0.75 ms of CPU end to end) is paid per flush, not per stream (shared/ray/README.md)."""

    def __init__(self, path: dict[str, float]) -> None:
        self.ready: dict[str, list[ChannelItem]] = {}
        self.tokens: dict[str, int] = {}
        self.path = path  # the server's path counters (ModelServer.counters): how long first deltas wait here
        self.firsts: list[float] = []  # when each first delta in `ready` was put
        self.open: dict[str, _Delivery] = {}  # generations still running, by request id
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


class _Whole:
    """The outbox of one whole generation (a non-streamed request, `ModelServer.generate_whole`):
    its deltas kept until the end, then answered as the call's one reply. Shaped like a _Channel
    for _Delivery (`put`, `open`)."""

    def __init__(self) -> None:
        self.items: list[ChannelItem] = []
        self.open: dict[str, _Delivery] = {}
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


class _Delivery:
    """One generation's way into its channel. The LLM engine calls `put_nowait` on the server's
    event loop, one thread-safe call per engine step for all of them, so no task or queue per
    request stands between the engine and the channel (a VLM stream is fed by a task instead).
    Ends exactly once: its last delta, a failure, or a cancel."""

    def __init__(self, server: "ModelServer", ch: "_Channel | _Whole", request_id: str, most: int):
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
            self.fail(_engine_error(d.get("error_code"), d.get("error"), d.get("error_param")))
            return
        if d.get("error") is not None and d.get("error_code") in (None, "internal"):  # the engine's exception text stays in the log
            d["error"] = _engine_error(None, d["error"]).message
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
        if self.spare:
            warm_up()
        self._in_flight = 0
        self._load_lock = asyncio.Lock()
        self._load_error: BaseException | None = None
        self._channels: dict[str, _Channel] = {}
        self._closed_channels: set[str] = set()  # a late submit to one of these is dropped
        self._wholes: dict[str, _Whole] = {}  # whole generations running (generate_whole), by request id
        self._path: dict[str, float] = dict(_PATH_COUNTERS)  # where the path's time goes here (counters())
        self._exiting = False
        if load_now:
            self._load_in_creation()

    def __repr__(self) -> str:
        """What the Ray dashboard shows for this actor. Ray reads it once, when the creation task
        (this __init__) ends: loading in __init__ is what makes it tell the loaded state and size. A
        spare's stays what it was at creation; the model it takes names its `take` task (the
        dashboard's Tasks) and its log lines."""
        if self._spare_started:
            return f"ModelServer(@{self.node_id}, started as a spare: its `take` task names its model)"
        health = self.engine.health()
        where = f"{self.entry.name}@{self.node_id}"
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
        import threading

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
                raise _load_error_for_caller(self._load_error)
            if self.engine.health().status == "ready":
                return self.memory()
            try:
                await self._load_engine()
            except Exception as e:
                print(f"orchard: {self.entry.name}@{self.node_id} failed to load: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                raise _load_error_for_caller(e) from None
            return self.memory()

    async def take(self, entry: ManifestEntry | dict, models_dir: str, engine_options: dict[str, Any] | None = None) -> MemoryReport:
        """A spare (rule R1) becomes `entry`'s model server and loads it, as `load` does: the process,
        its imports and the device are ready, so this costs the weights. Its actor keeps the
        spare's name (the residency service knows which model it holds), and its log says which."""
        from deployments.models import open_engine

        if not self.spare:
            raise OrchardError("invalid_request", f"this model server already holds {self.entry.name}")
        self.spare = False
        self.entry = entry if isinstance(entry, ManifestEntry) else ManifestEntry.model_validate(entry)
        self.models_dir = models_dir
        self.path = Path(model_location(self.entry, models_dir))
        self.engine = open_engine(self.entry, Path(models_dir), **(engine_options or {}))
        # Ray's log monitor prefixes this actor's later log lines with the name after this token
        for stream in (sys.stdout, sys.stderr):
            print(f":actor_name:ModelServer({self.entry.name}@{self.node_id}, taken spare)", file=stream, flush=True)
        print(f"orchard: the spare on {self.node_id} takes {self.entry.name}", file=sys.stderr, flush=True)
        return await self.load()

    def process_bytes(self) -> int:
        """This process's resident memory: what a spare holds (R1's `spare_bytes`)."""
        import psutil

        return int(psutil.Process().memory_info().rss)

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
        and where the path's time goes in this server (_PATH_COUNTERS)."""
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

    async def stop(self, reason: str = "stopped") -> None:
        """Stop the engine: running streams end (engine_stopped), later calls fail the same way."""
        print(f"orchard: {self.entry.name}@{self.node_id} stopping: {reason}", file=sys.stderr, flush=True)
        await self.engine.stop()

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
            raise OrchardError("unavailable", f"this model server on {self.node_id} holds no model yet", retry_after_s=_RETRY_S)
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
            raise _engine_error(e.code, e.message, e.param) from None
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

    def _channel(self, channel_id: str) -> _Channel:
        """The outbox of `channel_id`, made by whichever comes first: the caller's channel() or its submit."""
        ch = self._channels.get(channel_id)
        if ch is None:
            ch = self._channels[channel_id] = _Channel(self._path)
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

    def _begin(self, outbox: "_Channel | _Whole", request_id: str, request: GenerationRequest | VLMRequest | dict) -> "_Delivery | None":
        """Start a generation whose deltas go to `outbox`; None when the request was refused (its
        failure is the outbox's one item)."""
        most = max(1, self.coalesce_tokens)
        try:
            self._engine_for("generate")
            parsed = self._parse_generation(request)
        except Exception as e:
            outbox.put(request_id, unwrap(e), True, most)
            return None
        delivery = _Delivery(self, outbox, request_id, most)
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
        `_Whole.reply()`: the OrchardError (returned, not raised) when it failed before any output,
        else a WholeReply, every delta merged into one (an error after some output is its
        finish_reason "error"). Cancelling the call (`ray.cancel`:
        the caller went away or gave up) cancels the generation. `progress(request_id)` says how
        long it has been since it last produced anything."""
        whole = self._wholes[request_id] = _Whole()
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

    def _start(self, delivery: _Delivery, request: Any, grammar: Any) -> None:
        try:
            delivery.engine_id = self.engine.start(request, delivery, grammar)  # an LLM/VLM engine's own
        except Exception as e:
            delivery.fail(unwrap(e))

    async def _start_constrained(self, delivery: _Delivery, request: Any) -> None:
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
        outboxes: list[_Channel | _Whole] = [*self._channels.values(), *self._wholes.values()]
        for outbox in outboxes:
            delivery = outbox.open.get(request_id)
            if delivery is not None:
                delivery.cancel()
                return True
        return False

    async def _feed(self, delivery: _Delivery, request: VLMRequest) -> None:
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
