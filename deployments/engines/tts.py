"""Text to speech through mlx-audio, behind the Engine contract, for OpenAI's /v1/audio/speech.

The model is whatever `mlx_audio.tts.utils.load` opens (the embedded set has a Soprano). Bad input
is refused before any MLX work, so a bad request never reaches the worker thread."""

import asyncio
import io
import math
import re
import wave
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import Engine, MemoryReport, RequestError
from deployments.manifest import safetensors_bytes
from deployments.worker import MLXWorker

MIN_SPEED, MAX_SPEED = 0.25, 4.0
DEFAULT_VOICE = "default"
PCM_SAMPLE_RATE = 24000  # OpenAI's response_format "pcm" is 24 kHz 16-bit little-endian mono
MAX_TOKENS = 512  # mlx-audio's own per-sentence cap (~33 s of Soprano audio)
FORMATS = ("wav", "pcm")


class Speech(BaseModel):
    """Mono float32 samples in [-1, 1] (read-only, so the frozen model stays frozen) and their rate."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    samples: np.ndarray
    sample_rate: int

    @field_validator("samples")
    @classmethod
    def _mono_float32(cls, v: np.ndarray) -> np.ndarray:
        v = np.array(v, dtype=np.float32).reshape(-1)
        v.flags.writeable = False
        return v

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate


def _resample(x: np.ndarray, ratio: Fraction) -> np.ndarray:
    """x at `ratio` times as many samples, band-limited (scipy comes with mlx-audio)."""
    from scipy.signal import resample_poly

    return x if ratio == 1 else resample_poly(x, ratio.numerator, ratio.denominator).astype(np.float32)


def encode(speech: Speech, format: str = "wav") -> bytes:
    """Bytes of an OpenAI response_format. Only the formats the standard library can write."""
    samples = speech.samples
    if format == "pcm":
        samples = _resample(samples, Fraction(PCM_SAMPLE_RATE, speech.sample_rate))
    pcm16 = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()
    if format == "pcm":
        return pcm16
    if format == "wav":
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(speech.sample_rate)
            w.writeframes(pcm16)
        return buf.getvalue()
    raise RequestError("unsupported", f"response_format {format!r} is not supported; use one of {', '.join(FORMATS)}", "response_format")


def token_budget(text: str) -> int:
    """Generation cap per sentence: ~1 token (64 ms of Soprano audio) per character plus slack,
    so that a model that never emits its stop token still gives speech of a plausible length."""
    longest = max(len(s) for s in re.split(r"(?<=[.!?])\s+|\n", text))
    return min(MAX_TOKENS, 24 + longest)


class TTSEngine(Engine):
    kind = "tts"

    def __init__(self, name: str, path: str, *, max_chars: int = 4096, voices: tuple[str, ...] = (DEFAULT_VOICE,)):
        super().__init__(name, path)
        self.max_chars = max_chars
        self.voices = voices
        self._worker: MLXWorker | None = None
        self._model: Any = None  # mlx-audio's model, once loaded
        self._running = 0

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        self._model = await self._worker.run(self._load_model)

    def _load_model(self):
        from mlx_audio.tts.utils import load

        return load(str(Path(self.path)))

    @property
    def sample_rate(self) -> int:
        return self._model.sample_rate

    def running_requests(self) -> int:
        return self._running

    def _validate(self, text: str, voice: str | None, speed: float) -> str:
        if not isinstance(text, str) or not text.strip():
            raise RequestError("invalid_request", "input must be non-empty text", "input")
        if len(text) > self.max_chars:
            raise RequestError("invalid_request", f"input is {len(text)} characters; the limit is {self.max_chars}", "input")
        if not isinstance(speed, (int, float)) or not math.isfinite(speed) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise RequestError("invalid_request", f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}", "speed")
        voice = DEFAULT_VOICE if voice is None else voice
        if voice not in self.voices:
            raise RequestError("invalid_request", f"unknown voice {voice!r}; this model has {', '.join(self.voices)}", "voice")
        return voice

    async def speak(self, text: str, *, voice: str | None = None, speed: float = 1.0) -> Speech:
        self._check_ready()
        voice = self._validate(text, voice, speed)
        assert self._worker is not None  # set by _load; callers checked the engine is ready
        self._running += 1
        try:
            samples = await self._worker.run(self._synthesize, text, voice)
        except RequestError:
            raise
        except Exception as e:  # one failed request must not take the engine down
            raise RequestError("internal", f"speech generation failed: {type(e).__name__}: {e}") from e
        finally:
            self._running -= 1
        if samples.size == 0 or not np.isfinite(samples).all():
            raise RequestError("internal", "the model produced no usable audio")
        # Soprano has no speed control: resample (which also shifts pitch, as a tape would).
        return Speech(samples=_resample(samples, Fraction(1 / speed).limit_denominator(64)), sample_rate=self.sample_rate)

    def _synthesize(self, text: str, voice: str) -> np.ndarray:
        """Runs on the worker: every newline-separated segment mlx-audio yields, joined."""
        voice_arg = None if voice == DEFAULT_VOICE else voice
        parts = [np.array(r.audio, dtype=np.float32).reshape(-1) for r in self._model.generate(text, voice=voice_arg, max_tokens=token_budget(text))]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    async def _stop(self) -> None:
        if self._worker is None:
            return
        await self._worker.run(self._release)
        await asyncio.to_thread(self._worker.shutdown)

    def _release(self) -> None:
        import mlx.core as mx

        self._model = None
        mx.clear_cache()

    def memory(self) -> MemoryReport:
        import mlx.core as mx

        return MemoryReport(
            weight_bytes=safetensors_bytes(Path(self.path)),
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
        )
