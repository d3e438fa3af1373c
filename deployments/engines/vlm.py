"""Vision-language engine over mlx-vlm: chat messages plus images in, streamed text deltas out, many
requests decoding in one batch.

mlx-vlm's own continuous batching (`mlx_vlm.generate.BatchGenerator`, what its server runs) batches
the language model; the vision tower runs once per request when it joins: its images and prompt
become the prompt's input embeddings (`model.get_input_embeddings`: image features merged where the
template put each image's tokens), which the generator prefills with the other arrivals' and then
decodes by token ids, the images living on in the KV cache. vllm-mlx and oMLX batch vision models the
same way. A request may carry several images (`max_images`), each where its message puts an image
part.

Images are decoded off the event loop and off the MLX thread (PIL only), so a bad image fails its
request with a clear error before anything reaches the batch. The chat template, the processor,
the vision tower and every batch step run on the engine's one MLX thread (MLX streams are
thread-local), in one loop that admits arrivals between steps; deltas of one step reach each event
loop in one hand-off. Every row of the batch shares one sampler that samples the whole batch in one
call with each row's own temperature and top-p (sampling.py). Input problems fail only their own
request with a RequestError; a broken batch step fails the requests in it, and the engine goes on.
The load measures what the model holds and the batch is held to the instance's reservation, as an
LLM's is (vlm_memory.py; rules M1, M2, M4)."""

import asyncio
import itertools
import logging
import queue
import sys
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import Engine, Frozen, MemoryReport, RequestError, queued_adds
from deployments.engines import measure
from deployments.engines.llm_scheduler import KVBudget
from deployments.engines.sampling import BatchSampler, RowSampling, sample
from deployments.engines.text_stream import StopStringFilter
from deployments.engines.vlm_inputs import ImageInputs
from deployments.engines.vlm_memory import largest_image_side, measure_vlm
from deployments.estimate import estimate
from deployments.wire.measured import MeasuredMemory
from deployments.worker import MLXWorker

logger = logging.getLogger(__name__)


class Usage(Frozen):
    prompt_tokens: int
    completion_tokens: int


class VLMDelta(Frozen):
    text: str
    finish_reason: Literal["stop", "length", "error"] | None = None
    usage: Usage | None = None  # set on the last delta only


@dataclass(eq=False)
class _Arrival:
    """A checked request whose images are decoded, waiting on the MLX thread to join the batch."""

    rid: int
    messages: list[dict]
    images: list[Any]  # PIL images, in the order of the messages' image parts
    max_tokens: int
    sampling: RowSampling
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    inputs: Any = None  # the processor's output, once templated (`_prepare`): kept while it waits for KV room


@dataclass(eq=False)
class _Stream:
    """MLX-thread state of one request in the batch."""

    arrival: _Arrival
    uid: int
    prompt_tokens: int
    final_tokens: int  # its prompt and its generation's most: what the batch cache may hold of it
    detokenizer: Any
    stops: StopStringFilter
    completion: int = 0
    pending: list[VLMDelta | BaseException] = field(default_factory=list)


class _RowSampler(BatchSampler):
    """The engine's one sampler for every row (sampling.BatchSampler), found by mlx-vlm's batches.

    mlx-vlm calls it as `sampler(logprobs)` through `_sample_with_positions`, from the
    GenerationBatch step or the PromptProcessingBatch that has just been prefilled, with one row of
    logprobs per entry of that batch's `uids`, in order; the rows are read from that caller (mlx-vlm
    is pinned; tests/test_vlm_batch.py holds this contract through the engine's outputs)."""

    def __bool__(self) -> bool:
        return True  # BatchGenerator takes `sampler or argmax`: an empty one (len 0) must still count

    def __call__(self, logprobs: Any) -> Any:
        uids = _calling_batch_uids(logprobs.shape[0])
        self.calls += 1
        self.rows_sampled += len(uids)
        return sample(logprobs, [self._rows[uid] for uid in uids])


