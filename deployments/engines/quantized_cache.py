"""A quantized KV cache that batches: what `kv_bits` gives an LLM engine.

mlx-lm quantizes a cache for one stream (QuantizedKVCache, `maybe_quantize_kv_cache`) but its
BatchGenerator merges, extends, filters and extracts only BatchKVCache and BatchRotatingKVCache, so
a quantized cache cannot join a batch there. `BatchQuantizedKVCache` is mlx-lm's BatchKVCache with
each of keys and values held as mx.quantize's triple (packed integers, scales, biases) instead of
one array: the same left padding, offsets and masks, every operation on the sequence axis applied
to the three arrays alike (quantization groups run along the head dimension, so a token's row is
cut, padded or rolled without requantizing). It carries `bits` and `group_size`, which is how
mlx-lm's attention (models/base.py, scaled_dot_product_attention) picks its quantized path.

`QuantizedKVCache` is mlx-lm's single-stream class with the `merge` a BatchGenerator calls on the
caches a request joins with: an empty one for a new prompt, or one holding a cached prefix (the
block prefix cache keeps its blocks in this quantized form, so a fetched prefix is not quantized
twice). Only models whose every layer is a plain KVCache get these (`quantizable`); a sliding
window or an SSM's state is refused at load (deployments/engines/llm.py).

Every method runs on the engine's MLX thread, as the caches it replaces do."""

from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache as _SingleQuantizedKVCache, dynamic_roll

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)

Triple = tuple[mx.array, mx.array, mx.array]


def _map(f: Callable[[mx.array], mx.array], q: Triple) -> Triple:
    return (f(q[0]), f(q[1]), f(q[2]))


def _int(a: mx.array) -> int:
    return int(cast(int, a.item()))


def row_start(left_padding: mx.array, idx: int) -> int:
    """Where a batch's row `idx` begins: read from the (evaluated) array, not by evaluating a new
    slice of it, which would wait for the batch's next step that mlx-lm has already sent off."""
    return cast(list[int], left_padding.tolist())[idx]


def triple_nbytes(q: Triple | None) -> int:
    return 0 if q is None else sum(x.nbytes for x in q)


class QuantizedKVCache(_SingleQuantizedKVCache):
    """One stream's quantized cache (mlx-lm's), which a batch can be made of."""

    @classmethod
    def merge(cls, caches: Sequence["QuantizedKVCache"]) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        """0 while empty (mlx-lm's own fails then: a request waiting to join a batch holds one)."""
        return triple_nbytes(self.keys) + triple_nbytes(self.values)


def quantizable(layer_caches: Sequence[Any]) -> bool:
    """Whether a model's fresh cache (mlx-lm's make_prompt_cache) is plain KV in every layer."""
    return bool(layer_caches) and all(type(c) is KVCache for c in layer_caches)


