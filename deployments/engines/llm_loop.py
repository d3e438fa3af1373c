"""The LLM engine's MLX thread: one loop that owns mlx-lm's BatchGenerator.

Each turn drains the command queue (add, cancel, shrink), lets in the group of held arrivals the
scheduler chooses (llm_scheduler.py) with what the prefix cache gives back (llm_cache.py), runs one
generator step for every running request, turns each row's token into its stream's delta
(llm_output.py), and hands all deltas of the step to each event loop in one call. A broken step fails
the requests of that batch with `error`, makes a new generator, and goes on. A model loaded with
its measurement `provisional` (measure.py's `loaded`) has its activation passes run here, once the
loop has been idle for `measure_idle_s`; a command that comes meanwhile stops them between two
passes, and they run again at the next such moment.

`MLXLoop` is a part of LLMEngine (llm.py), which holds the state these methods share."""

import asyncio
import gc
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors

from deployments.engine import RequestError, queued_adds
from deployments.engines import buffer_cache, measure
from deployments.engines.constrained import GrammarProcessor
from deployments.engines.llm_cache import KeptPrefixes
from deployments.engines.llm_output import Delta, DeltaSink, Stream, Usage, failure, hand_off, new_stream, put
from deployments.engines.llm_scheduler import Group, Scheduler
from deployments.engines.sampling import BatchSampler, RowSampling
from deployments.engines.speculation import Speculator
from deployments.wire.generation import GenerationRequest
from deployments.wire.measured import MeasuredMemory

logger = logging.getLogger("deployments.engines.llm")

DISK_FLUSH_S = 5.0  # a stopping engine waits at most this long for its blocks to reach the disk tier


@dataclass(eq=False)
class Arrival:
    """A request tokenized and checked on the preparation thread, waiting to join the batch."""

    rid: int
    request: GenerationRequest
    tokens: list[int]
    loop: asyncio.AbstractEventLoop
    out: DeltaSink
    grammar: GrammarProcessor | None
    started: float = 0.0  # time.monotonic() at start()
    prepared: float = 0.0  # ... when the preparation thread handed it to the MLX thread
    step: int = 0  # the engine's step count when it reached the MLX thread

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens


