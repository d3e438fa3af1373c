"""What a model server answers for one call of a kind other than text generation: embeddings,
a rerank, a transcription. Each crosses once per call (no token path), so each is a pydantic model
the engine builds (validated) and the ingress reads by its fields; text to speech answers the
encoded audio's bytes."""

from typing import Any

from pydantic import Field

from policy._frozen import Frozen


class EmbeddingResult(Frozen):
    """One vector per input text, in order; the tokens the model ran (`prompt_tokens`, what a
    key's tpm is charged) and the vectors' length."""

    vectors: list[list[float]]
    prompt_tokens: int = Field(ge=0)
    dimensions: int


class RerankItem(Frozen):
    index: int = Field(ge=0)  # position in the request's documents
    relevance_score: float


class RerankUsage(Frozen):
    prompt_tokens: int = Field(ge=0)  # tokens run through the model, after truncation
    total_tokens: int = Field(ge=0)


class RerankResult(Frozen):
    model: str
    results: tuple[RerankItem, ...]  # by relevance_score, highest first
    usage: RerankUsage


class TranscribedSegment(Frozen):
    """A stretch of the audio and its text, in seconds from the start."""

    start: float
    end: float
    text: str


class TranscriptionResult(Frozen):
    """A transcription (text, ISO 639-1 language, duration, segments) and `body`: OpenAI's
    response for the response_format asked (a dict, or the text alone for "text")."""

    text: str
    language: str
    duration_s: float
    segments: list[TranscribedSegment] = Field(default_factory=list)
    body: dict[str, Any] | str
