"""Batch caches that give a row's KV to the block prefix cache as views, not as a copy.

When a request finishes, or is kept at its first token (its prompt shared with arrivals that begin
alike), mlx-lm's `BatchKVCache.extract` hands over its row as a copy of its whole KV (`mx.contiguous`),
and the block prefix cache then copies out only the blocks it lacks: usually one or two of a long
prompt, whose shared system prompt and earlier turns it holds already. Evaluating those blocks
evaluated the whole copy first: a transient the size of the row's KV (tests/test_prefix_cache.py
measures it) and the time to write it. From views only the new blocks are copied: on this CPU,
llama-10m, 16 agent conversations at a time, the block cache's inserts took 0.17-0.19 s of a cell
against 1.05-1.08 s (`python -m bench.engine.agent --concurrency 16 --variants blocks --phases`).

A view keeps the batch's arrays alive for as long as it lives, so these classes are only for a
receiver that copies what it keeps at once, as `PrefixCache.insert` does; mlx-lm's LRUPromptCache
keeps the caches it is given, and an engine using it keeps mlx-lm's own classes. A batch takes the
class of the caches its rows join with (mlx-lm's `_merge_caches` calls the first row's `merge`), so
an engine with the block cache gives every row one of these: `fresh` for a new prompt, and the
prefix cache's `fetch` for a cached prefix."""

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import BatchKVCache, KVCache

from deployments.engines.quantized_cache import BatchQuantizedKVCache, QuantizedKVCache, row_start


class BlockKVCache(KVCache):
    """One request's plain KV cache, whose batch extracts rows as views."""

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "RowViewBatchKVCache":
        batch = RowViewBatchKVCache.merge(caches)
        batch.__class__ = RowViewBatchKVCache  # mlx-lm makes a plain BatchKVCache when every cache is empty
        return batch


class RowViewBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache, but `extract` gives the row's keys and values as views."""

    def extract(self, idx: int) -> BlockKVCache:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        start = row_start(self.left_padding, idx)
        cache = BlockKVCache()
        cache.keys = keys[idx : idx + 1, :, start : self._idx]
        cache.values = values[idx : idx + 1, :, start : self._idx]
        cache.offset = self._idx - start
        return cache


class BlockQuantizedKVCache(QuantizedKVCache):
    """One request's quantized cache (kv_bits), whose batch extracts rows as views."""

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "RowViewBatchQuantizedKVCache":
        return RowViewBatchQuantizedKVCache.merge(caches)


class RowViewBatchQuantizedKVCache(BatchQuantizedKVCache):
    """BatchQuantizedKVCache whose `extract` gives the row's triples as views."""

    def extract(self, idx: int) -> BlockQuantizedKVCache:
        assert self.keys is not None and self.values is not None
        start, end = row_start(self.left_padding, idx), self._idx
        cache = BlockQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        keys = tuple(x[idx : idx + 1, :, start:end] for x in self.keys)
        values = tuple(x[idx : idx + 1, :, start:end] for x in self.values)
        cache.state = (keys, values, end - start, self.group_size, self.bits)
        return cache


def fresh(layers: int, kv_bits: int | None, kv_group_size: int) -> list[Any]:
    """A new request's empty cache, one per layer, for an engine with the block prefix cache."""
    if kv_bits is None:
        return [BlockKVCache() for _ in range(layers)]
    return [BlockQuantizedKVCache(group_size=kv_group_size, bits=kv_bits) for _ in range(layers)]
