"""The embedding engine: mlx-embeddings models (sentence-transformers style, mean-pooled and
normalised), batched with padding that never changes a vector. Concurrent requests are served one
batch at a time on the engine's worker."""

import asyncio
import json
from pathlib import Path

import deployments  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np
from pydantic import Field

from deployments.engine import Engine, Frozen, MemoryReport, RequestError
from deployments.engines.encoder import mean_pooled_embeddings
from deployments.manifest import safetensors_bytes
from deployments.worker import MLXWorker


class EmbeddingResult(Frozen):
    vectors: list[list[float]]
    prompt_tokens: int = Field(ge=0)
    dimensions: int


class EmbeddingEngine(Engine):
    kind = "embedding"

    def __init__(self, name: str, path: str, *, max_inputs: int = 2048, max_length: int | None = None, batch_size: int = 32):
        super().__init__(name, path)
        self.max_inputs = max_inputs
        self._max_length = max_length
        self.batch_size = batch_size
        self.weight_bytes = 0
        self._running = 0
        self._worker: MLXWorker | None = None

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        await self._worker.run(self._load_on_worker)

    def _load_on_worker(self) -> None:
        from mlx_embeddings.utils import load

        self.model, self.tokenizer = load(self.path)
        path = Path(self.path)
        limits = [self._max_length, json.loads((path / "config.json").read_text()).get("max_position_embeddings")]
        st_config = path / "sentence_bert_config.json"
        if st_config.exists():
            limits.append(json.loads(st_config.read_text()).get("max_seq_length"))
        self.max_length = int(min(x for x in limits if x))
        self.weight_bytes = safetensors_bytes(path)

    async def _stop(self) -> None:
        if self._worker is not None:
            await self._worker.run(self._unload_on_worker)
            await asyncio.to_thread(self._worker.shutdown)

    def _unload_on_worker(self) -> None:
        self.model = self.tokenizer = None
        mx.clear_cache()

    def running_requests(self) -> int:
        return self._running

    def memory(self) -> MemoryReport:
        return MemoryReport(
            weight_bytes=self.weight_bytes, active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(), load_seconds=self._load_seconds,
        )

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
        self._running += 1
        try:
            vectors, tokens = await self._worker.run(
                mean_pooled_embeddings, self.model, self.tokenizer, texts, self.max_length, self.batch_size
            )
        except Exception as e:  # one bad request must not take the engine down
            raise RequestError("internal", f"embedding failed: {type(e).__name__}: {e}") from e
        finally:
            self._running -= 1
        if dimensions is not None:
            if not 1 <= dimensions <= vectors.shape[1]:
                raise RequestError("invalid_request", f"dimensions must be in [1, {vectors.shape[1]}]", "dimensions")
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return EmbeddingResult(vectors=vectors.tolist(), prompt_tokens=tokens, dimensions=vectors.shape[1])
