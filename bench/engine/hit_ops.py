"""How many device operations a prefix hit's group costs before its prefill: every row's cached prefix
fetched from the block cache and the rows merged into one batch cache, as the engine does, counted
from MLX's own lazy graph (mx.export_to_dot), with no device needed.

    python -m bench.engine.hit_ops [--rows 6] [--cached 3000] [--layers 16] [--block-tokens 128 512]

A GPU runs each as a kernel (MLX's CUDA backend adds each to a CUDA graph; a Concatenate copies each
of its inputs with a kernel of its own), so on a device where launching costs more than copying
these bytes, the count is the cost. Views (Slice, Squeeze, Reshape, Broadcast) launch nothing. The
1B shape's cache by default: 8 KV heads of 64, bfloat16. Prints a table and writes JSON."""

import argparse
import collections
import re
import tempfile
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from bench.report import write_json
from deployments.engines.prefix_cache import PrefixCache

VIEWS = {"Slice", "Squeeze", "Reshape", "Broadcast", "ExpandDims"}


def launches(arrays: list[mx.array]) -> tuple[int, dict[str, int]]:
    """Kernels the lazy graph behind `arrays` runs, and its primitives by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        dot = Path(f.name).read_text()
    nodes = dict(re.findall(r'(\w+) \[label ?= ?"(\w+)"', dot))
    inputs = collections.Counter(dst for _, dst in re.findall(r'"?(\w+)"? -> "?(\w+)"?', dot))
    kinds = collections.Counter(nodes.values())
    count = sum(inputs[n] if kind == "Concatenate" else 1 for n, kind in nodes.items() if kind not in VIEWS)
    return count, dict(kinds)


def group(rows: int, cached: int, layers: int, heads: int, dim: int, block_tokens: int) -> tuple[int, dict[str, int]]:
    kept = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, heads, cached, dim), mx.bfloat16), mx.zeros((1, heads, cached, dim), mx.bfloat16))
        kept.append(c)
    mx.eval([c.keys for c in kept] + [c.values for c in kept])
    tokens = list(range(cached))
    blocks = PrefixCache(block_tokens=block_tokens, max_bytes=2**40)
    blocks.insert(tokens, kept)
    merged = hit_caches(blocks, tokens, rows, layers)
    return launches([c.keys for c in merged] + [c.values for c in merged])


def hit_caches(blocks: PrefixCache, tokens: list[int], rows: int, layers: int) -> list[Any]:
    """A group's batch cache as the engine builds it on a prefix hit, lazily: `rows` rows that each
    begin with `tokens` (all cached), every row's prefix fetched from `blocks` (its blocks joined),
    then the rows merged layer by layer (mlx-lm's BatchKVCache.merge, as its batch does)."""
    fetched = [blocks.fetch([*tokens, row], limit=len(tokens))[0] or [] for row in range(rows)]
    return [BatchKVCache.merge([f[layer] for f in fetched]) for layer in range(layers)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--cached", type=int, default=3000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine-hit-ops.json"))
    a = ap.parse_args(argv)
    cells = []
    print(f"| a group of {a.rows} rows, {a.cached} cached tokens each, {a.layers} layers | kernels | primitives |")
    print("|---|---:|---|")
    for block_tokens in a.block_tokens:
        count, kinds = group(a.rows, a.cached, a.layers, a.heads, a.dim, block_tokens)
        cells.append({"block_tokens": block_tokens, "kernels": count, "primitives": kinds})
        print(f"| {block_tokens}-token blocks | {count} | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} |")
    write_json({"rows": a.rows, "cached": a.cached, "layers": a.layers, "cells": cells}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
