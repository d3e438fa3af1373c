"""Where an LLM engine's time goes, phase by phase: a profiler for bench runs, not for serving.

`timed()` wraps the engine's and mlx-lm's phases (a group's prefill, a decode step, the move of a
prefilled group into the decoding batch, the prefix cache's fetch and insert), waits for the device at
the end of each (mx.synchronize, so a phase's GPU work is charged to it and not to whatever evaluates
next) and adds up calls and seconds. It also records the distinct shapes the attention sees (rows,
query length, key length, mask): on MLX's CUDA backend each new shape of a prefill builds a cuDNN
graph of its own (mlx/backend/cuda/scaled_dot_product_attention.cpp keys its graph cache by shapes
and strides), which a Mac's Metal kernels do not. Synchronizing removes the overlap of host and
device work, so a run under `timed()` says where time goes, not how fast the engine is."""

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the module: the package's attribute of that name is a function)
import mlx_lm.models.base as base

from deployments.engines import prefix_cache

generate = sys.modules["mlx_lm.generate"]

# (owner, attribute, phase name)
PHASES: list[tuple[Any, str, str]] = [
    (generate.PromptProcessingBatch, "prompt", "prefill (a group's chunk)"),
    (generate.PromptProcessingBatch, "generate", "prefilled group -> decoding rows"),
    (generate.PromptProcessingBatch, "split", "split a prefilled group off"),
    (generate.GenerationBatch, "next", "decode step"),
    (generate.GenerationBatch, "extend", "merge a group into the batch"),
    (generate.BatchGenerator, "_make_batch", "build a group (merge its caches)"),
    (prefix_cache.PrefixCache, "fetch", "prefix cache: fetch"),
    (prefix_cache.PrefixCache, "insert", "prefix cache: insert"),
]


def _add(table: dict[str, list[float]], name: str, seconds: float) -> None:
    entry = table.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += seconds


def _timed_prompt(fn: Callable, name: str, table: dict[str, list[float]], calls: list[dict[str, Any]]) -> Callable:
    """A group's prefill chunk in three parts, each waited for on the device: the work queued before
    it (the decode step in flight), its caches (the rows' prefix hits joined and merged, built lazily
    until now) and the forward itself. Every call's shape and parts go to `calls`."""

    def timed_prompt(batch: Any, tokens: list[list[int]]) -> Any:
        if not tokens:
            return fn(batch, tokens)  # mlx-lm calls it every step, mostly with nothing to prefill
        started = time.perf_counter()
        mx.synchronize()
        queued = time.perf_counter()
        mx.eval([c.state for c in batch.prompt_cache])
        mx.synchronize()
        built = time.perf_counter()
        first = batch.prompt_cache[0] if batch.prompt_cache else None
        cached = getattr(first, "_idx", 0)
        row_cached = first.offset.tolist() if first is not None and isinstance(getattr(first, "offset", None), mx.array) else [0] * len(tokens)
        try:
            return fn(batch, tokens)
        finally:
            mx.synchronize()
            done = time.perf_counter()
            _add(table, "prefill: work queued before it", queued - started)
            _add(table, "prefill: its caches (hits joined, rows merged)", built - queued)
            _add(table, name, done - built)
            lengths = [len(t) for t in tokens]
            calls.append(
                {
                    "rows": len(tokens),
                    "longest": max(lengths),
                    "tokens": sum(lengths),
                    "cached": int(cached),
                    "row_cached": row_cached,
                    "row_new": lengths,
                    "queued_ms": round(1000 * (queued - started), 2),
                    "caches_ms": round(1000 * (built - queued), 2),
                    "forward_ms": round(1000 * (done - built), 2),
                }
            )

    return timed_prompt


def _wrap(fn: Callable, name: str, table: dict[str, list[float]]) -> Callable:
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            mx.synchronize()
            _add(table, name, time.perf_counter() - started)

    return timed_call


@contextlib.contextmanager
def timed() -> Iterator[dict[str, Any]]:
    """Phases timed while the block runs; yields {"phases": {name: [calls, seconds]}, "attention_shapes": set,
    "prefill_calls": [each prefill chunk's shape and parts]}."""
    table: dict[str, list[float]] = {}
    calls: list[dict[str, Any]] = []  # every prefill chunk: its shape and parts
    shapes: set[tuple] = set()
    saved: list[tuple[Any, str, Any]] = []
    sdpa = base.scaled_dot_product_attention

    def attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, *rest: Any, **kw: Any) -> Any:
        k = keys[0] if isinstance(keys, tuple) else keys
        m = mask.shape if isinstance(mask, mx.array) else mask
        if queries.shape[2] > 1:  # prefill: decode steps take the vector kernel, no graph
            shapes.add((tuple(queries.shape), tuple(k.shape), str(m)))
        return sdpa(queries, keys, values, cache, scale, mask, *rest, **kw)

    try:
        for owner, attr, name in PHASES:
            fn = owner.__dict__[attr]
            saved.append((owner, attr, fn))
            wrapped = _timed_prompt(fn, name, table, calls) if attr == "prompt" else _wrap(fn, name, table)
            setattr(owner, attr, wrapped)

        for module in list(sys.modules.values()):  # every model module imported the function by name
            if getattr(module, "__name__", "").startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is sdpa:
                saved.append((module, "scaled_dot_product_attention", sdpa))
                module.scaled_dot_product_attention = attention  # type: ignore[attr-defined]
        yield {"phases": table, "attention_shapes": shapes, "prefill_calls": calls}
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def summary(result: dict[str, Any], wall_s: float) -> dict[str, Any]:
    phases = {
        name: {"calls": int(c), "seconds": round(s, 3), "ms_per_call": round(1000 * s / max(1, c), 2)} for name, (c, s) in result["phases"].items()
    }
    return {
        "wall_s": round(wall_s, 2),
        "phases": phases,
        "distinct_prefill_attention_shapes": len(result["attention_shapes"]),
        "prefill_calls": result["prefill_calls"],
    }
