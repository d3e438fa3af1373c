"""What a loaded model holds, measured in its own process: the figures its reservation comes from once
it has loaded (the folder's estimate, deployments/estimate.py, is only for before the first load).

- weights as resident: MLX's active memory after the load less before it;
- the cache per layer kind, from the real cache objects: the model's own make_prompt_cache (or the
  engine's quantized caches) with one token run through it; a layer with keys holds its buffers'
  bytes over their token slots per token (up to its max_size for a RotatingKVCache), any other
  layer (an ArraysCache: a convolution tail and a recurrent state) the same bytes at any context;
- a prefill step's activation peak: MLX's peak over a step of `rows` x `chunk` prompt tokens, less
  what was active before it and what the cache grew by, at two context offsets (0 and one chunk);
  attention's scratch grows linearly with the context a chunk attends to, so the reserved context's
  figure is the line through those two (a chunk at the reserved context itself would cost a whole
  prefill at load).

`limit_bytes` is what the process may hold: weights, the KV of `reserve_concurrency` sequences of
`reserve_context_tokens`, one prefill step's activations at that context, and the prefix cache's
budget. The engine sets MLX's memory limit (and on Metal its wired limit) to it, and refuses a
request whose own cache could never fit the reservation (`fits`)."""

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from pydantic import Field

from deployments.cache_shape import CacheShape
from policy._frozen import Frozen

logger = logging.getLogger(__name__)


class MeasuredMemory(Frozen):
    """What a loaded model holds, measured (module docstring); `estimated_*`: the folder's figures
    for the same, side by side."""

    weights_hash: str = ""
    weight_bytes: int = Field(ge=0)
    cache: CacheShape
    activation_bytes: int = Field(ge=0)  # one prefill step at the reserved context
    activation_base_bytes: int = Field(default=0, ge=0)  # ... at context 0
    activation_bytes_per_token: float = Field(default=0.0, ge=0)  # ... its growth per token of context
    prefill_rows: int = Field(default=1, ge=1)
    prefill_chunk: int = Field(default=1, ge=1)
    reserve_context_tokens: int = Field(ge=0)
    reserve_concurrency: int = Field(ge=1)
    prefix_cache_bytes: int = Field(default=0, ge=0)  # the kept prefixes' budget (X4 counts them apart)
    seconds: float = Field(default=0.0, ge=0)
    estimated_weight_bytes: int = Field(default=0, ge=0)
    estimated_cache: CacheShape | None = None

    @property
    def kv_reserved_bytes(self) -> int:
        return self.reserve_concurrency * self.cache.sequence_bytes(self.reserve_context_tokens, self.prefill_chunk)

    @property
    def reserved_bytes(self) -> int:
        """Weights, the KV reservation and one prefill step: what the model may hold beside its kept prefixes."""
        return self.weight_bytes + self.kv_reserved_bytes + self.activation_bytes

    @property
    def limit_bytes(self) -> int:
        return self.reserved_bytes + self.prefix_cache_bytes

    def fits(self, tokens: int) -> bool:
        """Whether one sequence of `tokens` fits the KV reservation (with nothing else running)."""
        return self.cache.sequence_bytes(tokens, self.prefill_chunk) <= self.kv_reserved_bytes


def _arrays(x: Any) -> list[mx.array]:
    return [a for _, a in cast(list[tuple[str, Any]], tree_flatten(x)) if isinstance(a, mx.array)]


def _layer(cache: Any) -> tuple[int, int, int]:
    """(bytes per token, fixed bytes, window) of one layer's cache after a token: a cache with keys
    (KVCache, RotatingKVCache, a quantized one, a latent one) holds its buffers' bytes over their
    token slots per token, up to its max_size if it has one; any other (an ArraysCache) holds its
    arrays whatever the context; a CacheList, its members'."""
    if isinstance(getattr(cache, "caches", None), (list, tuple)):
        parts = [_layer(c) for c in cache.caches]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), max((p[2] for p in parts), default=0)
    keys = getattr(cache, "keys", None)
    if keys is not None and hasattr(cache, "offset"):
        held = _arrays((keys, getattr(cache, "values", None)))
        slots = held[0].shape[-2]
        size = getattr(cache, "max_size", None)
        return sum(a.nbytes for a in held) // slots, 0, size if isinstance(size, int) else 0
    return 0, sum(a.nbytes for a in _arrays(cache.state)), 0


