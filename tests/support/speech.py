"""Speech for the speech-to-text tests: espeak-ng reading a reference sentence, silence, and the words
of a transcript."""

import io
import re
import subprocess
import wave

REFERENCE = "The quick brown fox jumps over the lazy dog. Orchard serves many models."


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def speak(text: str, tmp_path) -> bytes:
    """espeak-ng's default voice, slowed to 120 wpm: the tiny model hears it much better."""
    out = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-s", "120", "-w", str(out), text], check=True, capture_output=True)
    return out.read_bytes()


def silence_wav(seconds: float, rate: int = 22050) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()
