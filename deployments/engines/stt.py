"""Speech-to-text engine: a Whisper folder (deployments/model_prep/whisper_tiny.py) loaded by
mlx-audio, answering OpenAI-style transcription requests.

Audio is decoded off the MLX worker (miniaudio + scipy, no MLX), so a bad or over-long file is
refused at once instead of waiting behind a running transcription; the model itself only ever runs
on the engine's MLXWorker thread, one request at a time."""

import asyncio
import io
from pathlib import Path
from typing import Any, Literal, NamedTuple

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import numpy as np

from deployments.engine import Engine, Frozen, MemoryReport, RequestError
from deployments.manifest import safetensors_bytes
from deployments.worker import MLXWorker

SAMPLE_RATE = 16000
# OpenAI's temperature=0: start greedy and let Whisper raise it when a window decodes badly.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


class Segment(NamedTuple):
    start: float
    end: float
    text: str


class Transcription(Frozen):
    text: str
    language: str  # ISO 639-1 code, e.g. "en"
    duration_s: float
    segments: tuple[Segment, ...] = ()

    def response(self, response_format: Literal["json", "text", "verbose_json"] = "json") -> dict | str:
        """The body of OpenAI's /v1/audio/transcriptions for `response_format`."""
        if response_format == "text":
            return self.text
        if response_format == "json":
            return {"text": self.text}
        if response_format == "verbose_json":
            from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

            return {
                "task": "transcribe",
                "language": LANGUAGES.get(self.language, self.language),
                "duration": self.duration_s,
                "text": self.text,
                "segments": [{"id": i, "start": s.start, "end": s.end, "text": s.text} for i, s in enumerate(self.segments)],
            }
        raise RequestError("unsupported", f"response_format {response_format!r} is not supported", param="response_format")


def decode_audio(audio: bytes, max_seconds: float) -> np.ndarray:
    """Audio file bytes -> float32 mono samples at 16 kHz; RequestError for anything unusable.
    Decoding stops just past `max_seconds`, so an over-long upload costs no more than that."""
    from mlx_audio.audio_io import read

    if not audio:
        raise RequestError("invalid_request", "the audio file is empty", param="file")
    try:
        samples, _ = read(io.BytesIO(audio), dtype="float32", sample_rate=SAMPLE_RATE, nchannels=1, duration=max_seconds + 1.0)
    except Exception as e:  # miniaudio / ffmpeg / format detection: all mean "cannot decode this"
        raise RequestError("invalid_request", f"could not decode the audio file (wav, mp3 or flac expected): {e}", param="file") from e
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if samples.size == 0:
        raise RequestError("invalid_request", "the audio file contains no samples", param="file")
    if samples.size > max_seconds * SAMPLE_RATE:
        raise RequestError("invalid_request", f"the audio is longer than the {max_seconds:g} s limit", param="file")
    return samples


class STTEngine(Engine):
    kind = "stt"

    def __init__(self, name: str, path: str, max_seconds: float = 1800.0):
        super().__init__(name, path)
        self.max_seconds = max_seconds
        self._worker: MLXWorker | None = None
        self._model: Any = None  # mlx-audio's Whisper, once loaded
        self._weight_bytes = safetensors_bytes(Path(path))
        self._in_flight = 0

    def _load_model(self):
        """mlx-audio builds Whisper in float16; on the Linux CPU build only float32 matmuls use BLAS,
        so the model (weights, positional table, causal mask) is cast back to float32: the weights
        came from float16, so nothing is lost."""
        from mlx_audio.stt import load

        model = load(Path(self.path), strict=True)
        if mx.default_device().type == mx.cpu:
            model.set_dtype(mx.float32)
            model.dtype = mx.float32
            model.encoder._positional_embedding = model.encoder._positional_embedding.astype(mx.float32)
            model.decoder._mask = model.decoder._mask.astype(mx.float32)
        mx.eval(model.parameters(), model.encoder._positional_embedding, model.decoder._mask)
        return model

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        self._model = await self._worker.run(self._load_model)

    def _release(self) -> None:
        self._model = None
        mx.clear_cache()

    async def _stop(self) -> None:
        if self._worker is not None:
            # Queued requests run first and see the stopped status; then the model is dropped.
            await self._worker.run(self._release)
            await asyncio.to_thread(self._worker.shutdown)

    def running_requests(self) -> int:
        return self._in_flight

    def _check_language(self, language: str | None) -> str | None:
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

        if language is None:
            return None
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        if code not in LANGUAGES:
            raise RequestError("invalid_request", f"unknown language {language!r}", param="language")
        if not self._model.is_multilingual and code != "en":
            raise RequestError("invalid_request", f"model {self.name} transcribes English only", param="language")
        return code

    def _transcribe(self, samples: np.ndarray, language: str | None, temperature: float, prompt: str | None) -> Transcription:
        if self._status != "ready":  # stopped while this request was queued
            raise RequestError("engine_stopped", f"model {self.name} is {self._status}")
        try:
            out = self._model.generate(
                samples,
                language=language,
                temperature=FALLBACK_TEMPERATURES if temperature == 0 else temperature,
                initial_prompt=prompt or None,
                fp16=self._model.dtype == mx.float16,  # False on CPU, else a dtype TypeError
                verbose=None,
            )
        except Exception as e:
            raise RequestError("internal", f"transcription failed: {type(e).__name__}: {e}") from e
        finally:
            mx.clear_cache()
        segments = tuple(Segment(round(s["start"], 2), round(s["end"], 2), s["text"]) for s in out.segments if s["text"].strip())
        return Transcription(text=out.text.strip(), language=out.language or "en", duration_s=round(samples.size / SAMPLE_RATE, 3), segments=segments)

    async def transcribe(self, audio: bytes, *, language: str | None = None, temperature: float = 0.0, prompt: str | None = None) -> Transcription:
        """Transcribe one audio file (wav / mp3 / flac bytes). Requests run one at a time."""
        self._check_ready()
        if not 0.0 <= temperature <= 1.0:
            raise RequestError("invalid_request", "temperature must be between 0 and 1", param="temperature")
        code = self._check_language(language)
        assert self._worker is not None  # set by _load; callers checked the engine is ready
        self._in_flight += 1
        try:
            samples = await asyncio.to_thread(decode_audio, audio, self.max_seconds)
            return await self._worker.run(self._transcribe, samples, code, temperature, prompt)
        finally:
            self._in_flight -= 1

    def memory(self) -> MemoryReport:
        return MemoryReport(
            weight_bytes=self._weight_bytes,
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
        )