def _calling_batch_uids(rows: int) -> list[int]:
    """The uids of the mlx-vlm batch whose step called the sampler (a few frames up)."""
    from mlx_vlm.generate.ar import GenerationBatch, PromptProcessingBatch

    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        caller = frame.f_locals.get("self")
        if isinstance(caller, GenerationBatch | PromptProcessingBatch):
            if len(caller.uids) == rows:
                return list(caller.uids)
            break
    raise RuntimeError(f"the VLM sampler was not called by an mlx-vlm batch of {rows} rows (mlx-vlm changed?)")


class VLMEngine(Engine):
    kind = "vlm"

    def __init__(
        self,
        name: str,
        path: str,
        *,
        allowed_image_dirs: Sequence[str | Path] = (),
        max_images: int = 8,
        max_image_bytes: int = 20 << 20,
        max_image_pixels: int = 4096 * 4096,
        max_batch: int = 16,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        reserve_context_tokens: int = 4096,
        reserve_concurrency: int = 1,
    ):
        super().__init__(name, path)
        if max_batch < 1 or prefill_batch < 1 or max_images < 0 or reserve_concurrency < 1 or reserve_context_tokens < 0:
            raise ValueError("max_batch, prefill_batch and reserve_concurrency must be at least 1, max_images and reserve_context_tokens at least 0")
        self.inputs = ImageInputs.of(allowed_image_dirs, max_images, max_image_bytes, max_image_pixels)
        self.max_batch = max_batch  # requests decoding together; later arrivals wait their turn
        self.prefill_batch = min(prefill_batch, max_batch)  # arrivals prefilled in one forward
        self.prefill_step = prefill_step
        # What the instance reserves (the registry's figures, as for an LLM): its KV cache for this
        # many sequences of this many tokens; the batch is held to it and the process's MLX limit
        # set from it (vlm_memory.py). 0: no KV reserved and nothing held to it.
        self.reserve_context_tokens = reserve_context_tokens
        self.reserve_concurrency = reserve_concurrency
        self.measured: MeasuredMemory | None = None
        self._kv_budget: KVBudget | None = None  # from the measurement: what the batch is held to (M4)
        self._worker: MLXWorker | None = None
        self._model: Any = None
        self._processor: Any = None
        self._generator: Any = None
        self._sampler = _RowSampler()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._loop_done: Any = None
        self._ids = itertools.count()
        self._running = 0
        self._kv = (0, 0)  # (rows in the batch, tokens of its longest row): what memory() reports
        self._kv_waits = 0  # loop turns the first waiting arrival waited for the batch's KV reservation (M4)
        # The engine's work, only growing: decode steps and the rows they carried (their ratio is the
        # mean batch), the most rows one step carried, requests and images admitted, tokens.
        self._counters: dict[str, float] = {
            "decode_steps": 0,
            "decode_rows": 0,
            "max_decode_rows": 0,
            "admitted_requests": 0,
            "images_encoded": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "failed_steps": 0,
        }

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name, interrupt=self._end_loop)  # ends the loop at exit, if never stopped
        self._model, self._processor = await self._worker.run(self._load_on_worker)
        self._image_token = getattr(self._model.config, "image_token_index", None)
        self.measured = await self._worker.run(self._measure_on_worker)
        self._context = self._model.config.text_config.max_position_embeddings
        if self.reserve_context_tokens:  # a longer prompt is refused, a longer generation stops at it
            self._context = min(self._context, self.measured.longest_sequence())
        self._kv_budget = measure.kv_budget(self.measured, self._context)  # the batch within its KV reservation (M4)
        limit = measure.set_limit(id(self), self.measured.limit_bytes)
        weakref.finalize(self, measure.set_limit, id(self), None)
        logger.info(
            "%s: weights %.1f MiB, KV %.1f MiB for %d x %d tokens, a step or an arrival's images %.1f MiB; MLX limit %.1f MiB",
            self.name, self.measured.weight_bytes / 2**20, self.measured.kv_reserved_bytes / 2**20, self.reserve_concurrency,
            self.reserve_context_tokens, self.measured.activation_bytes / 2**20, limit / 2**20,
        )  # fmt: skip
        self._loop_done = self._worker.submit(self._run_loop)

    def _load_on_worker(self):
        import mlx.core as mx
        import mlx_vlm

        mx.synchronize()
        self._active_before = mx.get_active_memory()
        model, processor = mlx_vlm.load(self.path)
        self._generator = self._new_generator(model, processor)
        return model, processor

    def _measure_on_worker(self) -> MeasuredMemory:
        """What the model holds (vlm_memory.py), measured under MLX's own limit as it will run."""
        import mlx.core as mx

        mx.synchronize()
        weights = max(0, mx.get_active_memory() - self._active_before)
        measure.unlimited()
        side = largest_image_side(self.inputs.max_image_pixels, getattr(self._processor, "image_processor", None))
        folder = estimate(self.path, self.kind)  # the folder's figures, beside the measured ones
        return measure_vlm(
            self._model.language_model,
            lambda n: self._embedded(self._prepare(_describe(n), [_blank(side)] * n)),
            lambda: self._new_generator(self._model, self._processor, measuring=True),
            lambda ids: self._embedded({"input_ids": mx.array([ids])}),
            weight_bytes=weights,
            vocab=self._model.config.text_config.vocab_size,
            max_images=self.inputs.max_images,
            reserve_context_tokens=self.reserve_context_tokens,
            reserve_concurrency=self.reserve_concurrency,
            prefill_chunk=self.prefill_step,
            prefill_rows=self.prefill_batch,
            decode_rows=self.max_batch,
            estimated_weight_bytes=folder.weight_bytes,
            estimated_cache=folder.cache,
        )

    def _new_generator(self, model: Any, processor: Any, measuring: bool = False) -> Any:
        """mlx-vlm's BatchGenerator over the language model. Its completion_batch_size leaves room
        for a whole prefill group past max_batch: it starts a group only while that many rows are
        free, and the engine itself keeps the batch to max_batch rows. `measuring`: a batch of the
        load's measurement, which samples by argmax (its rows are not the engine's sampler's)."""
        import mlx.core as mx
        from mlx_vlm.generate import BatchGenerator

        return BatchGenerator(
            model.language_model,
            processor,
            sampler=None if measuring else self._sampler,
            completion_batch_size=self.max_batch + self.prefill_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.prefill_step,
            compute_logprobs=False,
            stream=mx.default_stream(mx.default_device()),
        )

    def _end_loop(self) -> None:
        """Tell the MLX thread's loop to end after its current step (stop(), or interpreter exit)."""
        self._stopping.set()
        self._commands.put(("wake", None))

    async def _stop(self) -> None:
        self._end_loop()
        if self._loop_done is not None:
            await asyncio.wrap_future(self._loop_done)
        if self._worker is not None:
            await asyncio.to_thread(self._worker.shutdown)
        measure.set_limit(id(self), None)  # a stopped engine holds nothing: its limit leaves the process's

    def running_requests(self) -> int:
        return self._running

    def counters(self) -> dict[str, float]:
        """The engine's work counters (see __init__) and the sampler's calls and rows: they only
        grow, so two readings give a window's mean batch (decode_rows / decode_steps)."""
        return {**self._counters, "kv_waits": self._kv_waits, "sampling_calls": self._sampler.calls, "sampled_rows": self._sampler.rows_sampled}

    def memory(self) -> MemoryReport:
        # Allocator counters are process-wide and thread-safe: no need to queue behind a step.
        import mlx.core as mx

        measured = self.measured
        rows, longest = self._kv
        return MemoryReport(
            weight_bytes=measured.weight_bytes if measured is not None else 0,
            # the batch's cache holds every row at the longest row's length (left-padded)
            kv_bytes_in_use=rows * measured.sequence_bytes(longest) if measured is not None and rows else 0,
            kv_bytes_reserved=measured.kv_reserved_bytes if measured is not None else 0,
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
            measured=measured,
        )

    # ---- the request API (event loop side) ----

    async def generate(
        self,
        messages: list[dict],
        *,
        images: list[str],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
    ) -> AsyncIterator[VLMDelta]:
        """Stream one request's deltas, the last with finish_reason and usage. Closing the iterator
        early takes the request out of the batch at the next step."""
        self._check_ready()
        images = list(images or [])
        chat = self.inputs.messages(messages, len(images))
        refs = [self.inputs.image_ref(i, s) for i, s in enumerate(images)]
        if max_tokens < 1:
            raise RequestError("invalid_request", "max_tokens must be at least 1", "max_tokens")
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError("invalid_request", "temperature must be >= 0 and top_p in (0, 1]", "temperature")
        decoded = await asyncio.to_thread(self.inputs.decode_all, refs) if refs else []
        self._check_ready()  # it may have stopped while the images were decoded

        rid = next(self._ids)
        out: asyncio.Queue[VLMDelta | BaseException] = asyncio.Queue()
        sampling = RowSampling.of(temperature, top_p, 0.0, 0, None, None)
        arrival = _Arrival(rid, chat, decoded, max_tokens, sampling, list(stop or []), asyncio.get_running_loop(), out)
        self._running += 1
        self._commands.put(("add", arrival))
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._running -= 1
            if not finished:
                self._commands.put(("cancel", rid))

    # ---- the loop (MLX thread) ----

    def _run_loop(self) -> None:
        streams: dict[int, _Stream] = {}  # by generator uid
        held: deque[_Arrival] = deque()  # arrived, waiting for room in the batch
        try:
            self._serve(streams, held)
        except Exception as e:  # a bug here must surface in health, and no request may hang
            self._status, self._detail = "failed", f"engine loop crashed: {type(e).__name__}: {e}"
            logger.exception("the VLM engine loop crashed")
            self._end_all(streams, held, RequestError("internal", self._detail))
            raise
        self._end_all(streams, held, RequestError("engine_stopped", f"model {self.name} stopped"))
        self._release_on_worker()

    def _end_all(self, streams: dict[int, _Stream], held: deque[_Arrival], error: RequestError) -> None:
        """Every request still here, queued commands included, ends with `error`."""
        waiting = [*held, *queued_adds(self._commands)]
        for stream in streams.values():
            stream.pending.append(error)
        _hand_off([(s.arrival, s.pending) for s in streams.values()])
        _hand_off([(a, [error]) for a in waiting])
        streams.clear()
        held.clear()

    def _release_on_worker(self) -> None:
        """Drop the batch and the model on the thread whose stream made them."""
        import gc

        import mlx.core as mx

        mx.synchronize()
        if self._generator is not None:
            self._generator.close()
        self._generator = None
        self._sampler.clear()
        self._model = self._processor = None
        gc.collect()
        mx.clear_cache()

    def _serve(self, streams: dict[int, _Stream], held: deque[_Arrival]) -> None:
        while not self._stopping.is_set():
            try:
                command = self._commands.get(block=not streams and not held)
                self._handle(command, streams, held)
                while True:
                    self._handle(self._commands.get_nowait(), streams, held)
            except queue.Empty:
                pass
            while held and len(streams) < self.max_batch and self._admit(held[0], streams):
                held.popleft()
            if streams:
                self._step(streams)
            produced = [(s.arrival, s.pending) for s in streams.values() if s.pending]
            for uid in [uid for uid, s in streams.items() if s.pending and _ended(s.pending)]:
                streams.pop(uid)
            for s in streams.values():
                s.pending = []
            # what memory() reads, before the ended requests hear of their end
            self._kv = (len(streams), max((s.prompt_tokens + s.completion for s in streams.values()), default=0))
            _hand_off(produced)

    def _handle(self, command: tuple[str, Any], streams: dict[int, _Stream], held: deque[_Arrival]) -> None:
        kind, payload = command
        if kind == "add":
            held.append(payload)
        elif kind == "cancel":
            waiting = next((a for a in held if a.rid == payload), None)
            if waiting is not None:
                held.remove(waiting)
                return
            uid = next((u for u, s in streams.items() if s.arrival.rid == payload), None)
            if uid is not None:
                self._generator.remove(uid)  # its KV cache goes now
                self._sampler.discard(uid)
                streams.pop(uid)

    def _admit(self, arrival: _Arrival, streams: dict[int, _Stream]) -> bool:
        """Template and processor for one arrival, then, where the batch's KV reservation has room
        for it (M4: the KV budget an LLM's batch is held to), the vision tower and into the batch. False: it waits for room
        (its processed inputs kept). A failure here is its own (its error goes to it alone)."""
        try:
            if arrival.inputs is None:
                arrival.inputs = self._prepare(arrival.messages, arrival.images)
                self._check_prompt(arrival)
            prompt = int(arrival.inputs["input_ids"].shape[1])
            final = prompt + min(arrival.max_tokens, self._context - prompt)
            budget = self._kv_budget  # a first row always joins: the engine's context keeps it within one share
            if budget is not None and streams and not budget.fits([*(s.final_tokens for s in streams.values()), final]):
                self._kv_waits += 1
                return False
            uid = self._insert(arrival, final - prompt)
        except Exception as e:
            if not isinstance(e, RequestError):
                logger.error("a VLM request failed before it joined the batch", exc_info=e)
                e = RequestError("internal", f"{type(e).__name__}: {e}")
            _hand_off([(arrival, [e])])
            return True
        from mlx_vlm.tokenizer_utils import make_streaming_detokenizer

        streams[uid] = _Stream(arrival, uid, prompt, final, make_streaming_detokenizer(self._processor), StopStringFilter(arrival.stops))
        self._counters["admitted_requests"] += 1
        self._counters["images_encoded"] += len(arrival.images)
        self._counters["prompt_tokens"] += prompt
        return True

    def _prepare(self, messages: list[dict], images: list[Any]) -> Any:
        """The chat template and the processor: the prompt's token ids and the images' pixels."""
        prompt = self._processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # Called without tokenizer kwargs: mlx-vlm's prepare_inputs passes `padding` etc. on to
        # the image processor, which transformers 5 rejects (shared/models/README.md).
        return self._processor(text=[prompt], images=images or None)

    def _check_prompt(self, arrival: _Arrival) -> None:
        input_ids = arrival.inputs["input_ids"]
        n_prompt = int(input_ids.shape[1])
        why = measure.refusal(self.measured, n_prompt) if self.reserve_context_tokens else None
        if why is not None:  # its own cache would pass its share of the reservation
            raise RequestError("context_length_exceeded", why, "messages")
        if n_prompt >= self._context:  # a max_tokens past the room left is clamped: docs/protocols.md
            raise RequestError(
                "context_length_exceeded", f"the {n_prompt}-token prompt leaves no room to generate in the {self._context}-token context", "messages"
            )
        if arrival.images and self._image_token is not None and not bool((input_ids == self._image_token).any()):
            raise RequestError("invalid_request", "the chat template left out the images' places in the prompt", "messages")

    def _embedded(self, inputs: Any) -> dict[str, Any]:
        """The vision tower: the images' features merged into the prompt's embeddings, evaluated
        (the images' cost is paid here, between two batch steps, not inside one)."""
        import mlx.core as mx

        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        embedded = self._model.get_input_embeddings(inputs["input_ids"], inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra)
        prompt_kwargs = {**extra, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
        mx.eval(prompt_kwargs["inputs_embeds"])
        return prompt_kwargs

    def _insert(self, arrival: _Arrival, max_tokens: int) -> int:
        prompt_kwargs = self._embedded(arrival.inputs)
        (uid,) = self._generator.insert([arrival.inputs["input_ids"][0].tolist()], max_tokens=max_tokens, prompt_kwargs=[prompt_kwargs])
        arrival.inputs = None  # the pixels are the batch's now
        self._sampler.add(uid, arrival.sampling)
        return uid

    def _step(self, streams: dict[int, _Stream]) -> None:
        """One batch step: a decode step for every row, or a prefill chunk of the arrivals."""
        try:
            _, responses = self._generator.next()
        except Exception as e:  # a broken step must not kill the engine: fail its rows, go on
            logger.error("a VLM batch step failed; its %d requests end with an error", len(streams), exc_info=e)
            self._counters["failed_steps"] += 1
            for stream in streams.values():
                self._sampler.discard(stream.uid)
                if stream.completion:
                    stream.pending.append(self._final(stream, "error"))
                else:
                    stream.pending.append(RequestError("internal", f"{type(e).__name__}: {e}"))
            self._generator.close()
            self._generator = self._new_generator(self._model, self._processor)
            return
        if responses:
            self._counters["decode_steps"] += 1
            self._counters["decode_rows"] += len(responses)
            self._counters["max_decode_rows"] = max(self._counters["max_decode_rows"], len(responses))
        for r in responses:
            row = streams.get(r.uid)
            if row is not None and self._advance(row, r):
                self._sampler.discard(r.uid)
                if r.finish_reason is None:  # cut by a stop string: still in the batch
                    self._generator.remove(r.uid)

    def _advance(self, stream: _Stream, r: Any) -> bool:
        """Take one generated token; returns whether the stream is finished."""
        eos = r.finish_reason == "stop"  # the end-of-sequence token: not part of the text
        if not eos:
            stream.completion += 1
            self._counters["generation_tokens"] += 1
            stream.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            stream.detokenizer.finalize()
        text = stream.stops.push(stream.detokenizer.last_segment)
        if stream.stops.stopped:
            stream.pending.append(self._final(stream, "stop", text))
            return True
        if r.finish_reason is not None:
            stream.pending.append(self._final(stream, r.finish_reason, text + stream.stops.flush()))
            return True
        if text:
            stream.pending.append(VLMDelta(text=text))
        return False

    def _final(self, stream: _Stream, reason: Literal["stop", "length", "error"], text: str = "") -> VLMDelta:
        return VLMDelta(text=text, finish_reason=reason, usage=Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=stream.completion))


