"""OpenAI speech-to-text (multipart) and text-to-speech."""

from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import PlainTextResponse, Response

from deployments.wire.failure import OrchardError
from router.api.auth import principal
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols.rerank_audio import SpeechRequest, TranscriptionForm
from router.serving.generation import call, require_kind
from router.serving.token_estimate import AUDIO_BYTES_PER_S, audio_tokens, estimate_tokens

router = APIRouter(tags=["openai"])

# Its body's limit is max_audio_bytes (router/api/guard.py refuses a larger Content-Length before the
# upload, and cuts off any other body at it), not max_request_bytes.
TRANSCRIPTIONS = "/v1/audio/transcriptions"


@router.post(TRANSCRIPTIONS)
async def transcriptions(
    fields: Annotated[TranscriptionForm, Form()],
    file: Annotated[UploadFile, File(description="the audio (wav, mp3, flac, ...)")],
    ingress: Ingress = Depends(current),
    who: Principal = Depends(principal),
):
    """OpenAI's multipart transcription: file, model, language, prompt, temperature,
    response_format json / text / verbose_json."""
    limit = ingress.max_audio_bytes
    audio = await file.read(limit + 1)
    if len(audio) > limit:  # the body's limit leaves room for the form's other fields
        raise OrchardError("file_too_large", f"audio files are limited to {limit} bytes", "file")
    # a key's tpm counts the audio's seconds (AUDIO_TOKENS_PER_S; estimated from its size at admission) and the text
    async with ingress.hold(who, fields.model, audio_tokens(len(audio) / AUDIO_BYTES_PER_S) + estimate_tokens(fields.prompt or "")) as lease:
        require_kind(lease, ("stt",), "a speech-to-text model")
        result = await call(
            lease, lambda actor: actor.transcribe.remote(audio, fields.language, fields.temperature, fields.prompt, fields.response_format)
        )
        lease.release(audio_tokens(result.duration_s) + estimate_tokens(fields.prompt or "", result.text))
    body = result.body
    return PlainTextResponse(body) if isinstance(body, str) else body


@router.post("/v1/audio/speech", response_class=Response)
async def speech(body: SpeechRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """OpenAI's text-to-speech: model, input, voice, response_format (wav, pcm), speed."""
    async with ingress.hold(who, body.model, estimate_tokens(body.input)) as lease:  # a key's tpm counts the text spoken
        require_kind(lease, ("tts",), "a text-to-speech model")
        audio = await call(lease, lambda actor: actor.speak.remote(body.input, body.engine_voice(), body.speed, body.response_format))
    return Response(audio, media_type="audio/wav" if body.response_format == "wav" else "audio/pcm")