class MLXLoop:
    """The MLX thread's part of LLMEngine (see the module's docstring)."""

    name: str
    model: Any
    tokenizer: Any
    eos_ids: list[int]
    vocab_size: int
    context_length: int
    max_batch: int
    prefill_batch: int
    generator: BatchGenerator
    sampling: BatchSampler
    speculator: Speculator | None
    scheduler: Scheduler[Arrival]
    kept: KeptPrefixes
    _status: Any
    _detail: Any
    _commands: queue.SimpleQueue
    _stopping: threading.Event
    _streams: dict[int, Stream]
    _admitted: dict[str, float]
    _retired_counters: dict[str, float]
    measured: MeasuredMemory
    measure_idle_s: float | None
    admit_gather_ms: float
    _arriving: int

    if TYPE_CHECKING:  # LLMEngine's

        def _arrived(self, n: int) -> None: ...
        def counters(self) -> dict[str, float]: ...
        @property
        def prefill_chunk(self) -> int: ...

    def _new_generator(self) -> BatchGenerator:
        old = getattr(self, "generator", None)
        if old is not None:
            self._retired_counters = self.counters()
        return BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self.eos_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.prefill_chunk,
            stream=mx.default_stream(mx.default_device()),
        )

    # ---- the loop ----------------------------------------------------------------------------
    def _run_loop(self) -> None:
        streams: dict[int, Stream] = {}  # by request id
        try:
            self._serve(streams)
        except Exception as e:  # a bug here must surface in health, and no stream may hang
            self._status, self._detail = "failed", f"engine loop crashed: {type(e).__name__}: {e}"
            for stream in streams.values():
                stream.finish("error", error=self._detail, code="internal")
            hand_off(list(streams.values()))
            self._answer_unadmitted()
            raise
        leftovers = list(streams.values())
        for stream in leftovers:
            stream.finish("cancelled", error="engine stopped", code="engine_stopped")
        hand_off(leftovers)
        self._answer_unadmitted()
        self._streams = {}
        self._release_on_worker()

    def _answer_unadmitted(self) -> None:
        """Arrivals that never joined the batch (held, or queued when the loop stopped) end too."""
        stopped = Delta(finish_reason="cancelled", error="engine stopped", error_code="engine_stopped")
        arrivals = [*self.scheduler.held, *queued_adds(self._commands)]
        self.scheduler.held.clear()
        for arrival in arrivals:
            self._arrived(-1)
            put(arrival.loop, [(arrival.out, stopped)])

    def _release_on_worker(self) -> None:
        """Drop the model, batch and caches on the thread whose stream made them (as mlx-lm's
        server does): arrays still being computed there must not outlive it."""
        mx.synchronize()
        self._retired_counters = self.counters()
        del self.generator
        buffer_cache.release(self)
        self.sampling.clear()
        self.kept.close(DISK_FLUSH_S)  # the kept KV is freed here, on the thread that made it
        self.model = None
        gc.collect()
        mx.clear_cache()

    def _serve(self, streams: dict[int, Stream]) -> None:
        by_uid: dict[int, int] = {}  # generator uid -> request id
        scheduler = self.scheduler
        busy_at = time.monotonic()  # when the loop last had work
        while not self._stopping.is_set():
            outbox: list[Stream] = []
            idle = not by_uid and not scheduler.held
            if not idle:
                busy_at = time.monotonic()
            wait = self._measure_wait(busy_at) if idle else None
            if wait == 0.0:
                self._measure_idle()
                busy_at = time.monotonic()
                continue
            gathering = self._gathering(by_uid)
            try:
                command = self._commands.get(block=idle or gathering is not None, timeout=wait if idle else gathering)
                busy_at = time.monotonic()
                self._handle(command, streams, by_uid, outbox)
                while True:
                    self._handle(self._commands.get_nowait(), streams, by_uid, outbox)
            except queue.Empty:
                pass
            if scheduler.admit_now(len(by_uid)) and self._gathering(by_uid) is None:
                self._admit_held(streams, by_uid)
            self._streams = streams
            if by_uid:
                self._step(streams, by_uid, outbox)
                scheduler.steps += 1
            hand_off(outbox, self._admitted)

    def _gathering(self, by_uid: dict[int, int]) -> float | None:
        """Seconds an idle batch still waits before it lets its held arrivals in, for the arrivals
        being prepared (tokenized) at the same time: requests that come together (a burst that waited
        for the model's load) join in one prefill group instead of the first alone and the rest a
        prefill later. None: admit as the scheduler says (the batch runs, nothing else is being
        prepared, or the first held arrival has waited `admit_gather_ms`)."""
        held = self.scheduler.held
        if by_uid or not held or self.admit_gather_ms <= 0 or self._arriving <= len(held):
            return None
        left = held[0].prepared + self.admit_gather_ms / 1000 - time.monotonic()
        return left if left > 0 else None

    def _measure_wait(self, busy_at: float) -> float | None:
        """Seconds until an idle loop measures a provisional measurement's activations (0: now);
        None when there is nothing to measure."""
        if self.measure_idle_s is None or not self.measured.provisional:
            return None
        return max(0.0, busy_at + self.measure_idle_s - time.monotonic())

    def _measure_idle(self) -> None:
        """The activation passes of a provisional measurement (measure.completed), given back to any
        command that comes between two of them; a measurement that fails is not tried again (the
        instance keeps its provisional figures: what its placement reserved)."""

        def between() -> None:
            if not self._commands.empty() or self._stopping.is_set():
                raise measure.Interrupted

        try:
            self.measured = measure.completed(cast(measure.LoadedEngine, self), self.measured, between)  # LLMEngine's
        except measure.Interrupted:
            logger.debug("%s: measurement stopped for a request; again at the next idle moment", self.name)
        except Exception:
            logger.exception("%s: measuring its activations failed; it keeps what its placement reserved", self.name)
            self.measure_idle_s = None

    def _admit_held(self, streams: dict[int, Stream], by_uid: dict[int, int]) -> None:
        """The group the scheduler lets in, each row with what the prefix cache gives it (aligned:
        prefill_align)."""
        now = time.monotonic()
        kept = self.kept
        match = kept.match if kept.blocks is not None else None
        group = self.scheduler.choose(match, lambda rid: streams[rid].tokens if rid in streams else None)
        for arrival in group.refused:  # M4: its KV could never fit the reservation (M2 refuses such a prompt first)
            self._arrived(-1)
            why = f"the request ({len(arrival.tokens)} prompt tokens) needs more KV cache than instance {self.name} reserves"
            put(arrival.loop, [(arrival.out, failure(RequestError("context_length_exceeded", why)))])
        for arrival in group.arrivals:
            self._arrived(-1)
            try:
                stream = self._admit(arrival, group)
            except Exception as e:
                put(arrival.loop, [(arrival.out, failure(e))])
                continue
            stream.started, stream.joined_step = arrival.started, self.scheduler.steps
            self._admitted["admit_wait_s"] += now - arrival.started
            self._admitted["admit_prep_s"] += arrival.prepared - arrival.started
            streams[arrival.rid] = stream
            by_uid[stream.uid] = arrival.rid
            self.scheduler.joined(group, arrival, stream.cached)

    def _admit(self, arrival: Arrival, group: Group[Arrival]) -> Stream:
        """The prompt cache's nearest prefix, and the request into the batch."""
        request, tokens = arrival.request, arrival.tokens
        cache, cached = self.kept.fetch(tokens, self.scheduler.prefix_limit(len(tokens), group.align))
        sampling = RowSampling.of(request.temperature, request.top_p, request.min_p, request.top_k, request.seed, self.vocab_size)
        stream = new_stream(request, tokens, arrival.loop, arrival.out, self.tokenizer, arrival.grammar)
        stream.cached = cached
        (stream.uid,) = self.generator.insert(
            [tokens[cached:]],
            max_tokens=[min(request.max_tokens, self.context_length - len(tokens))],  # up to the context, then "length"
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]],
            samplers=[self._sampler_of(sampling)],
            logits_processors=[_processors(request) + ([arrival.grammar] if arrival.grammar is not None else [])],  # the mask last
            stop_sequences=[StopSequences([[t] for t in self.eos_ids])],
        )
        self.sampling.add(stream.uid, sampling)
        return stream

    def _sampler_of(self, sampling: RowSampling) -> Any:
        """The sampler object a row holds: the engine's one BatchSampler for every row, whatever its
        settings (kept in it by uid), so mlx-lm samples each step's batch in one call
        (deployments/engines/sampling.py; bench.engine.samplers measures it against per-row ones)."""
        return self.sampling

    def _step(self, streams: dict[int, Stream], by_uid: dict[int, int], outbox: list[Stream]) -> None:
        """One BatchGenerator step for every running request: a verify step of draft tokens where the
        speculator finds one worth it (speculation.py), else mlx-lm's own."""
        generator, speculator = self.generator, self.speculator
        chunk = generator.prefill_step_size
        try:
            responses = speculator.step(generator) if speculator is not None else None
            if responses is None:
                if not self.scheduler.prefill_now(len(by_uid)):
                    generator.prefill_step_size = 0  # mlx-lm slices no prompt tokens: this step only decodes
                decoding = not (len(generator._prompt_batch) or generator._unprocessed_sequences)
                started = time.perf_counter()
                _, responses = generator.next()
                generator.prefill_step_size = chunk
                if speculator is not None:
                    if decoding:
                        speculator.timed_plain_step(len(generator._generation_batch), time.perf_counter() - started)
                    else:
                        speculator.not_plain()
        except Exception as e:  # a broken step must not kill the engine: fail this batch, go on
            logger.error("a batch step failed; its %d requests end with an error", len(streams), exc_info=e)
            for running in list(streams):
                stream = streams.pop(running)
                stream.finish("error", error=f"{type(e).__name__}: {e}", code="internal")
                outbox.append(stream)
            by_uid.clear()
            self.scheduler.reset()
            generator.prefill_step_size = chunk
            self.generator = self._new_generator()
            self.sampling.clear()
            if speculator is not None:
                speculator.clear()
            _reseed_rng()  # a compiled function that raised in its trace left a tracer in mx.random.state
            return
        now = time.monotonic()
        prefilled: list[int] = []  # rows whose prompts are worth keeping now
        for r in responses:
            rid = by_uid.get(r.uid)
            if rid is None:
                continue
            self.scheduler.answered(rid)  # its first token: its prefill is done
            stream = streams[rid]
            if not stream.answered:
                if self.scheduler.settings.share_prefill and r.finish_reason is None and self.kept.worth_keeping(len(stream.tokens), stream.cached):
                    prefilled.append(r.uid)
                stream.answered = True
                self._admitted["first_token_s"] += now - stream.started
                self._admitted["first_tokens"] += 1
                self._admitted["join_steps"] += self.scheduler.steps - stream.joined_step
            outbox.append(stream)
            if not stream.advance(r, self.tokenizer):
                continue
            by_uid.pop(r.uid)
            streams.pop(rid)
            self._left(r.uid)
            self.scheduler.left(rid)
            self._admitted["finished_s"] += now - stream.started
            self._admitted["finished_requests"] += 1
            if r.finish_reason is None:  # cut by a stop string: still in the batch
                self.generator.remove([r.uid])
            else:
                self.kept.keep_finished(r.all_tokens, r.prompt_cache)
        self.kept.keep_prompts(self.generator, prefilled)

    def _left(self, uid: int) -> None:
        """A row left the batch: its sampling settings and proposer go."""
        self.sampling.discard(uid)
        if self.speculator is not None:
            self.speculator.forget(uid)

    def _handle(self, command: tuple[str, Any], streams: dict[int, Stream], by_uid: dict[int, int], outbox: list[Stream]) -> None:
        kind, payload = command
        if kind == "add":
            self.scheduler.arrive(payload)
        elif kind == "shrink":
            target, done = payload
            try:
                done.set_result(self.kept.shrink(target))
            except Exception as e:  # the caller gets it; the loop goes on
                done.set_exception(e)
        elif kind == "cancel":
            held = self.scheduler.withdraw(payload)
            if held is not None:  # not in the batch yet: nothing to free
                self._arrived(-1)
                put(held.loop, [(held.out, Delta(finish_reason="cancelled", usage=Usage(prompt_tokens=len(held.tokens), completion_tokens=0)))])
                return
            cancelled = streams.pop(payload, None)
            self.scheduler.left(payload)
            if cancelled is not None:
                by_uid.pop(cancelled.uid, None)
                self.generator.remove([cancelled.uid])  # drops its KV cache now
                self._left(cancelled.uid)
                mx.synchronize()
                cancelled.finish("cancelled")
                outbox.append(cancelled)


def _reseed_rng() -> None:
    """Give this thread's MLX RNG a fresh key. A function compiled with `inputs=mx.random.state,
    outputs=mx.random.state` (as mlx-lm's samplers are) that raises while it is being traced leaves
    the compile tracer (an array without a primitive) in mx.random.state (the MLX thread's own), and
    every later unseeded sampling step fails with "[eval] Attempting to eval an array without a
    primitive". After a broken step the state may be such a tracer: a new key repairs it (unseeded
    sampling promises no sequence, so nothing is lost)."""
    mx.random.seed(secrets.randbits(64))


def _processors(request: GenerationRequest) -> list[Any]:
    return make_logits_processors(
        logit_bias=request.logit_bias,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
    )
