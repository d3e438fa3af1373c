"""Vision-language engine over mlx-vlm: chat messages plus images in, streamed text deltas out.

Requests run one at a time on the engine's MLX worker thread (mlx-vlm's LLaVA takes one image per
prompt and does not batch images); tokens cross to asyncio through call_soon_threadsafe, so the
event loop never waits on MLX. Input problems fail only their own request with a RequestError."""

import asyncio
import base64
import binascii
import io
import re
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import Engine, Frozen, MemoryReport, RequestError
from deployments.engines.text_stream import StopStringFilter
from deployments.estimate import estimate
from deployments.worker import MLXWorker

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


class VLMEngine(Engine):
    kind = "vlm"

    def __init__(
        self,
        name: str,
        path: str,
        *,
        allowed_image_dirs: Sequence[str | Path] = (),
        max_images: int = 1,
        max_image_bytes: int = 20 << 20,
        max_image_pixels: int = 4096 * 4096,
    ):
        super().__init__(name, path)
        self.allowed_image_dirs = tuple(Path(d).resolve() for d in allowed_image_dirs)
        self.max_images = max_images
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self._worker: MLXWorker | None = None
        self._model: Any = None
        self._processor: Any = None
        self._running = 0
        self._kv_tokens = 0  # tokens in the KV cache of the request on the worker
        self._cancels: set[threading.Event] = set()

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        self._model, self._processor = await self._worker.run(self._load_on_worker)
        size = estimate(self.path, self.kind)
        self._kv_per_token = size.kv_bytes_per_token
        self._weight_bytes = size.weight_bytes
        self._context = self._model.config.text_config.max_position_embeddings

    def _load_on_worker(self):
        import mlx_vlm

        return mlx_vlm.load(self.path)

    async def _stop(self) -> None:
        for cancel in list(self._cancels):
            cancel.set()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.shutdown)

    def running_requests(self) -> int:
        return self._running

    def memory(self) -> MemoryReport:
        # Allocator counters are process-wide and thread-safe: no need to queue behind a generation.
        import mlx.core as mx

        reserved = -(-self._kv_tokens // _KV_STEP) * _KV_STEP * getattr(self, "_kv_per_token", 0)
        return MemoryReport(
            weight_bytes=getattr(self, "_weight_bytes", 0),
            kv_bytes_in_use=self._kv_tokens * getattr(self, "_kv_per_token", 0),
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

    # ---- worker side ----

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

    def _run(self, messages, refs, opts: dict, cancel: threading.Event, emit: Callable[[tuple], None]) -> None:
        """Generate on the worker thread, handing each step to the event loop through `emit`."""
        from mlx_vlm.generate import stream_generate

        try:
            if cancel.is_set():
                return
            images = [self._decode(i, r) for i, r in enumerate(refs)]
            prompt = self._processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # Called without tokenizer kwargs: mlx-vlm's prepare_inputs passes `padding` etc. on to
            # the image processor, which transformers 5 rejects (shared/models/README.md).
            inputs = self._processor(text=[prompt], images=images or None)
            n_prompt = inputs["input_ids"].shape[1]
            if n_prompt + opts["max_tokens"] > self._context:
                raise RequestError(
                    "context_length_exceeded",
                    f"{n_prompt} prompt + {opts['max_tokens']} completion tokens exceed the {self._context}-token context",
                    "max_tokens",
                )
            self._kv_tokens = n_prompt
            for r in stream_generate(
                self._model,
                self._processor,
                prompt,
                input_ids=inputs["input_ids"],
                pixel_values=inputs.get("pixel_values"),
                mask=inputs.get("attention_mask"),
                **opts,
            ):
                self._kv_tokens = n_prompt + r.generation_tokens
                emit(("step", r.text, n_prompt, r.generation_tokens, r.finish_reason))
                if cancel.is_set():
                    return
        except Exception as e:  # every failure belongs to this request only
            emit(("error", e))
        finally:
            self._kv_tokens = 0
            emit(("end",))

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
        self._check_ready()
        images = list(images or [])
        chat = self._messages(messages, len(images))
        refs = [self._image_ref(i, s) for i, s in enumerate(images)]
        if max_tokens < 1:
            raise RequestError("invalid_request", "max_tokens must be at least 1", "max_tokens")
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError("invalid_request", "temperature must be >= 0 and top_p in (0, 1]", "temperature")
        stops = StopStringFilter(list(stop or []))

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        opts = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        self._running += 1
        self._cancels.add(cancel)
        assert self._worker is not None  # set by _load; callers checked the engine is ready
        job = self._worker.submit(self._run, chat, refs, opts, cancel, emit)

        def ended_by_shutdown(f: Future) -> None:  # a job a shutdown dropped never ran
            if f.cancelled():
                emit(("end",))

        job.add_done_callback(ended_by_shutdown)
        usage = Usage(prompt_tokens=0, completion_tokens=0)
        try:
            while True:
                item = await queue.get()
                if item[0] == "end":
                    if self._status == "stopped":
                        raise RequestError("engine_stopped", f"model {self.name} stopped")
                    yield VLMDelta(text=stops.flush(), finish_reason="error", usage=usage)
                    return
                if item[0] == "error":
                    e = item[1]
                    if isinstance(e, RequestError):
                        raise e
                    if usage.completion_tokens == 0:
                        raise RequestError("internal", f"{type(e).__name__}: {e}") from e
                    yield VLMDelta(text=stops.flush(), finish_reason="error", usage=usage)
                    return
                _, piece, n_prompt, n_done, finish = item
                usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_done)
                out = stops.push(piece)
                if stops.stopped:
                    yield VLMDelta(text=out, finish_reason="stop", usage=usage)
                    return
                if finish is not None:
                    yield VLMDelta(text=out + stops.flush(), finish_reason=finish, usage=usage)
                    return
                if out:
                    yield VLMDelta(text=out)
        finally:
            cancel.set()  # a finished, stopped or abandoned stream ends the generation
            self._cancels.discard(cancel)
            self._running -= 1
