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
request with a RequestError; a broken batch step fails the requests in it, and the engine goes on."""

import asyncio
import base64
import binascii
import io
import itertools
import logging
import queue
import re
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import Engine, Frozen, MemoryReport, RequestError, queued_adds
from deployments.engines.sampling import BatchSampler, RowSampling, sample
from deployments.engines.text_stream import StopStringFilter
from deployments.estimate import estimate
from deployments.worker import MLXWorker

logger = logging.getLogger(__name__)

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)
_ROLES = {"system", "user", "assistant"}
_KV_STEP = 256  # mlx-lm's KV cache grows in steps of this many tokens


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


@dataclass(eq=False)
class _Stream:
    """MLX-thread state of one request in the batch."""

    arrival: _Arrival
    uid: int
    prompt_tokens: int
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
    ):
        super().__init__(name, path)
        if max_batch < 1 or prefill_batch < 1 or max_images < 0:
            raise ValueError("max_batch and prefill_batch must be at least 1, max_images at least 0")
        self.allowed_image_dirs = tuple(Path(d).resolve() for d in allowed_image_dirs)
        self.max_images = max_images
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self.max_batch = max_batch  # requests decoding together; later arrivals wait their turn
        self.prefill_batch = min(prefill_batch, max_batch)  # arrivals prefilled in one forward
        self.prefill_step = prefill_step
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
        self._kv_tokens = 0  # tokens in the KV cache of every row together
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
        size = estimate(self.path, self.kind)
        self._kv_per_token = size.kv_bytes_per_token
        self._weight_bytes = size.weight_bytes
        self._context = self._model.config.text_config.max_position_embeddings
        self._image_token = getattr(self._model.config, "image_token_index", None)
        self._loop_done = self._worker.submit(self._run_loop)

    def _load_on_worker(self):
        import mlx_vlm

        model, processor = mlx_vlm.load(self.path)
        self._generator = self._new_generator(model, processor)
        return model, processor

    def _new_generator(self, model: Any, processor: Any) -> Any:
        """mlx-vlm's BatchGenerator over the language model. Its completion_batch_size leaves room
        for a whole prefill group past max_batch: it starts a group only while that many rows are
        free, and the engine itself keeps the batch to max_batch rows."""
        import mlx.core as mx
        from mlx_vlm.generate import BatchGenerator

        return BatchGenerator(
            model.language_model,
            processor,
            sampler=self._sampler,
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

    def running_requests(self) -> int:
        return self._running

    def counters(self) -> dict[str, float]:
        """The engine's work counters (see __init__) and the sampler's calls and rows: they only
        grow, so two readings give a window's mean batch (decode_rows / decode_steps)."""
        return {**self._counters, "sampling_calls": self._sampler.calls, "sampled_rows": self._sampler.rows_sampled}

    def memory(self) -> MemoryReport:
        # Allocator counters are process-wide and thread-safe: no need to queue behind a step.
        import mlx.core as mx

        rows, longest = self._kv
        per_token = getattr(self, "_kv_per_token", 0)
        # The batch's KV cache holds every row at the longest row's length (left-padded), in steps.
        reserved = rows * -(-longest // _KV_STEP) * _KV_STEP * per_token
        return MemoryReport(
            weight_bytes=getattr(self, "_weight_bytes", 0),
            kv_bytes_in_use=self._kv_tokens * per_token,
            kv_bytes_reserved=reserved,
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
        )

    # ---- request validation (event loop; cheap) ----

    def _messages(self, messages: list[dict], n_images: int) -> list[dict]:
        """Chat messages for the template: image parts become {"type": "image"}; with no image
        part, the images go in front of the last user message's text."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("invalid_request", "messages must be a non-empty list", "messages")
        out, n_parts, has_text = [], 0, False
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise RequestError("invalid_request", f"messages[{i}] needs a role in {sorted(_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, str):
                parts = [{"type": "text", "text": content}]
            elif isinstance(content, list):
                parts = []
                for p in content:
                    kind = p.get("type") if isinstance(p, dict) else None
                    if kind in ("image", "image_url"):
                        parts.append({"type": "image"})
                        n_parts += 1
                    elif kind == "text" and isinstance(p.get("text"), str):
                        parts.append({"type": "text", "text": p["text"]})
                    else:
                        raise RequestError("invalid_request", f"messages[{i}] has an unsupported content part", "messages")
            else:
                raise RequestError("invalid_request", f"messages[{i}].content must be a string or a list", "messages")
            has_text = has_text or any(p.get("text", "").strip() for p in parts)
            out.append({"role": m["role"], "content": parts})
        if n_images > self.max_images:
            raise RequestError("invalid_request", f"at most {self.max_images} image(s) per request", "images")
        if not has_text and not n_images:
            raise RequestError("invalid_request", "the prompt is empty", "messages")
        if n_parts == 0 and n_images:
            users = [m for m in out if m["role"] == "user"]
            if not users:
                raise RequestError("invalid_request", "images need a user message", "messages")
            users[-1]["content"] = [{"type": "image"}] * n_images + users[-1]["content"]
        elif n_parts != n_images:
            raise RequestError("invalid_request", f"{n_parts} image parts but {n_images} images", "images")
        return out

    def _image_ref(self, i: int, src: str) -> str | Path:
        """A data URL's base64 payload, or a resolved path under an allowed folder."""
        if not isinstance(src, str):
            raise RequestError("invalid_request", f"images[{i}] must be a string", "images")
        if src[:8].lower().startswith(("http://", "https://")):
            raise RequestError("unsupported", "remote image URLs are disabled", "images")
        if m := _DATA_URL.match(src):
            payload = src[m.end() :]
            if len(payload) * 3 // 4 > self.max_image_bytes:
                raise RequestError("invalid_request", f"images[{i}] is larger than {self.max_image_bytes} bytes", "images")
            return payload
        path = Path(src)
        if not path.is_absolute():
            raise RequestError("invalid_request", f"images[{i}] must be a data:image/...;base64 URL or an allowed file path", "images")
        path = path.resolve()  # symlinks and '..' cannot escape the allowed folders
        if not any(path.is_relative_to(d) for d in self.allowed_image_dirs) or not path.is_file():
            raise RequestError("invalid_request", f"images[{i}] is not a file under an allowed image folder", "images")
        return path

    # ---- images (a worker thread of asyncio's: PIL only, no MLX) ----

    def _decode(self, i: int, ref: str | Path):
        from PIL import Image

        try:
            raw = ref.read_bytes() if isinstance(ref, Path) else base64.b64decode(ref, validate=True)
            if len(raw) > self.max_image_bytes:
                raise RequestError("invalid_request", f"images[{i}] is larger than {self.max_image_bytes} bytes", "images")
            img = Image.open(io.BytesIO(raw))
            if img.width * img.height > self.max_image_pixels:
                raise RequestError("invalid_request", f"images[{i}] has more than {self.max_image_pixels} pixels", "images")
            return img.convert("RGB")
        except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as e:
            raise RequestError("invalid_request", f"images[{i}] cannot be decoded: {e}", "images") from e

    def _decode_all(self, refs: list[str | Path]) -> list[Any]:
        """Every image of a request decoded (RGB), or the RequestError of the first bad one."""
        return [self._decode(i, ref) for i, ref in enumerate(refs)]

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
        chat = self._messages(messages, len(images))
        refs = [self._image_ref(i, s) for i, s in enumerate(images)]
        if max_tokens < 1:
            raise RequestError("invalid_request", "max_tokens must be at least 1", "max_tokens")
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError("invalid_request", "temperature must be >= 0 and top_p in (0, 1]", "temperature")
        decoded = await asyncio.to_thread(self._decode_all, refs) if refs else []
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
            while held and len(streams) < self.max_batch:
                self._admit(held.popleft(), streams)
            if streams:
                self._step(streams)
            produced = [(s.arrival, s.pending) for s in streams.values() if s.pending]
            for uid in [uid for uid, s in streams.items() if s.pending and _ended(s.pending)]:
                streams.pop(uid)
            for s in streams.values():
                s.pending = []
            # what memory() reads, before the ended requests hear of their end
            self._kv = (len(streams), max((s.prompt_tokens + s.completion for s in streams.values()), default=0))
            self._kv_tokens = sum(s.prompt_tokens + s.completion for s in streams.values())
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

    def _admit(self, arrival: _Arrival, streams: dict[int, _Stream]) -> None:
        """Template, processor and vision tower for one arrival, then into the batch; a failure
        here is its own (its error goes to it alone)."""
        try:
            uid, prompt_tokens = self._insert(arrival)
        except Exception as e:
            if not isinstance(e, RequestError):
                logger.error("a VLM request failed before it joined the batch", exc_info=e)
                e = RequestError("internal", f"{type(e).__name__}: {e}")
            _hand_off([(arrival, [e])])
            return
        from mlx_vlm.tokenizer_utils import make_streaming_detokenizer

        streams[uid] = _Stream(arrival, uid, prompt_tokens, make_streaming_detokenizer(self._processor), StopStringFilter(arrival.stops))
        self._counters["admitted_requests"] += 1
        self._counters["images_encoded"] += len(arrival.images)
        self._counters["prompt_tokens"] += prompt_tokens

    def _insert(self, arrival: _Arrival) -> tuple[int, int]:
        import mlx.core as mx

        prompt = self._processor.tokenizer.apply_chat_template(arrival.messages, tokenize=False, add_generation_prompt=True)
        # Called without tokenizer kwargs: mlx-vlm's prepare_inputs passes `padding` etc. on to
        # the image processor, which transformers 5 rejects (shared/models/README.md).
        inputs = self._processor(text=[prompt], images=arrival.images or None)
        input_ids = inputs["input_ids"]
        n_prompt = int(input_ids.shape[1])
        if n_prompt >= self._context:  # a max_tokens past the room left is clamped below: docs/protocols.md
            raise RequestError(
                "context_length_exceeded", f"the {n_prompt}-token prompt leaves no room to generate in the {self._context}-token context", "messages"
            )
        if arrival.images and self._image_token is not None and not bool((input_ids == self._image_token).any()):
            raise RequestError("invalid_request", "the chat template left out the images' places in the prompt", "messages")
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        # The vision tower, once per request: its image features merged into the prompt's embeddings.
        embedded = self._model.get_input_embeddings(input_ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra)
        prompt_kwargs = {**extra, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
        mx.eval(prompt_kwargs["inputs_embeds"])  # the image's cost is paid here, not inside a batch step
        (uid,) = self._generator.insert(
            [input_ids[0].tolist()], max_tokens=min(arrival.max_tokens, self._context - n_prompt), prompt_kwargs=[prompt_kwargs]
        )
        self._sampler.add(uid, arrival.sampling)
        return uid, n_prompt

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
