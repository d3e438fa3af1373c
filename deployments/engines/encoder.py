"""Shared by the encoder engines (embeddings, rerank): tokenized inputs sorted by length and run in
padded batches with an attention mask, so padding never changes a result and short inputs do not
pay for long ones. Runs on the calling engine's worker thread."""

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import numpy as np

from deployments.engine import Engine, MemoryReport
from deployments.manifest import safetensors_bytes
from deployments.worker import MLXWorker


class EncoderEngine(Engine):
    model: Any  # set on the worker by _load_model (an mlx-embeddings model), None once unloaded
    tokenizer: Any
    """What the encoder engines (embeddings, rerank) share: a worker thread, a sequence-length limit
    from the folder, batched forward passes, and no KV cache. Subclasses set `self.model` and
    `self.tokenizer` in `_load_model` (on the worker)."""

    def __init__(self, name: str, path: str, *, max_length: int | None = None, batch_size: int = 32):
        super().__init__(name, path)
        self._max_length = max_length
        self.batch_size = batch_size
        self.weight_bytes = 0
        self._running = 0
        self._worker: MLXWorker | None = None

    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        await self._worker.run(self._load_on_worker)

    def _load_on_worker(self) -> None:
        path = Path(self.path)
        self._load_model(path)
        config = json.loads((path / "config.json").read_text())
        limits = [self._max_length, config.get("max_position_embeddings"), getattr(self.tokenizer, "model_max_length", None)]
        st_config = path / "sentence_bert_config.json"
        if st_config.exists():
            limits.append(json.loads(st_config.read_text()).get("max_seq_length"))
        self.max_length = int(min(x for x in limits if x))
        self.weight_bytes = safetensors_bytes(path)

    def _load_model(self, path: Path) -> None:
        raise NotImplementedError

    async def _run(self, fn: Callable, *args):
        """fn(*args) on the worker, counted as a running request."""
        assert self._worker is not None  # set by _load; callers checked the engine is ready
        self._running += 1
        try:
            return await self._worker.run(fn, *args)
        finally:
            self._running -= 1

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
            weight_bytes=self.weight_bytes,
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
        )


def padded_batches(
    ids: list[list[int]], types: list[list[int]] | None, batch_size: int, pad_id: int
) -> Iterator[tuple[list[int], mx.array, mx.array, mx.array]]:
    """(row indices, input_ids, token_type_ids, attention_mask) per batch, shortest rows first."""
    types = types or [[0] * len(x) for x in ids]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(ids[i]) for i in chunk)

        def pad(rows: list[list[int]], value: int, width: int = width) -> mx.array:
            return mx.array([r + [value] * (width - len(r)) for r in rows], dtype=mx.int32)

        yield (
            chunk,
            pad([ids[i] for i in chunk], pad_id),
            pad([types[i] for i in chunk], 0),
            pad([[1] * len(ids[i]) for i in chunk], 0),
        )


def run_batches(
    ids: list[list[int]],
    types: list[list[int]] | None,
    batch_size: int,
    pad_id: int,
    forward: Callable[[mx.array, mx.array, mx.array], mx.array],
) -> list[np.ndarray]:
    """forward(input_ids, token_type_ids, attention_mask) for every batch; one row out per input,
    in input order."""
    out: list[np.ndarray | None] = [None] * len(ids)
    for chunk, input_ids, token_types, mask in padded_batches(ids, types, batch_size, pad_id):
        y = forward(input_ids, token_types, mask)
        mx.eval(y)
        for i, row in zip(chunk, np.array(y, dtype=np.float32), strict=True):
            out[i] = row
    return out  # type: ignore[return-value]


def mean_pooled_embeddings(model, tokenizer, texts: list[str], max_length: int, batch_size: int) -> tuple[np.ndarray, int]:
    """Sentence embeddings as mlx-embeddings computes them (mean-pooled, L2-normalised), and the
    number of tokens run after truncation."""
    vectors, tokens = mean_pooled_embeddings_each(model, tokenizer, texts, max_length, batch_size)
    return vectors, sum(tokens)


def mean_pooled_embeddings_each(model, tokenizer, texts: list[str], max_length: int, batch_size: int) -> tuple[np.ndarray, list[int]]:
    """mean_pooled_embeddings with the tokens run for each text."""
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    rows = run_batches(
        ids,
        None,
        batch_size,
        tokenizer.pad_token_id or 0,
        lambda input_ids, _types, mask: model(input_ids, attention_mask=mask).text_embeds,
    )
    return np.stack(rows), [len(x) for x in ids]