def _describe(images: int) -> list[dict]:
    """A user message with `images` image parts: what the load measures the vision step with."""
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": "Describe."}]}]


def _blank(side: int) -> Any:
    from PIL import Image

    return Image.new("RGB", (side, side), (127, 127, 127))


def _ended(pending: list[VLMDelta | BaseException]) -> bool:
    last = pending[-1]
    return isinstance(last, BaseException) or last.finish_reason is not None


def _hand_off(items: list[tuple[_Arrival, list[VLMDelta | BaseException]]]) -> None:
    """One thread-safe call per event loop carries what one step produced for all its requests:
    a step's text deltas of a request merged into one."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list[VLMDelta | BaseException]]]] = {}
    for arrival, pending in items:
        if pending:
            by_loop.setdefault(arrival.loop, []).append((arrival.out, _merged(pending)))
    for loop, batch in by_loop.items():

        def put_all(batch: list[tuple[asyncio.Queue, list[VLMDelta | BaseException]]] = batch) -> None:
            for out, deltas in batch:
                for delta in deltas:
                    out.put_nowait(delta)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:
            pass  # that event loop is closed: its client is gone


def _merged(pending: list[VLMDelta | BaseException]) -> list[VLMDelta | BaseException]:
    """One step's deltas of one request: its texts as one delta, the last delta or error kept."""
    texts = [d.text for d in pending if isinstance(d, VLMDelta) and d.finish_reason is None]
    last = pending[-1]
    if isinstance(last, BaseException) or last.finish_reason is not None:
        if isinstance(last, VLMDelta):
            return [last.model_copy(update={"text": "".join(texts) + last.text})]
        return ([VLMDelta(text="".join(texts))] if any(texts) else []) + [last]
    return [VLMDelta(text="".join(texts))]
