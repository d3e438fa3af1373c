"""TTSEngine on a real (random-weight) Soprano built by model_prep, run through mlx-audio's loader."""

import asyncio
import io
import wave

import numpy as np
import pytest

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import RequestError
from deployments.engines.tts import Speech, TTSEngine, encode
from deployments.model_prep import tts_random

SENTENCE = "Hello from Orchard, this is a short test."


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / tts_random.NAME
    return dest, tts_random.build(dest)


@pytest.fixture(scope="module")
def engine(built, loop):
    dest, entry = built
    eng = TTSEngine(entry.name, str(dest), max_chars=200)
    loop.run_until_complete(eng.load())
    yield eng
    loop.run_until_complete(eng.stop())


def test_builder_entry_and_idempotence(built):
    dest, entry = built
    assert entry.kind == "tts" and entry.weights == "random" and entry.architecture == "soprano"
    assert entry.weight_bytes == (dest / "model.safetensors").stat().st_size > 1_000_000
    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    assert tts_random.build(dest) == entry
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime  # kept, not rebuilt


def seed(engine, loop, value: int = 0) -> None:
    """Seed the sampler on the engine's MLX thread (its random state is that thread's): random
    weights can end a sentence at any token, so an unseeded run's length is a draw (12 unseeded
    runs here: 11 at the 4.16 s token budget, one 1.28 s; one make test run got 0.064 s)."""
    import mlx.core as mx

    loop.run_until_complete(engine._worker.run(mx.random.seed, value))


def test_speak_gives_plausible_audio(engine, loop):
    seed(engine, loop)
    speech = loop.run_until_complete(engine.speak(SENTENCE))
    assert speech.sample_rate == engine.sample_rate == 32000
    assert speech.samples.dtype == np.float32 and speech.samples.ndim == 1
    assert np.isfinite(speech.samples).all() and np.abs(speech.samples).max() > 0
    assert 0.3 < speech.duration < 6.0  # about 2-3 s for 41 characters
    assert engine.health().status == "ready"
    report = engine.memory()
    assert report.weight_bytes > 0 and report.active_bytes >= 0.99 * report.weight_bytes and report.load_seconds > 0


def test_encode_wav_and_pcm(engine, loop):
    speech = loop.run_until_complete(engine.speak("Testing the encoder."))
    with wave.open(io.BytesIO(encode(speech, "wav"))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, speech.sample_rate)
        assert w.getnframes() == len(speech.samples)
    pcm = encode(speech, "pcm")  # OpenAI's pcm: 24 kHz int16 little-endian
    assert len(pcm) == 2 * round(len(speech.samples) * 24000 / speech.sample_rate)
    with pytest.raises(RequestError) as e:
        encode(speech, "mp3")
    assert e.value.code == "unsupported"


def test_speed_changes_duration(engine, loop):
    speech = Speech(samples=np.zeros(32000, np.float32), sample_rate=32000)
    assert speech.duration == 1.0 and not speech.samples.flags.writeable
    seed(engine, loop)
    normal = loop.run_until_complete(engine.speak("Quick test."))
    seed(engine, loop)
    fast = loop.run_until_complete(engine.speak("Quick test.", speed=2.0))
    assert fast.duration == pytest.approx(normal.duration / 2, rel=0.2)


@pytest.mark.parametrize(
    "text, kwargs, param",
    [
        ("", {}, "input"),
        ("   \n ", {}, "input"),
        ("x" * 201, {}, "input"),
        ("Hi there.", {"speed": 0.1}, "speed"),
        ("Hi there.", {"speed": 4.5}, "speed"),
        ("Hi there.", {"speed": float("nan")}, "speed"),
        ("Hi there.", {"voice": "nobody"}, "voice"),
    ],
)
def test_bad_input_is_refused_and_engine_survives(engine, loop, text, kwargs, param):
    with pytest.raises(RequestError) as e:
        loop.run_until_complete(engine.speak(text, **kwargs))
    assert e.value.code == "invalid_request" and e.value.param == param and e.value.message
    speech = loop.run_until_complete(engine.speak("Still working.", voice="default"))
    assert speech.samples.size > 0 and engine.running_requests() == 0
