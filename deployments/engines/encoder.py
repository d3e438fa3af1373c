"""Shared by the encoder engines (embeddings, rerank): tokenized inputs sorted by length and run in
padded batches with an attention mask, so padding never changes a result and short inputs do not
pay for long ones. Runs on the calling engine's worker thread."""

from collections.abc import Callable, Iterator

import deployments  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np


def padded_batches(
    ids: list[list[int]], types: list[list[int]] | None, batch_size: int, pad_id: int
) -> Iterator[tuple[list[int], mx.array, mx.array, mx.array]]:
    """(row indices, input_ids, token_type_ids, attention_mask) per batch, shortest rows first."""
    types = types or [[0] * len(x) for x in ids]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(ids[i]) for i in chunk)

        def pad(rows: list[list[int]], value: int) -> mx.array:
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
        for i, row in zip(chunk, np.array(y, dtype=np.float32)):
            out[i] = row
    return out  # type: ignore[return-value]


def mean_pooled_embeddings(model, tokenizer, texts: list[str], max_length: int, batch_size: int) -> tuple[np.ndarray, int]:
    """Sentence embeddings as mlx-embeddings computes them (mean-pooled, L2-normalised), and the
    number of tokens run after truncation."""
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    rows = run_batches(
        ids, None, batch_size, tokenizer.pad_token_id or 0,
        lambda input_ids, _types, mask: model(input_ids, attention_mask=mask).text_embeds,
    )
    return np.stack(rows), sum(len(x) for x in ids)