def cache_shape(model: Any, caches: Callable[[], list[Any]]) -> CacheShape:
    """The cache per layer kind from `caches()` (fresh caches as the engine makes them), one token
    run through them (module docstring)."""
    layers = caches()
    model(mx.array([[1]]), cache=layers)
    mx.eval([c.state for c in layers])
    full = window = window_tokens = state = 0
    counts: dict[str, int] = {}
    for layer in layers:
        per_token, fixed, size = _layer(layer)
        kind = "window" if size and per_token else "full" if per_token else "state" if fixed else "none"
        counts[kind] = counts.get(kind, 0) + 1
        if size:
            window, window_tokens = window + per_token, max(window_tokens, size)
        else:
            full += per_token
        state += fixed
    return CacheShape(full_bytes_per_token=full, window_bytes_per_token=window, window_tokens=window_tokens, state_bytes=state, layers=counts)


def _step_activation(model: Any, layers: list[Any], rows: int, chunk: int, vocab: int) -> int:
    """MLX's peak over one prefill step of `rows` x `chunk` tokens (as mlx-lm's prefill runs it: the
    caches evaluated, the logits not), less what was active before and what the caches grew by."""
    tokens = mx.random.randint(0, vocab, (rows, chunk))
    mx.eval(tokens)
    mx.synchronize()
    mx.reset_peak_memory()
    model(tokens, cache=layers)
    mx.eval([c.state for c in layers])
    mx.synchronize()
    peak, after = mx.get_peak_memory(), mx.get_active_memory()
    return max(0, peak - after)


def activation(model: Any, caches: Callable[[], list[Any]], rows: int, chunk: int, vocab: int) -> tuple[int, float]:
    """(a prefill step's activations at context 0, their growth per token of context), from steps at
    offsets 0 and `chunk` of one batch of `rows` fresh caches."""
    layers = caches()  # one cache per layer holds the whole batch (B = rows)
    first = _step_activation(model, layers, rows, chunk, vocab)
    second = _step_activation(model, layers, rows, chunk, vocab)
    del layers
    mx.clear_cache()
    return first, max(0.0, (second - first) / chunk)


def measure(
    model: Any,
    caches: Callable[[], list[Any]],
    *,
    weight_bytes: int,
    vocab: int,
    reserve_context_tokens: int,
    reserve_concurrency: int,
    prefill_chunk: int,
    prefill_rows: int,
    prefix_cache_bytes: int = 0,
    weights_hash: str = "",
    estimated_weight_bytes: int = 0,
    estimated_cache: CacheShape | None = None,
) -> MeasuredMemory:
    """Every figure of MeasuredMemory for a model just loaded (its weights `weight_bytes` as
    measured around the load)."""
    started = time.perf_counter()
    shape = cache_shape(model, caches)
    rows = max(1, min(prefill_rows, reserve_concurrency))
    chunk = max(1, min(prefill_chunk, reserve_context_tokens or 1))
    base, per_token = activation(model, caches, rows, chunk, vocab)
    at_context = base + int(per_token * max(0, reserve_context_tokens - chunk) + 0.5)
    return MeasuredMemory(
        weights_hash=weights_hash,
        weight_bytes=weight_bytes,
        cache=shape,
        activation_bytes=at_context,
        activation_base_bytes=base,
        activation_bytes_per_token=per_token,
        prefill_rows=rows,
        prefill_chunk=chunk,
        reserve_context_tokens=reserve_context_tokens,
        reserve_concurrency=reserve_concurrency,
        prefix_cache_bytes=prefix_cache_bytes,
        seconds=time.perf_counter() - started,
        estimated_weight_bytes=estimated_weight_bytes,
        estimated_cache=estimated_cache,
    )


def set_limits(limit_bytes: int) -> None:
    """MLX's memory limit for this process (on Metal, also the wired limit: what it may keep
    resident); a process serves one model, so the model's limit is the process's."""
    mx.set_memory_limit(int(limit_bytes))
    if mx.metal.is_available():
        try:
            mx.set_wired_limit(int(limit_bytes))
        except ValueError as e:  # past the device's ceiling: the node's iogpu.wired_limit_mb
            logger.warning("wired limit of %d bytes refused: %s", limit_bytes, e)


def caches_of(model: Any, make: Callable[[Any], list[Any]], quantized: Callable[[int], list[Any]] | None) -> Callable[[], list[Any]]:
    """Fresh caches as the engine makes them: the engine's quantized ones where it quantizes (given
    the layer count), else the model's own make_prompt_cache."""
    if quantized is not None:
        layers = len(make(model))
        return lambda: quantized(layers)
    return lambda: make(model)
