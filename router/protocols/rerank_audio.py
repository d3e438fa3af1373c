"""Wire shapes of the rerank (Cohere / Jina) and audio (OpenAI transcription and speech) endpoints.
Pure pydantic: the ingress validates with these and the model servers do the work (their answers:
deployments/wire/results.py)."""

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.wire.results import RerankResult
from router.protocols import openai as oai


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | dict[str, Any]] = Field(min_length=1, max_length=1000)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False

    def texts(self) -> list[str]:
        out = []
        for i, d in enumerate(self.documents):
            text = d if isinstance(d, str) else d.get("text")
            if not isinstance(text, str):
                raise oai.ProtocolError(400, "invalid_value", 'a document is a string or {"text": ...}', f"documents[{i}]")
            out.append(text)
        return out

    @model_validator(mode="after")
    def _documents_have_text(self) -> "RerankRequest":
        self.texts()
        return self


def rerank_response(req: RerankRequest, result: RerankResult) -> dict:
    """Cohere v2 / Jina: results best first with index and relevance_score (and the document)."""
    texts = req.texts()
    results = []
    for r in result.results:
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if req.return_documents:
            item["document"] = {"text": texts[r.index]}
        results.append(item)
    tokens = result.usage.total_tokens
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "list",
        "model": req.model,
        "results": results,
        "usage": {"total_tokens": tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }


class TranscriptionForm(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    language: str | None = None
    prompt: str | None = None
    temperature: float = Field(default=0.0, ge=0, le=1)
    response_format: str = "json"


# OpenAI's built-in voice names. A client written for OpenAI always sends one; a model with voices
# of its own gets its default voice for them (its own voice names pass through unchanged).
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"})


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = None
    response_format: str = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio"] | None = None  # "sse" streaming is not offered

    def engine_voice(self) -> str | None:
        """The voice for the engine: None (its default) for an OpenAI voice name."""
        return None if self.voice is None or self.voice.lower() in OPENAI_VOICES else self.voice