class BatchQuantizedKVCache:
    """mlx-lm's BatchKVCache with quantized keys and values (see the module's docstring).

    Rows are left-padded: row i's tokens sit at [left_padding[i], _idx) of the sequence axis and
    its position (RoPE's offset) is offset[i] = _idx - left_padding[i]."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    # ---- what attention calls --------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            rows, heads = keys.shape[:2]
            grow = (self.step + n - 1) // self.step * self.step
            new_k = self._zeros(rows, heads, grow, keys.shape[3], keys.dtype)
            new_v = self._zeros(rows, heads, grow, values.shape[3], values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                old_k, old_v = self.keys, self.values
                if prev % self.step != 0:
                    old_k, old_v = _map(lambda x: x[..., :prev, :], old_k), _map(lambda x: x[..., :prev, :], old_v)
                self.keys = (*(mx.concatenate([a, b], axis=2) for a, b in zip(old_k, new_k, strict=True)),)  # type: ignore[assignment]
                self.values = (*(mx.concatenate([a, b], axis=2) for a, b in zip(old_v, new_v, strict=True)),)  # type: ignore[assignment]
        self.offset = self.offset + n
        self._idx += n
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        assert self.keys is not None and self.values is not None
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = q_keys[i]
            self.values[i][..., prev : self._idx, :] = q_values[i]
        return self.keys_and_values()

    def _zeros(self, rows: int, heads: int, length: int, dim: int, dtype: mx.Dtype) -> Triple:
        packed = dim * self.bits // 32
        groups = dim // self.group_size
        return (
            mx.zeros((rows, heads, length, packed), dtype=mx.uint32),
            mx.zeros((rows, heads, length, groups), dtype=dtype),
            mx.zeros((rows, heads, length, groups), dtype=dtype),
        )

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        idx = self._idx
        return _map(lambda x: x[..., :idx, :], self.keys), _map(lambda x: x[..., :idx, :], self.values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    # ---- what mlx-lm's batches call --------------------------------------------------------
    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None, right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKVCache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """A right-padded prefill's padding moves to the left, where the mask hides it."""
        if self._right_padding is None:
            return
        shift = self._right_padding[:, None]
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda x: dynamic_roll(x, shift, axis=2), self.keys)
            self.values = _map(lambda x: dynamic_roll(x, shift, axis=2), self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def filter(self, batch_indices: Any) -> None:
        """Keep only these rows (in place), then drop the padding every row has on the left."""
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = _int(self.left_padding.min())
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append another batch's rows (in place), both right-aligned at the longer one's index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        held = self.keys if self.keys is not None else other.keys
        held_v = self.values if self.values is not None else other.values
        assert held is not None and held_v is not None
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c: "BatchQuantizedKVCache") -> tuple[Triple, Triple, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None or v is None:
                rows = c.offset.shape[0]
                k = _map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), held)
                v = _map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), held_v)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = _map(lambda x: x[..., :right, :], k), _map(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = _map(lambda x: mx.pad(x, pad), k), _map(lambda x: mx.pad(x, pad), v)
            return k, v, c.offset, c.left_padding + left

        (ka, va, oa, pa), (kb, vb, ob, pb) = aligned(self), aligned(other)
        self.keys = (*(mx.concatenate([a, b]) for a, b in zip(ka, kb, strict=True)),)  # type: ignore[assignment]
        self.values = (*(mx.concatenate([a, b]) for a, b in zip(va, vb, strict=True)),)  # type: ignore[assignment]
        self.offset, self.left_padding = mx.concatenate([oa, ob]), mx.concatenate([pa, pb])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` alone, without its padding: a finished request's cache, for the prefix cache."""
        assert self.keys is not None and self.values is not None
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        start, end = row_start(self.left_padding, idx), self._idx
        keys = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]), self.keys)
        values = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]), self.values)
        cache.state = (keys, values, end - start, self.group_size, self.bits)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> Self:
        """One batch of single-stream caches, left-padded to the longest."""
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size=first.group_size, bits=first.bits)
        if any(c.keys is not None and (c.bits, c.group_size) != (first.bits, first.group_size) for c in caches):
            raise ValueError("caches quantized with different bits or group sizes cannot be merged")
        padding = [longest - n for n in lengths]
        held = next(c for c in caches if c.keys is not None)
        rows = len(caches)

        def empty(like: Triple) -> Triple:
            return _map(lambda x: mx.zeros((rows, x.shape[1], longest, x.shape[3]), dtype=x.dtype), like)

        keys, values = empty(cast(Triple, held.keys)), empty(cast(Triple, held.values))
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for j in range(3):
                keys[j][i : i + 1, :, p : p + c.offset] = c.keys[j][..., : c.offset, :]
                values[j][i : i + 1, :, p : p + c.offset] = c.values[j][..., : c.offset, :]
        batch = cls(padding, group_size=held.group_size, bits=held.bits)
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return triple_nbytes(self.keys) + triple_nbytes(self.values)


def fresh_caches(layers: int, bits: int, group_size: int) -> list[QuantizedKVCache]:
    """A new request's empty cache, one per layer."""
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(layers)]
