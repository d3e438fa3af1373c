"""The embedding engine: mlx-embeddings models (sentence-transformers style, mean-pooled and
normalised), batched with padding that never changes a vector. Concurrent requests are served one
batch at a time on the engine's worker."""

from pathlib import Path

import numpy as np
from pydantic import Field

from deployments.engine import Frozen, RequestError
from deployments.engines.encoder import EncoderEngine, mean_pooled_embeddings


class EmbeddingResult(Frozen):
    vectors: list[list[float]]
    prompt_tokens: int = Field(ge=0)
    dimensions: int


class EmbeddingEngine(EncoderEngine):
    kind = "embedding"

    def __init__(self, name: str, path: str, *, max_inputs: int = 2048, max_length: int | None = None, batch_size: int = 32):
        super().__init__(name, path, max_length=max_length, batch_size=batch_size)
        self.max_inputs = max_inputs

    def _load_model(self, path: Path) -> None:
        from mlx_embeddings.utils import load

        self.model, self.tokenizer = load(str(path))

    async def embed(self, texts: list[str], *, dimensions: int | None = None) -> EmbeddingResult:
        """One vector per text. `dimensions` truncates and re-normalises (OpenAI's parameter; only
        meaningful for Matryoshka-trained models, so it is the caller's choice)."""
        self._check_ready()
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts:
            raise RequestError("invalid_request", "input must be a non-empty string or list of strings", "input")
        if len(texts) > self.max_inputs:
            raise RequestError("invalid_request", f"at most {self.max_inputs} inputs per request, got {len(texts)}", "input")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t), None)
        if bad is not None:
            raise RequestError("invalid_request", f"input[{bad}] must be a non-empty string", "input")
        try:
            vectors, tokens = await self._run(mean_pooled_embeddings, self.model, self.tokenizer, texts, self.max_length, self.batch_size)
        except Exception as e:  # one bad request must not take the engine down
            raise RequestError("internal", f"embedding failed: {type(e).__name__}: {e}") from e
        if dimensions is not None:
            if not 1 <= dimensions <= vectors.shape[1]:
                raise RequestError("invalid_request", f"dimensions must be in [1, {vectors.shape[1]}]", "dimensions")
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return EmbeddingResult(vectors=vectors.tolist(), prompt_tokens=tokens, dimensions=vectors.shape[1])
