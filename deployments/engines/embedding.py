"""The embedding engine: mlx-embeddings models (sentence-transformers style, mean-pooled and
normalised), batched with padding that never changes a vector. Requests that arrive while a batch
runs join the next one together: one forward pass serves many short requests."""

import asyncio
from pathlib import Path

import numpy as np

from deployments.engine import RequestError
from deployments.engines.encoder import EncoderEngine, mean_pooled_embeddings_each
from deployments.wire.results import EmbeddingResult


class EmbeddingEngine(EncoderEngine):
    kind = "embedding"

    def __init__(self, name: str, path: str, *, max_inputs: int = 2048, max_length: int | None = None, batch_size: int = 32):
        super().__init__(name, path, max_length=max_length, batch_size=batch_size)
        self.max_inputs = max_inputs
        # Requests waiting for the next batch: (texts, their future, its loop); one drain job at a time.
        self._waiting: list[tuple[list[str], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._draining = False
        self.batches = 0  # forward runs, each serving one or more requests

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
            vectors, tokens = await self._joined(texts)
        except Exception as e:  # one bad request must not take the engine down
            raise RequestError("internal", f"embedding failed: {type(e).__name__}: {e}") from e
        if dimensions is not None:
            if not 1 <= dimensions <= vectors.shape[1]:
                raise RequestError("invalid_request", f"dimensions must be in [1, {vectors.shape[1]}]", "dimensions")
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return EmbeddingResult(vectors=vectors.tolist(), prompt_tokens=tokens, dimensions=vectors.shape[1])

    async def _joined(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """This request's vectors and tokens from the next batch run on the worker, shared with
        every request that arrived while the one before ran (up to max_inputs texts a run)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._waiting.append((texts, future, loop))
        if not self._draining:
            self._draining = True
            assert self._worker is not None  # ready means loaded
            self._worker.submit(self._drain)
        self._running += 1
        try:
            return await future
        finally:
            self._running -= 1

    def _drain(self) -> None:
        """On the worker: run the waiting requests in batches until none is left."""
        while True:
            group: list[tuple[list[str], asyncio.Future, asyncio.AbstractEventLoop]] = []
            texts: list[str] = []
            while self._waiting and (not group or len(texts) + len(self._waiting[0][0]) <= self.max_inputs):
                item = self._waiting.pop(0)
                group.append(item)
                texts.extend(item[0])
            if not group:
                self._draining = False
                if not self._waiting:  # nothing came in between
                    return
                self._draining = True
                continue
            self.batches += 1
            try:
                vectors, tokens = mean_pooled_embeddings_each(self.model, self.tokenizer, texts, self.max_length, self.batch_size)
            except Exception as e:
                for _, future, loop in group:
                    loop.call_soon_threadsafe(_settle, future, None, e)
                continue
            start = 0
            for request_texts, future, loop in group:
                end = start + len(request_texts)
                loop.call_soon_threadsafe(_settle, future, (vectors[start:end], sum(tokens[start:end])), None)
                start = end


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
